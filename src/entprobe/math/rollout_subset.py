"""The prediction from k of the step's B prompts (``probe.rollouts_prompts``; pure math on per-prompt
scalars): X and Y per prompt are formed on a subset S of k prompts drawn at random, independently of
the batch, and each meets the update of all the *other* prompts of the step, as in the full
cross-prompt U-statistic (math/rollout_ustat.py):

    deltaH_pred = -(1/k) sum_{n in S} X_n . Delta theta(y_{-n}),   y_{-n}: the step's input without prompt n.

Each term has the distribution of the full statistic's terms, so the mean over S is unbiased for the same
target; the prompts outside S enter only through the step's gradient, which the trainer computed.
The cost of the per-prompt passes follows k, not B.

Standard errors, with ``t_n = -X_n . Delta theta(y_{-n})`` (n in S) and ``u_n = -b_n`` (``b_n =
Ytilde_n . K^T Xbar``, prompt n's first-order influence on the step's change, times B):

- the step taken (its gradient fixed: the X side): ``Var(t) / k + V_pair``, where only the k (k - 1)
  ordered pairs inside S meet their swaps (rollout_ustat.pair_variance), so that
  ``V_pair = (k - 1) tr(K C K C) / (k (B - 1)^2)`` (``(B(B - 1))^-1 tr`` at k = B);
- the expected step (a fresh batch: both sides): the X side over k prompts, the Y side over all B
  (each of the B prompts moves the step; S is a random sample of them) and their covariance, which
  only the prompts of S carry: ``Var(t) / k + Var(u) / B + 2 Cov(t, u) / B`` (``Var(t + u) / B`` at
  k = B), each moment estimated over S.
"""
from __future__ import annotations

import math

import torch

from entprobe.math import estimators as est
from entprobe.math.rollout_ustat import CrossPrompt, KernelTerms


def draw_subset(B: int, k: int, seed: int) -> list[int]:
    """k of B prompt indices, uniformly without replacement (a generator seeded with ``seed``:
    independent of the batch's content), sorted."""
    if not 1 <= k <= B:
        raise ValueError(f"a subset of {k} of {B} prompts")
    gen = torch.Generator().manual_seed(int(seed) % (2 ** 63))
    return sorted(torch.randperm(B, generator=gen)[:k].tolist())


def jackknife_rows(U: float, w: torch.Tensor) -> torch.Tensor:
    """Rows ``r_n = U + s (w_n - mean w)``, ``s = (k - 2) / (2 (k - 1))``, whose delete-1 jackknife
    (``ustat.row_statistics``: ``4 (k - 1) / (k (k - 2)^2) sum (r - mean r)^2``) is ``Var(w) / k``, the
    variance of the mean of w: per-prompt rows the forecast (math/forecast.py) combines as it combines
    the full statistic's."""
    k = w.numel()
    return U + (k - 2) / (2 * (k - 1)) * (w.double() - w.double().mean())


def subset_cross_prompt(e_loo: torch.Tensor, kt: KernelTerms, B: int) -> CrossPrompt:
    """``U = -mean_S e_loo_n``, the own terms ``t_n = -e_loo_n`` and rows (``jackknife_rows``) whose
    jackknife is the expected step's variance with the Y side at ``sqrt(k / B)``: ``w = t + sqrt(k/B) u``
    gives ``Var(t)/k + Var(u)/B + 2 Cov(t, u)/sqrt(kB)`` (the covariance at ``sqrt(B/k)`` times its weight
    in ``subset_errors``, exact at k = B). ``kt`` zero for the parts that do not depend on the gradient."""
    t = -e_loo.double()
    k = t.numel()
    if k < 3:
        raise ValueError(f"{k} probed prompts: the subset's intervals need >= 3")
    U = float(t.mean())
    w = t - math.sqrt(k / B) * kt.b.double()
    return CrossPrompt(U, t, jackknife_rows(U, w))


def subset_errors(cp: CrossPrompt, kt: KernelTerms, B: int, pair_var_k: float = 0.0) -> dict:
    """``SE_step``, ``SE_expected`` (module docstring) and ``SE_plugin`` (= ``SE_expected``: the subset
    has no separate plug-in) of ``subset_cross_prompt``'s statistic over k of B prompts;
    ``pair_var_k``: ``rollout_ustat.pair_variance`` of the k probed prompts' pairs, ``tr / (k (k - 1))``,
    rescaled here to ``(k - 1) tr / (k (B - 1)^2)``."""
    t, u = cp.own.double(), -kt.b.double()
    k = t.numel()
    v_pair = max(pair_var_k, 0.0) * (k - 1) ** 2 / (B - 1) ** 2
    var_t, var_u = float(t.var()), float(u.var())
    cov = float(((t - t.mean()) * (u - u.mean())).sum()) / (k - 1)
    expected = max(var_t / k + var_u / B + 2 * cov / B, 0.0)
    return {"SE_step": math.sqrt(est.mean_variance(t) + v_pair), "SE_expected": math.sqrt(expected),
            "SE_plugin": math.sqrt(expected)}
