"""The k-step forecast (math/forecast.py) against AdamW itself: on an entropy that is linear in the
parameters (so first order is exact), torch.optim.AdamW run for k steps moves it by what the
forecast's carried, fresh and weight-decay parts say, when the future gradients are what the
forecast assumes (their squares a fixed multiple kappa of v_hat, coordinate by coordinate); and the
fresh steps' spread is ``var_fresh sum c_i^2`` over random future gradients.
"""
from __future__ import annotations

import math

import pytest
import torch

from entprobe.math import forecast as fc
from entprobe.math.adamw import AdamWHyper, adamw_update


def _state(D: int, t: int, kappa: float, gen: torch.Generator, beta2: float = 0.999):
    """A parameter with AdamW state after t steps whose next gradient g has ``g^2 = kappa v_hat_1``
    per coordinate (``v_hat_1`` the second moment after that step)."""
    g = torch.randn(D, generator=gen, dtype=torch.float64)
    # v_hat_1 = (beta2 v0 + (1 - beta2) g^2) / (1 - beta2^(t+1)) = g^2 / kappa  ->  v0
    v0 = (g ** 2 / kappa * (1 - beta2 ** (t + 1)) - (1 - beta2) * g ** 2) / beta2
    assert bool((v0 > 0).all())
    m0 = torch.randn(D, generator=gen, dtype=torch.float64) * g.abs() * 0.3
    return g, m0, v0


def _adamw(theta, g, m0, v0, t, lr, wd, steps):
    """AdamW's parameters before each of ``steps`` steps and after the last: [steps + 1, D]."""
    p = torch.nn.Parameter(theta.clone())
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd)
    opt.state[p] = {"step": torch.tensor(float(t)), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    path = [p.detach().clone()]
    for _ in range(steps):
        p.grad = g.clone()
        opt.step()
        path.append(p.detach().clone())
    return torch.stack(path)


@pytest.mark.parametrize("t,kappa", [(20, 1.0), (20, 3.0), (500, 0.5)])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_carried_and_fresh_parts_are_adamw_s_steps(t, kappa, wd):
    """Every future gradient equal to this step's (no noise) and its square kappa v_hat_1: the
    forecast's change after k steps at that kappa is ``w . (theta_k - theta)`` of AdamW's own k steps."""
    gen = torch.Generator().manual_seed(0)
    D, lr = 50, 1e-3
    g, m0, v0 = _state(D, t, kappa, gen)
    w = torch.randn(D, generator=gen, dtype=torch.float64)  # H(theta) = w . theta
    theta = torch.randn(D, generator=gen, dtype=torch.float64)
    parts = adamw_update(-g, m0, v0, theta, AdamWHyper(lr, wd, 0.9, 0.999, 1e-8, float(t)))
    z = torch.zeros(4, dtype=torch.float64)
    f = fc.ForecastInputs(10.0, z, float(w @ parts["gradient"]), z, float(w @ parts["momentum"]), z,
                          float(w @ parts["weight_decay"]), z, 0.0, 0.0, float(t), 0.9, 0.999, kappa, 3)
    v_hat = (0.999 * v0 + 0.001 * g ** 2) / (1 - 0.999 ** (t + 1))
    for k in (1, 5, 10):
        path = _adamw(theta, g, m0, v0, t, lr, wd, k) - theta
        realised = float(w @ path[-1])
        A, Bk, _ = fc.coefficients(k, t, 0.9, 0.999, kappa)
        dH = A * (f.mom + f.grad) + Bk * f.grad + k * f.wd
        # the forecast holds the decay at theta: step j's decay term is -lr wd w . theta_{j-1}, so the
        # realised change is the forecast's minus lr wd sum_j w . (theta_{j-1} - theta), exactly ...
        drift = lr * wd * float((path[:-1] @ w).sum())
        # ... up to eps = 1e-8 next to sqrt(v_hat) in the scale ratio D_1 / D_j (relative eps / sqrt(v_hat)
        # per step) and fp64 rounding
        tol = 2 * k * 1e-8 / float(v_hat.sqrt().min()) * abs(realised) + 1e-14
        assert abs(dH - drift - realised) <= tol, (k, dH, drift, realised, tol)
        assert fc.forecast(f, k)["dH"] == pytest.approx(dH, rel=1e-12)


def test_the_fresh_steps_spread():
    """Random future gradients around this one (v_hat set by a long history: t = 2000, so their
    squares move it by 1e-3 per step at most): the spread over 4000 runs of AdamW's own 10-step change
    matches ``var_fresh sum_{i=2..10} c_i^2`` (relative SE of a variance from 4000 draws: 2.2%; 5 of them)."""
    gen = torch.Generator().manual_seed(1)
    D, lr, t, k, N = 20, 1e-3, 2000, 10, 4000
    g, m0, v0 = _state(D, t, 1.0, gen)
    w = torch.randn(D, generator=gen, dtype=torch.float64)
    noise = 0.2 * g.abs()
    # 4000 independent AdamW runs as one batched parameter [N, D], same state
    p = torch.nn.Parameter(torch.zeros(N, D, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
    opt.state[p] = {"step": torch.tensor(float(t)), "exp_avg": m0.expand(N, D).clone(),
                    "exp_avg_sq": v0.expand(N, D).clone()}
    for j in range(k):
        eps = torch.randn(N, D, generator=gen, dtype=torch.float64) * noise if j else 0.0
        p.grad = (g + eps).expand(N, D).clone() if j == 0 else g + eps
        opt.step()
    realised = p.detach() @ w
    # one fresh step's gradient part: -lr (1 - beta1) / bc1 w . (g + eps) / D_1; its variance
    bc1, bc2 = 1 - 0.9 ** (t + 1), 1 - 0.999 ** (t + 1)
    Dn = ((0.999 * v0 + 0.001 * g ** 2) / bc2).sqrt() + 1e-8
    var_fresh = float(((lr * 0.1 / bc1 * w / Dn) ** 2 * noise ** 2).sum())
    _, _, c2 = fc.coefficients(k, t, 0.9, 0.999, 1.0)
    predicted = var_fresh * c2
    assert abs(float(realised.var()) / predicted - 1) < 5 * math.sqrt(2 / N), (float(realised.var()), predicted)


def test_kappa_band_and_sgd():
    """kappa = 1 keeps v_hat (nu = 1); kappa = 0 is the smallest v_hat (the largest steps); plain SGD
    (no momentum, no denominator): every step is step 1's, A_k = 1 and B_k = k - 1."""
    assert fc.nu(7, 20, 0.999, 1.0) == pytest.approx(1.0, rel=1e-12)
    assert fc.nu(7, 20, 0.999, 0.0) < 1 < fc.nu(7, 20, 0.999, 2.0)
    assert fc.coefficients(10, 0, 0.0, 0.0, 1.0) == (1.0, 9.0, 9.0)


def test_calibration_script_runs(tmp_path):
    """docs/forecast.md's command, shortened (one lr, one seed, 20 steps): it exits 0 and prints, per
    horizon, the coverage line the table is made of."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert "OMP_NUM_THREADS=1 python benchmarks/forecast_calibration.py --seeds 0,1,2,3,4,5 --record" in (root / "docs" / "forecast.md").read_text()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "benchmarks/forecast_calibration.py", "--lrs", "1e-3", "--seeds", "0",
                           "--steps", "20", "--record", str(tmp_path)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if "coverage" in x]
    assert len(lines) == 6 and all(f"k {k:2d}:" in "".join(lines) for k in (1, 5, 10))
    # --replay of what --record wrote prints the same tables, with no training
    again = subprocess.run([sys.executable, "benchmarks/forecast_calibration.py", "--replay", str(tmp_path)], cwd=root,
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [x.split(": ", 1)[1] for x in again.stdout.splitlines() if "coverage" in x] == \
        [x.split(": ", 1)[1] for x in lines]
