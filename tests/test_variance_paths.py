"""Stage 2's fast paths against the seed's per-unit backward (DESIGN.md §3, seed 000 Part A).

Every fast path equals the per-unit backward in every weighting mode, on the exact model (through
``run_two_batch``) and on the builtin Llama (through ``run``): ``stored`` (a_u as device dots in the
X pass, b_u from U's kept per-unit gradients), ``fused`` (b_u from one forward-mode pass over U),
``jvp`` (one forward-mode pass per side) and ``ghost``; ``auto`` picks as documented.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import compose_cfg, fp_tol, recording_units
from entprobe.math import estimators as est
from entprobe.math import paramvec as pv
from entprobe.cli.probe_job import run
from entprobe.config import ConfigError, ImportanceConfig, ProbeConfig, ProjectionMode, UnitBackward
from entprobe.pipeline.geometry import Geometry
from entprobe.pipeline.modes.two_batch import run_two_batch
from entprobe.pipeline.stages.context import nograd_prompts
from entprobe.pipeline.stages.variance import (SMALL_MODEL_PARAMS, UNIT_GRADS_ALWAYS_MB, project_backward, resolve_projection,
    resolve_unit_backward)
from two_batch_bounds import assert_runs_agree, per_unit, variance_bounds
from variance_exact import MODES, VAR_KEYS, Z95, fused
from variance_exact import ex  # noqa: F401  (the exact model, a module-scoped fixture)


# ---------------------------------------------------------------- one path against the per-unit backward
# The paths compute every per-unit projection V_n . d_j (a, b, the parts of e, u) through other
# kernels (reverse or forward mode, kept per-unit gradients, layer hooks), so they agree to the
# rounding of those sums (two_batch_bounds.py, from the backward run's recorded magnitudes); the
# fp64 exact model takes the fp32 bound: HF's eager attention takes its softmax in fp32.
# ``ci95_low/high`` are ``deltaH1 -+ t(df) SE_deltaH1`` of these (test_frac_var_and_ci95_follow_the_se).
PATH_KEYS = tuple(k for k in VAR_KEYS if k not in ("ci95_low", "ci95_high"))


def assert_path_equals_backward(res: dict, pu: dict, ref: dict, pu_ref: dict, mags, label,
                                dtype: torch.dtype = torch.float32) -> None:
    """``res`` (and its per_unit.json ``pu``) equal the backward run's, to two_batch_bounds'."""
    assert_runs_agree(res, pu, ref, pu_ref, mags, label, PATH_KEYS, dtype)


# ---------------------------------------------------------------- fused == per-unit backward
@pytest.mark.numerics
@pytest.mark.parametrize("mode", MODES)
def test_fused_equals_backward_on_exact_model(ex, mode):
    setup = ex.setup
    E, U = setup.sample(6, 3, seed=11), setup.sample(5, 3, seed=12)
    ctx = setup.ctx(mode, mb_size=2)
    a, b, bars, Xbar, Ybar = fused(ctx, E, U, ex.P)
    assert ctx.stats.passes == {"forward": 3 * 11 + 3 * 5, "backward": 3 * 11, "jvp": 3 * 5}
    with recording_units() as rec:
        a_ref = project_backward(ctx, E, pv.stack_directions([pv.mul(Ybar, ex.P)]), "X", "a_u over E")[:, 0]
        b_ref = project_backward(ctx, U, pv.stack_directions([pv.mul(Xbar, ex.P)]), "Y", "b_u over U")[:, 0]
    mags = rec.split(E.B)
    assert ctx.stats.passes["backward"] == 2 * 3 * 11
    # fp64 model, but HF's eager attention takes its softmax in fp32: forward and reverse mode
    # round differently there, by the fp32 bound of each projection's terms (conftest.fp_tol;
    # measured ~1e-7 relative on b; a is the same backward in fp64)
    ta, tb = mags.tol("E", 0), mags.tol("U", 0)
    assert ((a - a_ref).abs() <= mags.tol("E", 0, torch.float64)).all()
    assert ((b - b_ref).abs() <= tb).all(), ((b - b_ref).abs(), tb)
    # mean_u a_u = Xbar.P.Ybar = mean_v b_v: both sides project onto the same bilinear form, a in
    # fp64 (the same sums of B units and N parameters, another order), b through forward mode
    assert abs(float(a.mean()) - bars) <= float(mags.tol("E", 0, torch.float64).mean()) + fp_tol(
        torch.float64, float(mags.E[:, 0].mean()), E.B, worst_case=True)
    assert abs(float(b.mean()) - bars) <= float(tb.mean())
    assert a.std() > 0.1 * a.abs().max() and b.std() > 0.1 * b.abs().max()  # not degenerate
    v, v_ref = est.two_batch_variance(a, b, ex.lr, bars), est.two_batch_variance(a_ref, b_ref, ex.lr, bars)
    tol = variance_bounds(v_ref, ta, tb, E.B, U.B, ex.lr, 0.0)
    for key, x, y in zip(v._fields, v, v_ref):
        assert abs(x - y) <= tol[key], (key, x, y, tol[key])


PATHS = ("stored", "fused", "jvp", "ghost")


@pytest.mark.parametrize("mode", MODES)
def test_every_path_equals_backward_through_run_two_batch(ex, mode, tmp_path):
    """The orchestration itself (run_two_batch, ground truth off): each fast path gives the
    per-unit backward's V_X, V_Y, SE and interval, with the passes it promises."""
    setup = ex.setup
    E, U = setup.sample(6, 3, seed=11), setup.sample(5, 3, seed=12)
    geo, icfg = Geometry(ex.opt, ex.lr, ex.P), ImportanceConfig(enabled=False)
    out = {}
    for proj, how in (*((p, h) for p in PATHS for h in ("loop", "vmap")), ("backward", "loop")):
        ctx = setup.ctx(mode, mb_size=2)
        pcfg = ProbeConfig(projection=ProjectionMode(proj), unit_backward=UnitBackward(how), top_k_params=0)
        with recording_units() as rec:
            out[proj, how] = (run_two_batch(ctx, E, U, geo, pcfg, icfg, tmp_path / f"{proj}_{how}"), ctx.stats.passes)
    ref, ref_passes = out["backward", "loop"]
    mags, pu_ref = rec.split(E.B), per_unit(tmp_path / "backward_loop")
    assert ref_passes == {"forward": 3 * 11 * 2, "backward": 3 * 11 * 2}
    # forward mode carries one direction a pass: E projects onto P Ybar and the update's gradient,
    # momentum and weight-decay parts (4), U onto P Xbar and J * Xbar (2)
    promised = {"stored": {"forward": 3 * 11, "backward": 3 * 11},  # one backward per unit, no extra pass
                "ghost": {"forward": 3 * 11, "backward": 3 * 11},  # E: one backward per microbatch; U as stored
                "fused": {"forward": 3 * 11 + 3 * 2 * 5, "backward": 3 * 11, "jvp": 3 * 2 * 5},
                "jvp": {"forward": 3 * 11 + 3 * (4 * 6 + 2 * 5), "backward": 3 * 11, "jvp": 3 * (4 * 6 + 2 * 5)}}
    for (proj, how), (res, passes) in out.items():
        if proj == "backward":
            continue
        assert res["projection"] == proj and passes == promised[proj], (proj, how)
        assert res.get("unit_backward") == (how if proj != "jvp" else None)
        # Stage 1 is the same fp64 computation on every path: Xbar . P Ybar to fp64 rounding
        dbars = float(mags.tol("E", 0, torch.float64).mean() + mags.tol("U", 0, torch.float64).mean())
        assert abs(res["bars_dot"] - ref["bars_dot"]) <= dbars, (proj, how)
        assert_path_equals_backward(res, per_unit(tmp_path / f"{proj}_{how}"), ref, pu_ref, mags, (proj, how))


def test_ghost_with_u_gradients_over_budget_takes_forward_mode_on_u(ex, tmp_path):
    """ghost keeps U's per-unit gradients only within the budget (as auto's stored); over it U's
    projections come from forward mode (as fused): the same V_X, V_Y and SEs, the promised passes."""
    setup = ex.setup
    E, U = setup.sample(6, 3, seed=11), setup.sample(5, 3, seed=12)
    geo, icfg = Geometry(ex.opt, ex.lr, ex.P), ImportanceConfig(enabled=False)
    out = {}
    for proj, budget in (("ghost", 0.0), ("backward", 4096.0)):
        ctx = setup.ctx("dr_grpo", mb_size=2)
        pcfg = ProbeConfig(projection=ProjectionMode(proj), unit_grads_budget_mb=budget, top_k_params=0)
        with recording_units() as rec:
            out[proj] = (run_two_batch(ctx, E, U, geo, pcfg, icfg, tmp_path / proj), ctx.stats.passes)
    (res, passes), (ref, _) = out["ghost"], out["backward"]
    assert passes == {"forward": 3 * 11 + 3 * 2 * 5, "backward": 3 * 11, "jvp": 3 * 2 * 5}
    assert res["projection"] == "ghost" and "unit_backward" not in res
    assert_path_equals_backward(res, per_unit(tmp_path / "ghost"), ref, per_unit(tmp_path / "backward"),
                                rec.split(E.B), "ghost")


@pytest.mark.parametrize("proj", ["stored", "fused", "jvp"])
def test_directions_stored_per_parameter_give_the_same_numbers(ex, proj, tmp_path, monkeypatch):
    """Large models keep the k directions as one [k, n_i] block per parameter (each its own
    allocation) instead of one [k, N] matrix: every dot, projection and storage reuse gives the
    matrix layout's numbers (forced here by a flat limit of 0 on the exact model)."""
    setup = ex.setup
    E, U = setup.sample(6, 3, seed=11), setup.sample(5, 3, seed=12)
    geo, icfg = Geometry(ex.opt, ex.lr, ex.P), ImportanceConfig(enabled=False)
    pcfg = ProbeConfig(projection=ProjectionMode(proj), unit_backward=UnitBackward.loop, top_k_params=0)
    flat = run_two_batch(setup.ctx("per_token_avg", mb_size=2), E, U, geo, pcfg, icfg, tmp_path / "flat")
    with recording_units() as rec:  # the magnitudes of the per-unit sums, from the per-unit backward
        run_two_batch(setup.ctx("per_token_avg", mb_size=2), E, U, geo,
                      dataclasses.replace(pcfg, projection=ProjectionMode.backward), icfg, tmp_path / "backward")
    mags = rec.split(E.B)
    monkeypatch.setattr(pv, "FLAT_MAX_NUMEL", 0)
    d = pv.empty_directions(3, ex.setup.params, "cpu", torch.float64)
    assert d.mat is None and len(d.blocks) == len(ex.setup.params) and d.first(2).k == 2
    blocks = run_two_batch(setup.ctx("per_token_avg", mb_size=2), E, U, geo, pcfg, icfg, tmp_path / "blocks")
    # the model's passes are the same; only the fp64 dots over the parameters are grouped by tensor
    # instead of over one matrix: fp64 bounds of the same per-unit sums
    dbars = float(mags.tol("E", 0, torch.float64).mean() + mags.tol("U", 0, torch.float64).mean())
    assert abs(blocks["bars_dot"] - flat["bars_dot"]) <= dbars
    assert abs(blocks["deltaH1"] - flat["deltaH1"]) <= flat["lr"] * dbars
    assert_path_equals_backward(blocks, per_unit(tmp_path / "blocks"), flat, per_unit(tmp_path / "flat"), mags,
                                "blocks", torch.float64)


@pytest.mark.parametrize("proj, unit_bwd", [("stored", "loop"), ("fused", "loop"), ("fused", "vmap")])
def test_update_parts_held_as_factors_give_the_same_numbers(ex, proj, unit_bwd, tmp_path, monkeypatch):
    """Above ``FACTORED_MIN_NUMEL`` parameters the X pass projects onto AdamW's update parts held
    as factors of Ybar, m and theta (math/factored_directions.py) instead of written-out rows:
    every projection, SE and part gives the written-out run's numbers to the rounding of the same
    per-unit sums (forced here by a limit of 0 on the exact model, whose AdamW has weight decay)."""
    from entprobe.pipeline.stages import prediction
    from entprobe.pipeline.modes import two_batch

    setup = ex.setup
    E, U = setup.sample(6, 3, seed=11), setup.sample(5, 3, seed=12)
    geo, icfg = Geometry(ex.opt, ex.lr, ex.P), ImportanceConfig(enabled=False)
    pcfg = ProbeConfig(projection=ProjectionMode(proj), unit_backward=UnitBackward(unit_bwd), top_k_params=0)
    written = run_two_batch(setup.ctx("per_token_avg", mb_size=2), E, U, geo, pcfg, icfg, tmp_path / "written")
    with recording_units() as rec:
        run_two_batch(setup.ctx("per_token_avg", mb_size=2), E, U, geo,
                      dataclasses.replace(pcfg, projection=ProjectionMode.backward), icfg, tmp_path / "backward")
    mags = rec.split(E.B)
    made = []

    def spy(*a, **k):
        made.append(prediction.factored_directions(*a, **k))
        return made[-1]
    monkeypatch.setattr(prediction, "FACTORED_MIN_NUMEL", 0)
    monkeypatch.setattr(two_batch, "factored_directions", spy)
    factored = run_two_batch(setup.ctx("per_token_avg", mb_size=2), E, U, geo, pcfg, icfg, tmp_path / "factored")
    assert len(made) == 1 and made[0] is not None and made[0].parts == ["gradient", "momentum", "weight_decay"]
    assert factored["deltaH_pred_weight_decay"] != 0 and factored["deltaH_pred_momentum"] != 0
    # the same passes; the parts' dots round x R . Ybar where the rows round Ybar / D': fp32-free here
    # (an fp64 model), fp64 bounds of the same per-unit sums
    assert_path_equals_backward(factored, per_unit(tmp_path / "factored"), written, per_unit(tmp_path / "written"),
                                mags, "factored", torch.float64)


def test_auto_projection_rule():
    """auto: stored when the largest U shard's per-unit gradients fit the budget and are at most
    ``unit_grads_max_copies`` parameter-sized copies (any number while under 256 MB); fused
    otherwise; an explicit choice is kept."""
    from types import SimpleNamespace

    def ctx_of(n):
        return SimpleNamespace(params=[torch.empty(n)], device=torch.device("cpu"), model=SimpleNamespace(training=True),
                               buffers_device=torch.device("cpu"), buffers_dtype=torch.float32)

    big = SMALL_MODEL_PARAMS  # fp32: 4 bytes a parameter
    need = 8 * big * 4 / 2**20  # 8 units
    small = int(UNIT_GRADS_ALWAYS_MB * 2**20 / 4 / 8)  # 8 units of it fill the always-kept size
    assert resolve_projection(ProbeConfig(), ctx_of(small), 8) == "stored"
    assert resolve_projection(ProbeConfig(), ctx_of(small + 1), 8) == "fused"  # 8 > 4 copies
    assert resolve_projection(ProbeConfig(), ctx_of(small + 1), 4) == "stored"
    assert resolve_projection(ProbeConfig(unit_grads_max_copies=0), ctx_of(8 * small + 1), 1) == "fused"
    assert resolve_projection(ProbeConfig(unit_grads_max_copies=1), ctx_of(8 * small + 1), 1) == "stored"
    assert resolve_projection(ProbeConfig(unit_grads_budget_mb=0), ctx_of(10), 8) == "fused"
    assert resolve_projection(ProbeConfig(unit_grads_budget_mb=need, unit_grads_max_copies=8), ctx_of(big), 8) == "stored"
    assert resolve_projection(ProbeConfig(unit_grads_budget_mb=need), ctx_of(big), 8) == "fused"
    assert resolve_projection(ProbeConfig(unit_grads_budget_mb=need * 0.99, unit_grads_max_copies=8),
                              ctx_of(big), 8) == "fused"
    for proj in ("stored", "fused", "jvp", "backward", "ghost"):
        assert resolve_projection(ProbeConfig(projection=ProjectionMode(proj)), ctx_of(1), 8) == proj
    # auto never picks ghost: on CPU it measured no cheaper than vmap (builtin) or loop (SmolLM2),
    # docs/variance.md; and ghost is refused under gradient checkpointing (hooks would fire twice)
    assert all(resolve_projection(ProbeConfig(), ctx_of(n), b) != "ghost" for n in (10, small, big) for b in (1, 8))
    ckpt = ctx_of(1)
    ckpt.model = SimpleNamespace(is_gradient_checkpointing=True, training=False)  # eval: no recomputation
    assert resolve_projection(ProbeConfig(projection=ProjectionMode.ghost), ckpt, 8) == "ghost"
    ckpt.model.training = True
    with pytest.raises(ConfigError, match="probe.projection=ghost: the model uses gradient checkpointing"):
        resolve_projection(ProbeConfig(projection=ProjectionMode.ghost), ckpt, 8)
    assert resolve_unit_backward(ProbeConfig(), ctx_of(big - 1)) == "vmap"
    assert resolve_unit_backward(ProbeConfig(), ctx_of(big)) == "loop"
    assert resolve_unit_backward(ProbeConfig(unit_backward=UnitBackward.loop), ctx_of(1)) == "loop"


def test_nograd_microbatch_size(ex):
    """Prompts per no-graph pass: floor(budget / bytes per prompt), at least mb_size, at most B;
    a fixed size wins."""
    per = 4.0 * 4 * (6 * 10 * 1000 + 4 * 20 * (64 + 256))  # G=4, T_logits=10, T=20, V=1000, h=64, ff=256
    assert nograd_prompts(4, 20, 10, (1000, 64, 256), 10 * per / 2**20, tangent=True) == 10
    assert nograd_prompts(4, 20, 10, (1000, 64, 256), 9.99 * per / 2**20, tangent=True) == 9
    assert nograd_prompts(4, 20, 10, (1000, 64, 256), 9.99 * per / 2**20, tangent=False) > 9
    ctx, E = ex.setup.ctx(mb_size=2), ex.setup.sample(7, 3, seed=3)
    assert ctx.nograd_mb(E, True) == 7  # tiny vocabulary: the whole batch fits 1 GiB
    ctx.nograd_memory_mb = 0.0
    assert ctx.nograd_mb(E, True) == 2  # never below the gradient passes' microbatch
    assert ctx.nograd_mb(E, True, fixed=3) == 3


# the weighting modes on the builtin: dr_grpo and per_token_avg run again in CI's second pass (the
# numerics marker; sequence shares their code paths)
BUILTIN_MODES = [pytest.param("sequence"), pytest.param("dr_grpo", marks=pytest.mark.numerics),
                 pytest.param("per_token_avg", marks=pytest.mark.numerics)]


@pytest.fixture(scope="module", params=BUILTIN_MODES)
def builtin_runs(request, tmp_path_factory) -> dict:
    """run(cfg) on the builtin Llama for one weighting mode and each projection (ground truth off):
    ``[proj]`` the results, ``["per_unit", proj]`` its per_unit.json and ``["magnitudes"]`` the
    backward run's per-unit magnitudes (``recording_units``); ``["mode"]`` the mode."""
    mode = request.param
    out = {"mode": mode}
    for proj in ("auto", *PATHS, "backward"):
        d = tmp_path_factory.mktemp(f"{mode}_{proj}")
        cfg = compose_cfg(d, f"probe.projection={proj}", f"probe.weighting_mode={mode}", "importance.enabled=false")
        with recording_units() as rec:
            out[proj] = run(cfg)
        out["per_unit", proj] = per_unit(d)
        if proj == "backward":
            out["magnitudes"] = rec.split(out[proj]["B_E"])
    return out


def test_every_path_equals_backward_on_builtin(builtin_runs):
    b = builtin_runs["backward"]
    n, G, B_U = b["B_E"] + b["B_U"], b["G"], b["B_U"]
    assert b["weighting_mode"] == builtin_runs["mode"]
    assert b["projection"] == "backward" and b["passes/backward"] == 2 * n * G and "passes/jvp" not in b
    # backward and forward-mode passes beyond Stage 1's one backward per response (forward mode:
    # one pass per direction, 4 on E and 2 on U with AdamW's decay, see above)
    extra = {"stored": (0, None), "fused": (0, 2 * B_U * G), "jvp": (0, (4 * b["B_E"] + 2 * B_U) * G),
             "ghost": (0, None)}
    assert builtin_runs["auto"]["projection"] == "stored"  # 76 k parameters: 8 units fit
    mags = builtin_runs["magnitudes"]
    assert mags.E.shape == (b["B_E"], 4) and mags.U.shape == (B_U, 2) and mags.N == 76352
    for proj in ("auto", *PATHS):
        f = builtin_runs[proj]
        assert_path_equals_backward(f, builtin_runs["per_unit", proj], b, builtin_runs["per_unit", "backward"],
                                    mags, proj)
        more_bwd, jvp = extra[f["projection"]]
        assert f["passes/backward"] == n * G + more_bwd and f.get("passes/jvp") == jvp, proj


def test_frac_var_and_ci95_follow_the_se(builtin_runs):
    for proj in (*PATHS, "backward"):
        r = builtin_runs[proj]
        V, lr = r["V_X"] + r["V_Y"], r["lr"]
        assert r["V_X"] > 0 and r["V_Y"] > 0
        # the same few fp64 operations as the pipeline's, in its order or another: 4 roundings of
        # the terms' magnitudes (fp_tol, worst case); a wrong formula is off by a factor
        def close(got, want, magnitude):
            return abs(got - want) <= fp_tol(torch.float64, magnitude, 4, worst_case=True)
        assert close(r["deltaH1"], -lr * r["bars_dot"], abs(lr * r["bars_dot"]))
        assert close(r["SE_deltaH1"], lr * math.sqrt(V), lr * math.sqrt(V))
        assert close(r["frac_var"], V / r["bars_dot"] ** 2, V / r["bars_dot"] ** 2)
        # Student-t with Welch-Satterthwaite degrees of freedom (between min(B) - 1 and B_E + B_U - 2)
        q = est.t_quantile(r["deltaH1_df"])
        assert min(r["B_E"], r["B_U"]) - 1 <= r["deltaH1_df"] <= r["B_E"] + r["B_U"] - 2 and q > Z95
        mag = abs(r["deltaH1"]) + q * r["SE_deltaH1"]
        assert close(r["ci95_low"], r["deltaH1"] - q * r["SE_deltaH1"], mag)
        assert close(r["ci95_high"], r["deltaH1"] + q * r["SE_deltaH1"], mag)
    # bars_dot = 0: frac_var divides by the 1e-12 floor instead of failing
    v = est.two_batch_variance(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 2.0]), 0.1, 0.0)
    assert v.frac_var == pytest.approx((2.0 + 2.0) / 2 / 1e-12)  # V_X = V_Y = (1 + 1)/(2 * 1) = 1
