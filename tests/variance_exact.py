"""The exact model of Stage 2's variance tests (test_variance.py, test_variance_paths.py): the tiny
enumerable policy with the AdamW state of 20 real DR-GRPO steps, every one of its 3 x 156 responses'
gradients enumerated once, the exact moments of the two-batch estimator in ``sequence`` mode at G = 2
(``Exact``: mu = E[X], E[Y], Sigma = Cov(X_u), Cov(Y_u) over units, T = tr(P Sigma_X P Sigma_Y),
c_X = muY' P Sigma_X P muY, c_Y = muX' P Sigma_Y P muX), and a simulator of the pipeline's per-unit
projections on draws of many batches (``draw``, ``simulate``, ``variances``), pinned to the
pipeline by ``test_variance.test_simulator_is_the_pipeline``.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from entprobe.math import estimators as est
from entprobe.math import paramvec as pv
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.pipeline.stages.accumulate import accumulate, x_loss_of, y_loss_of
from entprobe.pipeline.stages.variance import project_jvp
from exact_model import adamw_with_state, enumerate_responses, make_setup

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
