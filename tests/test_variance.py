"""Stage 2 variance (DESIGN.md §3, seed 000 Part A): fused projections, calibration, scaling, jackknife.

- Every fast path equals the seed's per-unit backward in every weighting mode, on the exact model
  (through ``run_two_batch``) and on the builtin Llama (through ``run``): ``stored`` (a_u as device
  dots in the X pass, b_u from U's kept per-unit gradients), ``fused`` (b_u from one forward-mode
  pass over U) and ``jvp`` (one forward-mode pass per side); ``auto`` picks as documented.
- Calibration against exact enumeration (G = 2, ``sequence`` mode, Adam P from a real state). It
  needs thousands of (E, U) draws of hundreds of prompts, far beyond what per-draw stage calls
  allow in seconds, so the draws go through an exact *simulator*: the gradient of every one of
  the 3 x 156 responses is enumerated once; a unit's X_u, Y_u are weighted sums of those rows;
  the SE comes from the same ``estimators.two_batch_variance``. ``test_simulator_is_the_pipeline``
  pins the simulator to ``accumulate`` + ``project_jvp`` on the same batches (to the fp32 rounding
  bound of each projection's terms: the softmax inside HF's eager attention is taken in fp32).
- Exact moments: with mu = E[X], E[Y], Sigma = Cov(X_u), Cov(Y_u) over units and
  T = tr(P Sigma_X P Sigma_Y), c_X = muY' P Sigma_X P muY, c_Y = muX' P Sigma_Y P muX,
      Var(Xbar.P.Ybar)   = c_X / B_E + c_Y / B_U + T / (B_E B_U)
      E[V_X] = (c_X + T / B_U) / B_E,   E[V_Y] = (c_Y + T / B_E) / B_U,
  so the delta method is conservative by T / (B_E B_U): calibrated only once B is large.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from conftest import compose_cfg, fp_tol, recording_units
from entprobe.math import estimators as est
from entprobe.math import paramvec as pv
from entprobe.cli.probe_job import run
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.pipeline.stages.accumulate import accumulate, x_loss_of, y_loss_of
from entprobe.config import ConfigError, ImportanceConfig, ProbeConfig, ProjectionMode, UnitBackward
from entprobe.pipeline.geometry import Geometry
from entprobe.pipeline.modes.two_batch import run_two_batch
from entprobe.pipeline.stages.context import nograd_prompts
from entprobe.pipeline.stages.variance import (SMALL_MODEL_PARAMS, UNIT_GRADS_ALWAYS_MB, project_backward, project_jvp, resolve_projection,
                                      resolve_unit_backward)
from exact_model import adamw_with_state, enumerate_responses, make_setup
from two_batch_bounds import assert_runs_agree, per_unit, variance_bounds
from exact_oracle import batch_of  # the RolloutBatch of enumerated response indices (needs .setup, .K, .R)

MODES = ("sequence", "dr_grpo", "per_token_avg")
SETUP_SEED = 1  # success rates 0.64 / 0.46 / 0.85 after the AdamW steps: rewards neither rare nor sure
Z95 = 1.959963984540054
VAR_KEYS = ("V_X", "V_Y", "SE_deltaH1", "frac_var", "ci95_low", "ci95_high", "deltaH_pred", "SE_deltaH_pred",
            "SE_deltaH_pred_E", "SE_deltaH_pred_U", "ci95_pred_low", "ci95_pred_high", "SE_deltaH_pred_gradient",
            "SE_deltaH_pred_momentum", "SE_deltaH_pred_weight_decay")


@dataclass
class Exact:
    setup: object
    opt: torch.optim.Optimizer  # AdamW with the state of 20 real DR-GRPO steps
    lr: float
    P: pv.Buffer  # Adam preconditioner, fp64
    Pf: torch.Tensor  # [D] the same, flat
    J: torch.Tensor  # [3K, D] grad S of every response, prompt-major
    S: torch.Tensor  # [3K] log-prob of every response
    R: torch.Tensor  # [3K] reward
    L: torch.Tensor  # [3K] generated length (EOS counts)
    K: int  # responses per prompt (156)
    first_order: float  # exact -lr E[X].P.E[Y] = lr gradH.P.E[Ybar] (G = 2)
    c_X: float
    c_Y: float
    T: float


def _flat(buf) -> torch.Tensor:
    return torch.cat([b.reshape(-1) for b in buf])


def _pair_second_moment(J: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``sum_{s,t} W[s,t] (J_s - J_t)(J_s - J_t)^T = 2 J^T (diag(W 1) - W) J`` for symmetric W."""
    return 2 * J.T @ ((torch.diag(W.sum(1)) - W) @ J)


@pytest.fixture(scope="module")
def ex() -> Exact:
    setup = make_setup(seed=SETUP_SEED)
    opt = adamw_with_state(setup)
    st = [opt.state[p] for p in setup.params]
    P = pv.adam_preconditioner([s["exp_avg_sq"] for s in st], int(st[0]["step"]), 0.999, 1e-8,
                               dtype=torch.float64)
    en = enumerate_responses(setup)
    J, S, R, K = en.J, en.S, en.R, en.K
    L = en.L[:K]
    p, Sn, Rn, Pf = S.exp().view(3, K), S.view(3, K), R.view(3, K), _flat(P)
    pp = p[:, :, None] * p[:, None, :]  # [3, K, K] probability of an ordered response pair
    Lmax = torch.maximum(L[:, None], L[None, :])
    # G = 2, sequence mode: X_u = (S_1 - S_2)(J_1 - J_2) / 2,  Y_u = (r_1 - r_2)(J_1 - J_2) / (4 Lmax);
    # E[Y | prompt] = sum_t coef(t) J_t with coef(t) = sum_t' p(t)p(t')(r(t) - r(t')) / (2 Lmax)
    coef = (pp * (Rn[:, :, None] - Rn[:, None, :]) / (2 * Lmax)).sum(2)
    muY = (coef.reshape(-1, 1) * J).view(3, K, -1).sum(1).mean(0)
    muX = -_flat(setup.exact_grad_entropy())
    WX = pp * (Sn[:, :, None] - Sn[:, None, :]) ** 2 / 4
    WY = pp * (Rn[:, :, None] - Rn[:, None, :]) ** 2 / (16 * Lmax ** 2)
    SX = sum(_pair_second_moment(J[n * K:(n + 1) * K], WX[n]) for n in range(3)) / 3 - torch.outer(muX, muX)
    SY = sum(_pair_second_moment(J[n * K:(n + 1) * K], WY[n]) for n in range(3)) / 3 - torch.outer(muY, muY)
    lr = opt.param_groups[0]["lr"]
    return Exact(setup, opt, lr, P, Pf, J, S, R, L.repeat(3), K, -lr * float(muX @ (Pf * muY)),
                 float((Pf * muY) @ SX @ (Pf * muY)), float((Pf * muX) @ SY @ (Pf * muX)),
                 float(((Pf[:, None] * SX * Pf[None, :]) * SY).sum()))


# ---------------------------------------------------------------- the exact simulator
def draw(ex: Exact, N: int, B: int, G: int, gen: torch.Generator) -> torch.Tensor:
    """N independent batches of B units: prompts uniform, G responses from pi. Flat indices [N, B, G]."""
    pi = torch.randint(3, (N, B), generator=gen)
    p = ex.S.exp().view(3, ex.K)
    ri = torch.multinomial(p[pi.reshape(-1)], G, replacement=True, generator=gen).view(N, B, G)
    return pi[..., None] * ex.K + ri


def unit_weights(ex: Exact, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients of grad S in X_u and Y_u (sequence mode): (S - LOO mean S)/G, A/(G Lmax)."""
    G = f.shape[-1]
    S, R, L = ex.S[f], ex.R[f], ex.L[f]
    cX = (S - (S.sum(-1, keepdim=True) - S) / (G - 1)) / G
    cY = (R - R.mean(-1, keepdim=True)) / L.amax(-1, keepdim=True) / G
    return cX, cY


def simulate(ex: Exact, fE: torch.Tensor, fU: torch.Tensor):
    """Per draw: a [N, B_E], b [N, B_U], bars_dot [N], exactly as the pipeline defines them."""
    (cX, _), (_, cY) = unit_weights(ex, fE), unit_weights(ex, fU)

    def mean_vec(f, c):  # [N, D]: (1/B) sum_u sum_g c J_f
        W = torch.zeros(f.shape[0], ex.J.shape[0], dtype=torch.float64)
        return W.scatter_add_(1, f.flatten(1), c.flatten(1) / f.shape[1]) @ ex.J

    def proj(f, c, direction):  # [N, B]: sum_g c (J_f . direction_n)
        q = direction @ ex.J.T
        return (c * torch.gather(q, 1, f.flatten(1)).view(f.shape)).sum(-1)

    Xb, Yb = mean_vec(fE, cX), mean_vec(fU, cY)
    return proj(fE, cX, Yb * ex.Pf), proj(fU, cY, Xb * ex.Pf), (Xb * ex.Pf * Yb).sum(-1)


def variances(ex: Exact, B_E: int, B_U: int, N: int, seed: int) -> list[est.TwoBatchVariance]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(N // 250):  # chunks keep the [N, 3K] projection tables small
        a, b, bars = simulate(ex, draw(ex, 250, B_E, 2, gen), draw(ex, 250, B_U, 2, gen))
        out += [est.two_batch_variance(a[n], b[n], ex.lr, float(bars[n])) for n in range(250)]
    return out


def fused(ctx, E: RolloutBatch, U: RolloutBatch, P):
    """Stage 1 + the fused Stage 2 exactly as ``run_two_batch`` orders them."""
    accY = accumulate(ctx, U, y_loss_of(ctx), "Y over U")
    Ybar = pv.scale_(accY.sum_buf, 1.0 / U.B)
    accX = accumulate(ctx, E, x_loss_of(ctx), "X over E", directions=pv.stack_directions([pv.mul(Ybar, P)]))
    Xbar = pv.scale_(accX.sum_buf, 1.0 / E.B)
    b = project_jvp(ctx, U, pv.stack_directions([pv.mul(Xbar, P)]), "Y", "b_u over U")[:, 0]
    return accX.proj[:, 0], b, pv.dot(Xbar, Ybar, P), Xbar, Ybar


def rel(x, y) -> float:
    x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    return float((x - y).abs().max() / y.abs().max())


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


# ---------------------------------------------------------------- simulator == pipeline
@pytest.mark.numerics
def test_simulator_is_the_pipeline(ex):
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        fE, fU = draw(ex, 1, 5, 2, gen), draw(ex, 1, 6, 2, gen)
        a_sim, b_sim, bars_sim = simulate(ex, fE, fU)
        a, b, bars, _, _ = fused(ex.setup.ctx("sequence", mb_size=2), batch_of(ex, fE[0]), batch_of(ex, fU[0]), ex.P)
        assert (a != 0).sum() >= 3 and (b != 0).sum() >= 2  # rewards not all tied in these draws
        # the same sums over the D parameters from the enumerated per-response gradients: the
        # pipeline's passes round in fp32 inside the attention softmax (fp_tol of each unit's terms
        # |V_n,i d_i|, and of the mean's for Xbar . P Ybar)
        (cX, _), (_, cY) = unit_weights(ex, fE[0]), unit_weights(ex, fU[0])
        X, Y = (cX[..., None] * ex.J[fE[0]]).sum(1), (cY[..., None] * ex.J[fU[0]]).sum(1)
        Ma, Mb = X.abs() @ (ex.Pf * Y.mean(0)).abs(), Y.abs() @ (ex.Pf * X.mean(0)).abs()
        D = ex.J.shape[1]
        ta, tb = (torch.tensor([fp_tol(torch.float32, float(m), D) for m in M]) for M in (Ma, Mb))
        assert ((a - a_sim[0]).abs() <= ta).all() and ((b - b_sim[0]).abs() <= tb).all()
        assert abs(bars - float(bars_sim[0])) <= float(ta.mean() + tb.mean())


# ---------------------------------------------------------------- calibration against exact values
def test_calibration_against_the_exact_first_order_value(ex):
    N, B = 2000, 256
    v = variances(ex, B, B, N, seed=1)
    d1 = torch.tensor([(x.ci95_low + x.ci95_high) / 2 for x in v], dtype=torch.float64)
    se2 = torch.tensor([x.SE ** 2 for x in v], dtype=torch.float64)
    z = (d1.mean() - ex.first_order) / (d1.std() / math.sqrt(N))
    assert abs(z) < 4  # deltaH1 is unbiased: E and U independent, E[X] = -grad H exactly in sequence mode
    assert 0.8 < float(se2.mean() / d1.var()) < 1.25  # measured 1.056 (theory: 1.062, the product term)
    cover = sum(x.ci95_low <= ex.first_order <= x.ci95_high for x in v) / N
    assert 0.90 <= cover <= 0.99  # measured 0.942


def test_variance_and_its_estimate_match_the_exact_moments_at_small_B(ex):
    """At B = 8 the product term T/B^2 is most of the variance: the reported SE^2 exceeds the true
    variance by ~70%, exactly as the moments predict (mean SE^2 / var = 1.68 in theory)."""
    N, B = 2000, 8
    v = variances(ex, B, B, N, seed=2)
    d1 = torch.tensor([(x.ci95_low + x.ci95_high) / 2 for x in v], dtype=torch.float64) / ex.lr
    VX = torch.tensor([x.V_X for x in v], dtype=torch.float64)
    VY = torch.tensor([x.V_Y for x in v], dtype=torch.float64)
    var = ex.c_X / B + ex.c_Y / B + ex.T / B ** 2
    # heavy tails (rare improbable responses carry large S differences): 4 Monte-Carlo SEs
    kurt = float(((d1 - d1.mean()) ** 4).mean() / d1.var() ** 2)
    assert abs(float(d1.var()) / var - 1) < 4 * math.sqrt((kurt - 1) / N)
    for V, expect in ((VX, (ex.c_X + ex.T / B) / B), (VY, (ex.c_Y + ex.T / B) / B)):
        assert abs(float(V.mean()) / expect - 1) < 4 * float(V.std() / V.mean()) / math.sqrt(N)
    assert (var + ex.T / B ** 2) / var > 1.5  # the delta method is conservative here, by theory
    assert float((VX + VY).mean() / d1.var()) > 1.3  # ... and in the draws


# ---------------------------------------------------------------- scaling with B
def test_variance_components_halve_when_their_batch_doubles(ex):
    """E[V_X] = (c_X + T/B_U)/B_E halves exactly when B_E doubles at fixed B_U (likewise V_Y in
    B_U). Doubling both would give (c + T/2B)/(2(c + T/B)), below 1/2 by the product term. The
    tolerance is 4 Monte-Carlo SEs of the ratio of means (delta method over the draws)."""
    N, B = 2000, 64
    base = variances(ex, B, B, N, seed=3)
    twoE, twoU = variances(ex, 2 * B, B, N, seed=4), variances(ex, B, 2 * B, N, seed=5)
    for vs in (base, twoE, twoU):
        assert all(x.V_X >= 0 and x.V_Y >= 0 for x in vs)
    for key, doubled in (("V_X", twoE), ("V_Y", twoU)):
        x = torch.tensor([getattr(r, key) for r in doubled], dtype=torch.float64)
        y = torch.tensor([getattr(r, key) for r in base], dtype=torch.float64)
        ratio = float(x.mean() / y.mean())
        se = ratio * math.sqrt(float(x.var() / x.mean() ** 2 + y.var() / y.mean() ** 2) / N)
        assert se < 0.03 and abs(ratio - 0.5) < 4 * se, (key, ratio, se)
        # ... and each mean agrees with the exact moments
        B_E, B_U = (2 * B, B) if key == "V_X" else (B, 2 * B)
        expect = (ex.c_X + ex.T / B_U) / B_E if key == "V_X" else (ex.c_Y + ex.T / B_E) / B_U
        assert abs(float(x.mean()) / expect - 1) < 4 * float(x.std() / x.mean()) / math.sqrt(N), key


# ---------------------------------------------------------------- jackknife == delta method
def test_jackknife_equals_delta_method(ex):
    """Deleting unit u of E changes only Xbar: Xbar_{-u}.P.Ybar = (B m - a_u)/(B - 1), linear in
    a_u, so theta_{-u} - mean theta_{-.} = -(a_u - mean a)/(B - 1) and the delete-1 jackknife
    (B-1)/B sum (theta_{-u} - mean)^2 = sum (a_u - mean a)^2 / (B (B-1)) = V_X exactly; likewise
    for U. No linearisation is involved: the statistic is linear in each batch separately, which is
    why the jackknife is not reported as a second SE."""
    # by hand: a = [1, 2, 3, 6] (mean 3 = bars_dot) -> V_X = (4 + 1 + 0 + 9)/(4 * 3) = 7/6;
    # b = [2, 4] (mean 3) -> V_Y = (1 + 1)/(2 * 1) = 1; lr = 0.5 -> SE = 0.5 sqrt(13/6)
    v = est.two_batch_variance(torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.tensor([2.0, 4.0]), 0.5, 3.0)
    assert (v.V_X, v.V_Y) == pytest.approx((7 / 6, 1.0), rel=1e-15)
    assert v.SE == pytest.approx(0.5 * math.sqrt(13 / 6), rel=1e-15)
    # Welch-Satterthwaite: (7/6 + 1)^2 / ((7/6)^2 / 3 + 1^2 / 1) = (169/36) / (49/108 + 1) = 507/157
    assert v.df == pytest.approx(507 / 157, rel=1e-14)
    # brute force on explicit unit vectors: recompute Xbar_{-u}.P.Ybar and Xbar.P.Ybar_{-v}
    gen = torch.Generator().manual_seed(6)
    fE, fU = draw(ex, 1, 7, 2, gen)[0], draw(ex, 1, 5, 2, gen)[0]
    (cX, _), (_, cY) = unit_weights(ex, fE), unit_weights(ex, fU)
    X = (cX[..., None] * ex.J[fE]).sum(1)  # [B_E, D]
    Y = (cY[..., None] * ex.J[fU]).sum(1)  # [B_U, D]
    jack = 0.0
    for M, other in ((X, Y.mean(0)), (Y, X.mean(0))):
        B = M.shape[0]
        theta = torch.stack([torch.cat([M[:u], M[u + 1:]]).mean(0) @ (ex.Pf * other) for u in range(B)])
        jack += (B - 1) / B * float(((theta - theta.mean()) ** 2).sum())
    a, b, bars = simulate(ex, fE[None], fU[None])
    v = est.two_batch_variance(a[0], b[0], ex.lr, float(bars[0]))
    assert v.SE == pytest.approx(ex.lr * math.sqrt(jack), rel=1e-10)
