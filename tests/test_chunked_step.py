"""The ground truth's chunked optimizer step (stages/chunked_step.py): the weights it reaches are
bitwise one full ``optimizer.step()``'s, the optimizer state is left bitwise as it was (also when a
chunk's step raises), the ground truth's results are bitwise those of the full-snapshot path, and
the path is taken only where the module's docstring says."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from entprobe.math import paramvec as pv
from entprobe.config import ImportanceConfig, StepMode
from entprobe.pipeline.stages import chunked_step as cs
from entprobe.pipeline.stages import ground_truth as gt
from entprobe.pipeline.stages import step_split
from entprobe.pipeline.stages.accumulate import accumulate, x_loss_of, y_loss_of
from entprobe.pipeline.stages.snapshot import restore, state_fingerprint, take
from exact_model import adamw_with_state, fixed_batch, make_setup

# same shapes three times: a parameter stepped with another's state does not fail on a shape
SHAPES = ((4, 3), (4, 3), (4, 3), (5,), (2, 6), (7,))
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam_decay_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adamw_amsgrad_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),  # all with state (below)
    "groups": lambda ps: torch.optim.AdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0,
                                                                  "betas": (0.8, 0.99)}], lr=1e-2, weight_decay=0.1),
}


class Boom(RuntimeError):
    pass


# torch's fused SGD refuses a step where some parameters have a momentum buffer and others not
# (TypeError in torch._fused_sgd_), a full step as much as a chunk's: there every parameter has state
ALL_WITH_STATE = {"sgd_fused"}


def _grads(ps, gen):
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def _trained(name: str, clip: bool):
    """Parameters and optimizer after 3 steps in which the last parameter had no gradient (so it
    has no state yet: its first step is the probed one; not in ``ALL_WITH_STATE``), holding the
    probed gradient (clipped once over all of it when ``clip``)."""
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    try:
        opt = OPTIMIZERS[name](ps)
    except RuntimeError as e:  # fused on a device that has no fused kernel
        pytest.skip(str(e))
    for _ in range(3):
        _grads(ps if name in ALL_WITH_STATE else ps[:-1], gen)
        opt.step()
    _grads(ps, gen)
    if clip:
        torch.nn.utils.clip_grad_norm_(ps, 0.5)
    return ps, opt


def _state_objects(ps, opt):
    return [(i, k, id(v)) for i, p in enumerate(ps) for k, v in sorted(opt.state.get(p, {}).items())]


def bitwise_equal(a, b) -> bool:
    def bits(t):
        return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("parts", [2, 100], ids=["two_tensors_a_chunk", "a_tensor_a_chunk"])
@pytest.mark.parametrize("clip", [False, True], ids=["", "clipped"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_chunked_step_reaches_one_full_steps_weights_and_leaves_the_state(name, clip, parts):
    """Bitwise: the weights after the chunked step are one ``optimizer.step()``'s (a parameter
    stepped twice, or with another's state or gradient, is off), and every state tensor, key and
    object is as before, the stateless parameter still without state; the gradients are back."""
    full_ps, full = _trained(name, clip)
    full.step()
    ps, opt = _trained(name, clip)
    grads = [p.grad for p in ps]
    assert len(cs.chunks(ps, grads, parts)) > 1
    before, objs = state_fingerprint(ps, opt), _state_objects(ps, opt)
    assert (ps[-1] in opt.state) == (name in ALL_WITH_STATE)
    cs.chunked_step(opt, parts)
    assert bitwise_equal([p.detach() for p in ps], [p.detach() for p in full_ps])
    assert not bitwise_equal(state_fingerprint(full_ps, full)[len(ps):], before[len(ps):])  # the step moves it
    assert bitwise_equal(state_fingerprint(ps, opt)[len(ps):], before[len(ps):])
    assert _state_objects(ps, opt) == objs and (ps[-1] in opt.state) == (name in ALL_WITH_STATE)
    assert all(p.grad is g for p, g in zip(ps, grads))


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_a_chunk_whose_step_raises_leaves_the_state_and_the_restore_the_weights(name):
    """The third chunk's ``optimizer.step()`` moves its parameters and state, then raises: the
    state is bitwise as before (the chunks done and the failing one), and the weights-only snapshot
    restores the weights bitwise."""
    ps, opt = _trained(name, clip=False)
    before, objs = state_fingerprint(ps, opt), _state_objects(ps, opt)
    snap = take(ps, opt, torch.device("cpu"), live_state=True)
    real, calls = opt.step, [0]

    def step(*a, **k):
        calls[0] += 1
        real(*a, **k)
        if calls[0] == 3:
            raise Boom("injected in the third chunk's step")
    opt.step = step
    with pytest.raises(Boom):
        cs.chunked_step(opt, parts=100)
    assert calls[0] == 3
    assert not bitwise_equal([p.detach() for p in ps], before[:len(ps)])  # chunks were stepped
    assert bitwise_equal(state_fingerprint(ps, opt)[len(ps):], before[len(ps):])
    assert _state_objects(ps, opt) == objs and ps[-1] not in opt.state
    assert all(p.grad is not None for p in ps)
    restore(ps, opt, snap)
    assert bitwise_equal(state_fingerprint(ps, opt), before) and _state_objects(ps, opt) == objs


def test_a_live_state_snapshot_copies_only_the_weights():
    ps, opt = _trained("adamw", clip=False)
    snap = take(ps, opt, torch.device("cpu"), live_state=True)
    assert snap.live and all(s is not p for s, p in zip(snap.params, ps))
    assert all(v[0] is opt.state[ps[i]][k] for i, st in snap.state.items() for k, v in st.items())


class OwnStep(torch.optim.AdamW):
    def step(self, closure=None):
        return super().step(closure)


class KeepsStep(torch.optim.AdamW):
    pass


def test_the_chunked_path_is_taken_only_for_known_per_tensor_steps(monkeypatch):
    ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    cpu = torch.device("cpu")

    def applies(opt, dev=cpu, mode="optimizer"):
        return cs.chunked_step_applies(opt, ps, dev, mode)
    for opt in (torch.optim.AdamW(ps), torch.optim.Adam(ps), torch.optim.SGD(ps, lr=0.1), KeepsStep(ps)):
        assert applies(opt), type(opt)
    with_scheduler = torch.optim.AdamW(ps)
    torch.optim.lr_scheduler.StepLR(with_scheduler, 1)  # wraps opt.step on the instance
    assert "step" in vars(with_scheduler) and applies(with_scheduler)
    assert not applies(OwnStep(ps)) and not applies(torch.optim.RMSprop(ps))
    assert not applies(torch.optim.AdamW(ps), mode="preconditioned_sgd") and not applies(None)
    assert not applies(torch.optim.AdamW(ps), dev=torch.device("meta"))  # the snapshot on another device
    hooked = torch.optim.AdamW(ps)
    hooked.register_step_post_hook(lambda *a: None)
    assert not applies(hooked)
    wrapped = torch.optim.AdamW(ps)
    wrapped.step = lambda *a, **k: None
    assert not applies(wrapped)
    monkeypatch.setattr(cs.sharding, "sharded", lambda: True)
    assert not applies(torch.optim.AdamW(ps))


# ---------------------------------------------------------------- through run_ground_truth
ICFG = ImportanceConfig(importance_microbatch_size=64, split_step=True, resample_on_low_ess=False)


@pytest.fixture(scope="module")
def world():
    setup = make_setup()
    opt = adamw_with_state(setup)
    ctx = setup.ctx("sequence", mb_size=64)
    U = fixed_batch(setup, 8, 4, seed=500)
    accY = accumulate(ctx, U, y_loss_of(ctx), "Y over U")
    E = setup.sample(4, 4, seed=12)
    accX = accumulate(ctx, E, x_loss_of(ctx), "X over E", with_entropy=True)
    return setup, opt, ctx, U, accY, E, accX


def _inputs(world, opt, lr=1e-2):
    setup, _, ctx, U, accY, E, accX = world
    Xbar = pv.scale_(pv.clone(accX.sum_buf), 1.0 / accX.B)
    Ybar = pv.scale_(pv.clone(accY.sum_buf), 1.0 / accY.B)
    for g in opt.param_groups:
        g["lr"] = lr
    return gt.StepInputs(opt, lr, Xbar, Ybar, None, U.B, accX.S, accY.token_logp, accX.entropy)


def _run(world, opt, icfg, chunked: bool, monkeypatch):
    setup, _, ctx, U, _, E, _ = world
    monkeypatch.setattr(gt, "chunked_step_applies", lambda *a: chunked)
    seen = {}
    r = gt.run_ground_truth(ctx, E, U, _inputs(world, opt), icfg,
                            fail_after_step=lambda: seen.update(theta=[p.detach().clone() for p in setup.params]))
    return r, seen["theta"]


def _same(a, b) -> bool:
    return a == b or (a != a and b != b)  # NaN == NaN here


def assert_same_results(ref: dict, got: dict) -> None:
    """Two ground truths' results: the same keys, every value bitwise equal (NaN equal to NaN)."""
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, got[k]) or (v.isnan() == got[k].isnan()).all(), k
        else:
            assert _same(v, got[k]), k


def spy_live_state(monkeypatch, module) -> list[bool]:
    """Each ``module.take(...)`` call's ``live_state`` (the snapshot refers to the live state), in order."""
    seen, real = [], module.take
    monkeypatch.setattr(module, "take", lambda *a, **k: seen.append(k.get("live_state", False)) or real(*a, **k))
    return seen


@pytest.mark.parametrize("case", ["adamw", "adamw_repeated_split", "adamw_clipped_recomputed", "sgd_momentum"])
def test_the_chunked_ground_truth_gives_the_full_paths_results_bit_for_bit(world, case, monkeypatch):
    """theta_plus, every result (the split's repeated zero-gradient steps included: chunked on the
    live state) and the restored state are bitwise the full-snapshot path's."""
    setup, opt = world[0], world[1]
    icfg = ICFG
    if case == "adamw_repeated_split":
        monkeypatch.setattr(step_split, "ANALYTIC_ADAMW_SPLIT", False)
    if case == "adamw_clipped_recomputed":
        icfg = dataclasses.replace(ICFG, reuse_probe_gradient=False, max_grad_norm=0.01)
    if case == "sgd_momentum":
        opt = torch.optim.SGD(setup.params, lr=1e-2, momentum=0.9, weight_decay=0.1)
        with torch.no_grad():  # a momentum buffer, theta kept
            snap = take(setup.params, None, "cpu")
            _grads(setup.params, torch.Generator().manual_seed(3))
            opt.step()
            restore(setup.params, None, snap)
    assert cs.chunked_step_applies(opt, setup.params, torch.device("cpu"), "optimizer")
    assert len(cs.chunks(setup.params, setup.params)) > 2
    before = state_fingerprint(setup.params, opt)
    full, theta_full = _run(world, opt, icfg, False, monkeypatch)
    assert bitwise_equal(state_fingerprint(setup.params, opt), before)
    chunked, theta = _run(world, opt, icfg, True, monkeypatch)
    assert bitwise_equal(state_fingerprint(setup.params, opt), before)
    assert bitwise_equal(theta, theta_full) and not bitwise_equal(theta, before[:len(theta)])
    assert (chunked.pop("gt/chunked_step"), full.pop("gt/chunked_step")) == (1.0, 0.0)
    assert_same_results(full, chunked)


def test_a_failure_in_a_later_chunk_of_the_ground_truth_restores_everything(world, monkeypatch):
    """AdamW's functional step raises in the second chunk (after moving it): weights, state (same
    objects), param groups and Ybar are bitwise as before and no gradient is left."""
    setup, opt, ctx, U, _, E, _ = world
    inp = _inputs(world, opt)
    ybar = [y.clone() for y in inp.Ybar_raw]
    before, objs = state_fingerprint(setup.params, opt), _state_objects(setup.params, opt)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    functional = importlib.import_module("torch.optim.adam")  # Adam.step calls its ``adam`` once per group
    real, calls = functional.adam, [0]

    def adam(*a, **k):
        calls[0] += 1
        real(*a, **k)
        if calls[0] == 2:
            raise Boom("injected in the second chunk")
    monkeypatch.setattr(functional, "adam", adam)
    with pytest.raises(Boom):
        gt.run_ground_truth(ctx, E, U, inp, ICFG)
    assert calls[0] == 2
    assert bitwise_equal(state_fingerprint(setup.params, opt), before)
    assert _state_objects(setup.params, opt) == objs
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert bitwise_equal(ybar, inp.Ybar_raw) and all(p.grad is None for p in setup.params)


def test_preconditioned_sgd_snapshots_the_weights_alone(world, monkeypatch):
    """``preconditioned_sgd`` moves theta by ``lr P Ybar`` and never steps the optimizer, so its
    snapshot refers to the live state (no copy); its results are the full snapshot's bit for bit,
    and the state is left as it was. It is not a chunked step (``gt/chunked_step`` 0)."""
    setup, opt, ctx, U, _, E, _ = world
    icfg = dataclasses.replace(ICFG, step_mode=StepMode.preconditioned_sgd, split_step=False)
    take_real = gt.take
    live = spy_live_state(monkeypatch, gt)
    before = state_fingerprint(setup.params, opt)
    r = gt.run_ground_truth(ctx, E, U, _inputs(world, opt), icfg)
    assert live == [True] and r["gt/chunked_step"] == 0.0
    assert bitwise_equal(state_fingerprint(setup.params, opt), before)
    monkeypatch.setattr(gt, "take", lambda *a, **k: take_real(*a, **{**k, "live_state": False}))
    full = gt.run_ground_truth(ctx, E, U, _inputs(world, opt), icfg)
    assert_same_results(full, r)


def test_chunks_are_bounded_by_bytes_and_whole_where_a_tensor_is_not_dense():
    """At most ``max(largest, total / 16)`` bytes a chunk (a larger tensor alone), every index once
    in order; one chunk of everything when a tensor is not contiguous (foreach's slow path)."""
    ps = [torch.zeros(1000)] + [torch.zeros(10) for _ in range(300)] + [torch.zeros(64, 64)]
    out = cs.chunks(ps, ps)
    assert [i for c in out for i in c] == list(range(len(ps)))
    cap = max(max(p.numel() for p in ps), sum(p.numel() for p in ps) // cs.CHUNKS) * 4
    assert all(sum(ps[i].numel() * 4 for i in c) <= cap for c in out) and len(out) <= 2 * cs.CHUNKS + 1
    assert cs.chunks(ps[:-1] + [torch.zeros(64, 64).t()], ps) == [list(range(len(ps)))]
    assert cs.chunks([], []) == []


@pytest.mark.parametrize("name", ["adam_decay_amsgrad", "sgd_nesterov", "custom_step"])
@pytest.mark.parametrize("clip", [None, 0.01], ids=["", "clipped"])
def test_the_optimizer_step_model_is_chunked_with_a_weights_only_snapshot(world, name, clip, monkeypatch):
    """The ``optimizer_step`` step model (optimizers without a closed form): where the chunked step
    applies (torch's own Adam with amsgrad, SGD with nesterov momentum), its update is bitwise the
    full-snapshot path's, it snapshots the weights alone (``take(..., live_state=True)``), and the
    weights and state are restored bit for bit; a subclass with its own ``step`` keeps the full
    snapshot."""
    from entprobe.pipeline.stages import step_model as sm

    class OwnStep(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    setup, _, ctx, _, accY, _, _ = world
    make = {"adam_decay_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
            "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
            "custom_step": lambda ps: OwnStep(ps, lr=1e-2, momentum=0.9)}[name]
    opt = make(setup.params)
    with torch.no_grad():  # some state, theta kept
        snap = take(setup.params, None, "cpu")
        for _ in range(2):
            _grads(setup.params, torch.Generator().manual_seed(3))
            opt.step()
        restore(setup.params, None, snap)
    Ybar = pv.scale_(pv.clone(accY.sum_buf), 1.0 / accY.B)
    assert sm.step_model_kind(opt, "optimizer") == "optimizer_step"
    live = spy_live_state(monkeypatch, sm)

    def update(chunked: bool):
        monkeypatch.setattr(sm, "chunked_step_applies", lambda *a: chunked and cs.chunked_step_applies(*a))
        out = {"update": [torch.empty_like(p) for p in setup.params]}
        before = state_fingerprint(setup.params, opt)
        sm.build_step_model(ctx, opt, 1e-2, Ybar, None, "optimizer", clip).write(out)
        assert bitwise_equal(state_fingerprint(setup.params, opt), before)
        return out["update"]

    full = update(False)
    chunked = update(True)
    assert bitwise_equal(chunked, full) and any(bool(u.abs().sum() > 0) for u in full)
    assert live == [False, name != "custom_step"]
