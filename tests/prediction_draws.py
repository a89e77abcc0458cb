"""The draws of the prediction tests (test_prediction.py, test_prediction_pipeline.py), through the
simulator of ``exact_oracle.py``: the prediction per draw, the measured change's per-prompt
contributions with the production estimators, and the tolerances they are judged with.
"""
from __future__ import annotations

import dataclasses

import torch

from entprobe.math import importance as im
from exact_oracle import log_probs_at, simulate

MODES = ("sequence", "per_token_avg", "dr_grpo")
N_DRAWS = 2000
LR_GT = 3e-3  # the measured-change checks: ESS/N ~ 0.98 (at lr 1e-2, ESS ~0.92, B = 8 covers 0.90-0.94)


def coverage_ok(c: float, lo: float = 0.93, hi: float = 0.97) -> bool:
    return lo <= c <= hi


def simulate_prediction(o, fE, fU):
    """Per draw: deltaH_pred [N], the per-unit contributions e [N, B_E] (E side) and u [N, B_U]
    (U side, delta method), and Delta theta [N, D] (``exact_oracle.simulate``)."""
    sim = simulate(o, fE, fU)
    return sim.pred, sim.e, sim.u, sim.delta


def measured_draws(o, B: int, n_u: int, gen: torch.Generator, estimator: str = "cv", lr: float = LR_GT):
    """For n_u update batches (8 prompts): the exact step (AdamW at ``lr``), the exact change and
    first-order change, then N_DRAWS // n_u E draws each (in chunks of 250): psi [N, B] (per-prompt
    contributions, the production functions) and e [N, B] (the prediction's E side). Yields per chunk."""
    o.hyper = dataclasses.replace(o.hyper, lr=lr)
    g = o.minus_grad_H
    for _ in range(n_u):
        fU = o.draw(1, 8, gen)
        delta = sum(o.update(o.means(fU, o.weights(fU, "Y"))[0]).values())
        S_plus = log_probs_at(o, o.theta + delta)
        dH = float(o.H(S_plus) - o.H())
        T = -float(g @ delta)
        for _ in range(max(1, N_DRAWS // (250 * n_u))):
            fE = o.draw(250, B, gen)
            psi = measured_psi(o, fE, S_plus, estimator)
            e = -o.project(fE, o.weights(fE, "X"), delta.expand(250, -1))
            yield dH, T, psi, e


def measured_psi(o, fE: torch.Tensor, S_plus: torch.Tensor, estimator: str = "cv") -> torch.Tensor:
    """The production estimator's per-prompt contributions [N, B] on draws fE [N, B, G]
    (``importance_math.paired_psi``; PSIS smoothed per draw, as one run does)."""
    S0, S1, L = o.S[fE], S_plus[fE], o.L[fE]
    if estimator != "psis":
        return im.paired_psi(S0, S1, L, L.amax(-1), o.mode, 10.0, None)[estimator]
    return torch.stack([im.paired_psi(S0[n], S1[n], L[n], L[n].amax(-1), o.mode, 10.0,
                                      im.psis_smooth(S1[n] - S0[n]).log_weights)["psis"] for n in range(fE.shape[0])])
