"""The update's parts held as factors (math/factored_directions.py) against the parts written out by
``adamw_update_into``: every dot, per-row dot and per-parameter term, in fp32 over several blocks,
with clipping, a parameter without AdamW state, a group without weight decay; and ``is_zero``."""
from __future__ import annotations

import pytest
import torch

from conftest import dot_set_spy, fp_tol, se_tol
from entprobe.math import factored_directions as fd
from entprobe.math import paramvec as pv
from entprobe.math.adamw import AdamWHyper, adamw_factors_into, adamw_update_into

PARTS = ["gradient", "momentum", "weight_decay"]


def _state(seed: int = 0, clip: float = 1.0):
    """Three parameters (one without AdamW state, the last in a group without decay), Ybar, the
    hyper-parameters, and the written-out rows ``[P Ybar, gradient, momentum, weight_decay]``."""
    g = torch.Generator().manual_seed(seed)
    shapes = [torch.Size([5, 7]), torch.Size([13]), torch.Size([3, 4])]
    theta = [torch.randn(sh, generator=g) for sh in shapes]
    ybar = [torch.randn(sh, generator=g) * 1e-2 for sh in shapes]
    m = [torch.randn(shapes[0], generator=g) * 1e-2, None, torch.randn(shapes[2], generator=g) * 1e-2]
    v = [torch.rand(sh, generator=g) * 1e-4 if mi is not None else torch.zeros(sh) for sh, mi in zip(shapes, m)]
    hyper = [AdamWHyper(1e-3, 0.1, 0.9, 0.999, 1e-8, 7.0), AdamWHyper(1e-3, 0.1, 0.9, 0.999, 1e-8, 0.0),
             AdamWHyper(2e-3, 0.0, 0.8, 0.99, 1e-6, 3.0)]
    P = [torch.rand(sh, generator=g) + 0.5 for sh in shapes]
    rows = pv.empty_directions(4, theta, "cpu", torch.float32)
    rows2 = pv.empty_directions(2, theta, "cpu", torch.float32)
    coefs = []
    for i, h in enumerate(hyper):
        torch.mul(ybar[i], P[i], out=rows.column(0)[i])
        torch.mul(ybar[i], P[i], out=rows2.column(0)[i])
        mi = m[i] if m[i] is not None else torch.zeros(shapes[i])
        out = {k: rows.column(1 + j)[i].view(-1) for j, k in enumerate(PARTS)}
        adamw_update_into((ybar[i] * clip).view(-1), mi.view(-1), v[i].view(-1), theta[i].view(-1), h, out,
                          torch.empty(shapes[i].numel()))
        coefs.append(fd.PartCoefficients(*adamw_factors_into(ybar[i], v[i], h, rows2.column(1)[i], clip)))
    return shapes, theta, ybar, m, rows, fd.FactoredDirections(rows2, ybar, m, theta, coefs, list(PARTS))


@pytest.mark.parametrize("clip", [1.0, 0.3])
def test_factored_dots_equal_the_written_out_parts(clip, monkeypatch):
    monkeypatch.setattr(fd, "BLOCK", 4)  # several blocks a tensor, the last one partial
    shapes, theta, ybar, m, rows, fac = _state(clip=clip)
    assert fac.k == 4 and torch.equal(torch.cat([t.reshape(-1) for t in fac.column(0)]),
                                      torch.cat([t.reshape(-1) for t in rows.column(0)]))
    g = torch.Generator().manual_seed(5)
    units = [[torch.randn((3, *sh), generator=g) for sh in shapes]]
    got, want = pv.dot_rows_set(units[0], fac), pv.dot_rows_set(units[0], rows)
    # each term x_i d_i rounds a few times more on one side (the reciprocal, the product x R): 4 eps
    mag = sum((x.reshape(3, -1).abs().double() @ rows.block(i).abs().double().T) for i, x in enumerate(units[0]))
    n = sum(sh.numel() for sh in shapes)
    tol = torch.tensor([[fp_tol(torch.float32, float(mm), n, k=4.0) for mm in row] for row in mag])
    assert ((got - want).abs() <= tol).all(), (got - want, tol)
    assert (want[:, 1:].abs() > 100 * tol[:, 1:]).all()  # the parts are resolved: a dropped one would fail
    one = [u[0] for u in units[0]]
    assert ((pv.dot_set(one, fac) - want[0]).abs() <= tol[0]).all()  # one row: 1-D dots, another rounding
    terms = fac.part_terms(one)
    for i, x in enumerate(one):
        w = sum(float(x.reshape(-1).double() @ rows.block(i)[j].double()) for j in (1, 2, 3))
        assert abs(float(terms[i]) - w) <= fp_tol(torch.float32, float(mag[0, 1:].sum()), n, k=4.0)
    assert not pv.is_zero(fac)


def test_is_zero_only_when_every_part_is():
    shapes, theta, ybar, m, rows, fac = _state()
    for y in ybar:
        y.zero_()
    for t in fac.column(0):
        t.zero_()
    assert not pv.is_zero(fac)  # momentum and weight decay move
    for mi in m:
        if mi is not None:
            mi.zero_()
    assert not pv.is_zero(fac)  # weight decay
    for c in fac.coefs:
        c.weight_decay = 0.0
    assert pv.is_zero(fac)
    m[2][1, 1] = 1e-30
    assert not pv.is_zero(fac)


def test_refuses_what_it_cannot_hold():
    shapes, theta, ybar, m, rows, fac = _state()
    with pytest.raises(ValueError, match="only the 1 leading row"):
        fac.column(1)
    with pytest.raises(ValueError, match="rows .P Ybar,. R"):
        fd.FactoredDirections(rows, ybar, m, theta, fac.coefs, PARTS)


@pytest.mark.parametrize("total_only", [True, False])
def test_held_out_prediction_with_the_parts_as_factors(total_only, monkeypatch):
    """The held-out prediction (the online probe's, ``total_only``: one direction, the whole update;
    the single-batch mode's: one per part) gives the written-out directions' numbers with the parts
    held as factors (forced on the fp64 exact model, whose AdamW has weight decay)."""
    from exact_model import adamw_with_state, make_setup
    from entprobe.config import ProbeConfig, UnitBackward
    from entprobe.pipeline.stages import prediction
    from entprobe.pipeline.stages import accumulate as accumulate_module
    from entprobe.pipeline.stages.accumulate import accumulate, global_mean, y_loss_of

    setup = make_setup(seed=1)
    opt = adamw_with_state(setup)
    E, U = setup.sample(6, 3, seed=11), setup.sample(5, 3, seed=12)
    pcfg = ProbeConfig(unit_backward=UnitBackward.loop, top_k_params=2)

    def predicted():
        ctx = setup.ctx("per_token_avg", mb_size=2)
        Ybar, _ = global_mean(accumulate(ctx, U, y_loss_of(ctx), "Y").sum_buf, U.B)
        step = prediction.build_step_model(ctx, opt, opt.param_groups[0]["lr"], Ybar, None, "optimizer", None)
        return prediction.predict_on_held_out(ctx, E, step, pcfg, total_only=total_only)
    # per dot_set call of the written-out run (the X pass's running dots, then Xbar's): sum_i |a_i| |d_j,i|
    mags: list[torch.Tensor] = []

    def record(a, dset):
        mags.append(torch.stack([sum((x.detach().double().reshape(-1).abs() @ dset.block(i)[j].double().abs())
                                     for i, x in enumerate(a)) for j in range(dset.k)]))
    with dot_set_spy(accumulate_module, record), dot_set_spy(prediction, record):
        written = predicted()
    made = []
    real = prediction.factored_directions
    monkeypatch.setattr(prediction, "FACTORED_MIN_NUMEL", 0)
    monkeypatch.setattr(prediction, "factored_directions", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    factored = predicted()
    assert len(made) == 1 and made[0] is not None
    assert factored.e.shape == written.e.shape == (6, 1 if total_only else 3)
    # each unit's projection is the increase of the running .grad's dots (accumulate.py): two sums of N
    # terms a unit, each term rounded a few times more on one side (x R, then . Ybar): 4 eps64 a term
    N = sum(p.numel() for p in setup.params)
    run = torch.stack(mags[:E.B])  # the X pass's B_E running dots, in order
    both = run + torch.cat([torch.zeros_like(run[:1]), run[:-1]])
    unit_tol = both.apply_(lambda m: fp_tol(torch.float64, m, N, k=4.0))
    assert ((factored.e - written.e).abs() <= unit_tol).all(), (factored.e - written.e, unit_tol)
    assert (written.e.abs().amax(0) > 100 * unit_tol.amax(0)).all()  # resolved: a dropped part would fail
    for j, k in enumerate(["gradient", "momentum", "weight_decay"]):  # -Xbar . part, after the X pass
        assert written.res[f"deltaH_pred_{k}"] != 0
        m_final = float(mags[E.B][j + (1 if total_only else 0)])
        assert abs(factored.res[f"deltaH_pred_{k}"] - written.res[f"deltaH_pred_{k}"]) <= \
            fp_tol(torch.float64, m_final, N, k=4.0), k
    assert abs(factored.res["SE_deltaH_pred"] - written.res["SE_deltaH_pred"]) <= se_tol(unit_tol.sum(1))
    assert [k for k in factored.res if k.startswith("attr_pred")] == [k for k in written.res if k.startswith("attr_pred")]


def test_one_direction_at_a_time_writes_each_into_one_buffer():
    """``paramvec.OneAtATime`` (U's directions in the forward-mode passes): column j is direction j,
    written over the previous one in the same storage."""
    like = [torch.zeros(3, 2), torch.zeros(4)]
    fills = [lambda out: [o.fill_(1.0) for o in out], lambda out: [o.copy_(torch.arange(o.numel()).view(o.shape))
                                                                   for o in out]]
    d = pv.OneAtATime(fills, like, "cpu", torch.float32)
    first = d.column(0)
    assert d.k == 2 and all(bool((t == 1).all()) for t in first)
    second = d.column(1)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(first, second))
    assert torch.equal(second[1], torch.arange(4.0)) and torch.equal(second[0], torch.arange(6.0).view(3, 2))
