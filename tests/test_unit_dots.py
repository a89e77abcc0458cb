"""math/unit_dots.py: the blocked one-pass dots of a prompt against the update equal the reference
closed form (math/adamw.py's ``adamw_update`` and ``adamw_jacobian``, written out and dotted), for
AdamW and plain SGD, with and without the prompt's Y, across block boundaries."""
from __future__ import annotations

import pytest
import torch

from conftest import fp_tol
from entprobe.math import unit_dots as ud
from entprobe.math.adamw import AdamWHyper, adamw_jacobian, adamw_update


def _inputs(n: int, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda scale=1.0: torch.randn(n, generator=g, dtype=dtype) * scale  # noqa: E731
    x, y, Y, m, theta = r(), r(1e-3), r(1e-3), r(1e-4), r()
    v = r(1e-3).square()
    v[: n // 10] = 0.0  # coordinates never updated: AdamW divides by eps there
    y[: n // 20] = 0.0
    m[: n // 20] = 0.0
    return x, y, Y, m, v, theta


def _reference(x, y, Y, m, v, theta, h: AdamWHyper, adam: bool, alpha: float, beta: float) -> list[float]:
    yl = alpha * y - (beta * Y if Y is not None else 0.0)
    if adam:
        at, loo, J = adamw_update(y, m, v, theta, h), adamw_update(yl, m, v, theta, h), adamw_jacobian(y, m, v, h)
        jd = J["gradient"] + J["momentum"]
        parts = [at["gradient"], at["momentum"], at["weight_decay"], jd * y, loo["gradient"], loo["momentum"]]
    else:
        jd = torch.full_like(y, h.lr)
        wdp = theta * (-h.lr * h.weight_decay)
        parts = [h.lr * y, torch.zeros_like(y), wdp, jd * y, h.lr * yl, torch.zeros_like(y)]
    parts.append(jd * Y if Y is not None else torch.zeros_like(y))
    return [float((x * p).sum()) for p in parts], jd, parts


@pytest.mark.parametrize("adam", [True, False], ids=["adamw", "sgd"])
@pytest.mark.parametrize("with_Y", [True, False], ids=["with_Y", "no_Y"])
def test_unit_dots_equal_the_written_out_update(adam, with_Y):
    n = 3 * ud.BLOCK + 17  # several blocks and a short last one
    x, y, Y, m, v, theta = _inputs(n)
    Y = Y if with_Y else None
    h = AdamWHyper(lr=1e-3, weight_decay=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=4.0)
    alpha, beta = 8.0 / 7.0 * 0.93, 0.93 / 7.0  # B = 8 and a clip factor folded in
    ref, jd, parts = _reference(x, y, Y, m, v, theta, h, adam, alpha, beta)
    got = ud.unit_dots(x, y, Y, jd, h, adam, alpha, beta, m if adam else None, v if adam else None, theta)
    assert got.dtype == torch.float64 and got.shape == (len(ud.SLOTS),)
    for k, name in enumerate(ud.SLOTS):
        # a dot over n fp64 products, each a few roundings deep (the update's closed form), summed in
        # another order: |x| |part| bounds the terms' sum (Cauchy-Schwarz)
        tol = fp_tol(torch.float64, float(x.norm() * parts[k].norm()), n, k=8)
        assert abs(float(got[k]) - ref[k]) <= tol, (name, float(got[k]), ref[k], tol)
    if not with_Y:
        assert float(got[ud.SLOTS.index("jY")]) == 0.0
    if not adam:
        assert float(got[ud.SLOTS.index("momentum")]) == 0.0 == float(got[ud.SLOTS.index("momentum_loo")])


def test_unit_dots_in_fp32_match_fp64_to_fp32_rounding():
    """Parameters and gradients in fp32 (the probe's usual case): products in fp32, block sums in fp64."""
    n = 2 * ud.BLOCK + 5
    x, y, Y, m, v, theta = _inputs(n, seed=1)
    h = AdamWHyper(lr=1e-5, weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8, step=10.0)
    ref, jd, parts = _reference(x, y, Y, m, v, theta, h, True, 1.1, 0.1)
    f = lambda t: t.float()  # noqa: E731
    got = ud.unit_dots(f(x), f(y), f(Y), f(jd), h, True, 1.1, 0.1, f(m), f(v), None)
    for k, name in enumerate(ud.SLOTS):
        # each product a few fp32 roundings deep (inputs rounded to fp32, the closed form), summed by
        # blocks of BLOCK fp32 terms
        tol = fp_tol(torch.float32, float(x.norm() * parts[k].norm()), ud.BLOCK, k=8) * (n / ud.BLOCK) ** 0.5
        assert abs(float(got[k]) - ref[k]) <= tol, (name, float(got[k]), ref[k], tol)


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD], ids=["adamw", "sgd"])
def test_step_models_unit_dots_over_groups_chunks_and_a_stateless_parameter(opt_cls):
    """``StepModel.unit_dots`` of the closed forms (step_model._closed_form): over two param groups of
    different hyper-parameters, small parameters concatenated into one chunk, and a parameter AdamW
    never stepped, it equals the written-out update at Ybar and at ``alpha Ybar - beta Y`` dotted with X,
    and ``X . J Ybar``, ``X . J Y`` with J from ``jacobian_times_into``."""
    from test_clipped_step import model_with_history

    from entprobe.pipeline.stages.prediction import build_step_model

    params, opt, ctx, gen = model_with_history(opt_cls)
    r = lambda: [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]  # noqa: E731
    Ybar, Y, X = r(), r(), r()
    alpha, beta = 8.0 / 7.0, 1.0 / 7.0
    lr = float(opt.param_groups[0]["lr"])
    step = build_step_model(ctx, opt, lr, Ybar, None, "optimizer", None)
    loo = build_step_model(ctx, opt, lr, [alpha * a - beta * b for a, b in zip(Ybar, Y)], None, "optimizer", None)
    jd = [torch.ones_like(p) for p in params]
    step.jacobian_times_into([t.clone() for t in jd], jd)
    got = step.unit_dots(X, Y, alpha, beta, jd)

    def written(model):
        parts = {k: [torch.zeros_like(p) for p in params] for k in model.names}
        model.write(parts)
        return parts
    at, without = written(step), written(loo)
    dot = lambda a, b: float(sum((u * w).sum() for u, w in zip(a, b)))  # noqa: E731
    ref = {"jy": dot(X, [j * y for j, y in zip(jd, Ybar)]), "jY": dot(X, [j * y for j, y in zip(jd, Y)])}
    for k in step.names:
        ref[k] = dot(X, at[k])
        if k != "weight_decay":
            ref[k + "_loo"] = dot(X, without[k])
    scale = sum(float(x.abs().sum()) for x in X) * max(float(t.abs().max()) for parts in (at, without)
                                                       for buf in parts.values() for t in buf)
    for k, v in ref.items():
        # 30 fp64 coordinates, each a few roundings deep in either form
        assert abs(float(got[ud.SLOTS.index(k)]) - v) <= fp_tol(torch.float64, scale + abs(v), 30, k=8), (k, v)
    missing = set(ud.SLOTS) - set(ref)
    assert all(float(got[ud.SLOTS.index(k)]) == 0.0 for k in missing)  # SGD: no momentum part


@pytest.mark.parametrize("adam", [True, False], ids=["adamw", "sgd"])
def test_check_dots_equal_the_written_out_update_and_theta(adam):
    """``check_dots`` (the online step check's one fp64 pass): Xbar against each part of the update,
    the magnitude sum_i |x_i| sum_part |part_i|, and Xbar against theta, from fp32 inputs (as the probe
    has them) against the same values written out in fp64."""
    n = 2 * ud.BLOCK + 11
    x, y, _, m, v, theta = (t.float() for t in _inputs(n, seed=2))
    h = AdamWHyper(lr=1e-4, weight_decay=0.1, beta1=0.9, beta2=0.999, eps=1e-8, step=3.0)
    d = lambda t: t.double()  # noqa: E731
    if adam:
        at = adamw_update(d(y), d(m), d(v), d(theta), h)
        parts = [at["gradient"], at["momentum"], at["weight_decay"]]
    else:
        parts = [h.lr * d(y), torch.zeros(n, dtype=torch.float64), d(theta) * (-h.lr * h.weight_decay)]
    mag = sum(p.abs() for p in parts)
    ref = [(d(x) * p).sum() for p in parts] + [(d(x).abs() * mag).sum(), (d(x) * d(theta)).sum(),
                                                (d(x).abs() * d(theta).abs()).sum()]
    got = ud.check_dots(x, y, theta, h, adam, m if adam else None, v if adam else None)
    assert got.dtype == torch.float64 and got.shape == (len(ud.CHECK_SLOTS),)
    for k, name in enumerate(ud.CHECK_SLOTS):
        # fp64 throughout on exact fp32 inputs: a few roundings a term, summed in another order
        tol = fp_tol(torch.float64, float(ref[3] if k < 4 else ref[5]), n, k=8)
        assert abs(float(got[k]) - float(ref[k])) <= tol, (name, float(got[k]), float(ref[k]), tol)
    if not adam:
        assert float(got[1]) == 0.0


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD], ids=["adamw", "sgd"])
def test_dots_with_holds_the_step_torch_takes(opt_cls):
    """``StepModel.dots_with`` (over param groups, concatenated chunks and a parameter never stepped):
    ``-Xbar . (theta_plus - theta)`` of torch's own step, differenced from fp64 dots, is the predicted
    ``Xbar . Delta theta`` within ``step_check_tolerance``; the magnitudes are the written-out ones."""
    from test_clipped_step import model_with_history

    from entprobe.math.adamw import step_check_tolerance
    from entprobe.pipeline.stages.prediction import build_step_model

    params, opt, ctx, gen = model_with_history(opt_cls)
    X = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    Ybar = [torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-2 for p in params]
    lr = float(opt.param_groups[0]["lr"])
    step = build_step_model(ctx, opt, lr, Ybar, None, "optimizer", None)
    step_dot, step_mag, x_theta, x_theta_abs = step.dots_with(X)
    dot64 = lambda a, b: float(sum((u.double() * w.double()).sum() for u, w in zip(a, b)))  # noqa: E731
    assert x_theta == pytest.approx(dot64(X, [p.detach() for p in params]), abs=fp_tol(torch.float64, x_theta_abs, 64))
    assert x_theta_abs == pytest.approx(dot64([x.abs() for x in X], [p.detach().abs() for p in params]),
                                        abs=fp_tol(torch.float64, x_theta_abs, 64))
    parts = {k: [torch.zeros_like(p) for p in params] for k in step.names}
    step.write(parts)
    mag_ref = dot64([x.abs() for x in X], [sum(parts[k][i].abs() for k in step.names) for i in range(len(params))])
    # the written-out parts are fp32 (the model's dtype): each off the fp64 closed form by ~1 ulp
    assert step_mag == pytest.approx(mag_ref, rel=8 * torch.finfo(torch.float32).eps)
    for p, y in zip(params, Ybar):
        p.grad = -y.clone()
    before = dot64(X, [p.detach() for p in params])
    opt.step()
    taken = dot64(X, [p.detach() for p in params]) - before
    u = torch.finfo(torch.float32).eps / 2
    assert abs(taken - step_dot) <= step_check_tolerance(u, x_theta_abs, step_mag), (taken, step_dot)
    assert step_dot != 0.0
