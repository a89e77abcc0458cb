"""The batch-size planner (plan_math.py, plan.py): the closed form, the zeta fit and the command on
a real run (the plan checked against exact enumeration: test_plan_exact.py)."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from entprobe.math import estimators as est
from entprobe.math import planning as pm
from entprobe.cli.plan import main
from entprobe.reporting.planning import plan_directory, sign_plan_row
from entprobe.reporting.tables import PER_UNIT_FILE
from entprobe.reporting.verdict import verdict_lines

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the closed form
def test_closed_form_reaches_the_target_at_the_least_cost():
    """B_i = sqrt(var_i / c_i) sum_j sqrt(var_j c_j) / t^2: SE = t before rounding, <= t after,
    and no other split of the same cost does better (scan over B_E on a 2-side problem)."""
    sides = [pm.Side("B_E", 8, 3.0, 4.0), pm.Side("B_U", 8, 0.5, 1.0)]
    t = 0.05
    sizes = pm.optimal_sizes(sides, t)
    se = pm.standard_error(sides, sizes)
    assert se <= t and se > 0.97 * t  # rounding up costs at most a unit a side
    S = math.sqrt(3.0 * 4.0) + math.sqrt(0.5 * 1.0)
    assert sizes == {"B_E": math.ceil(math.sqrt(3.0 / 4.0) * S / t ** 2), "B_U": math.ceil(math.sqrt(0.5) * S / t ** 2)}
    cost = 4.0 * sizes["B_E"] + sizes["B_U"]
    for BE in range(2, 4000):  # the cheapest B_U for each B_E that still meets the target
        left = t ** 2 - 3.0 / BE
        if left > 0:
            assert 4.0 * BE + math.ceil(0.5 / left) >= cost - 4.0  # within one unit's rounding
    assert pm.cost_ratio(sides, sizes) == pytest.approx(cost / (4.0 * 8 + 8))
    # equal costs: B proportional to the per-unit standard deviation
    eq = pm.optimal_sizes([pm.Side("B_E", 4, 4.0, 1.0), pm.Side("B_U", 4, 1.0, 1.0)], 0.1)
    assert eq["B_E"] == pytest.approx(2 * eq["B_U"], abs=1)


def test_fixed_sides_spend_the_budget_first_and_bad_targets_fail():
    sides = [pm.Side("B_E", 10, 1.0, 1.0), pm.Side("B_U", 10, 1.0, 1.0, fixed=True)]  # 0.1 from U alone
    sizes = pm.optimal_sizes(sides, 0.5)
    assert set(sizes) == {"B_E"} and sizes["B_E"] == math.ceil(1.0 / (0.25 - 0.1))
    with pytest.raises(ValueError, match="held fixed"):
        pm.optimal_sizes(sides, 0.3)  # 0.3^2 < 1/10: only B_U could get there
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="positive"):
            pm.optimal_sizes(sides, bad)
    # a side without variance needs no more than the minimum
    assert pm.optimal_sizes([pm.Side("B_E", 10, 0.0, 1.0)], 0.1) == {"B_E": pm.MIN_UNITS}


def test_extreme_targets_and_variances_say_why_instead_of_overflowing():
    """target_se whose square overflows or rounds to 0 (1e300 was an OverflowError), a plan beyond
    MAX_UNITS, non-finite variances and (t r)^2 overflowing in se_rel_error: ValueErrors that say why."""
    sides = [pm.Side("B_E", 8, 3.0, 4.0), pm.Side("B_U", 8, 0.5, 1.0)]
    for bad in (1e300, 1e151, 1e-151, 1e-300):
        with pytest.raises(ValueError, match=r"target_se=.* is outside \[1e-150, 1e\+150\]"):
            pm.optimal_sizes(sides, bad)
    with pytest.raises(ValueError, match=r"would need B_E = .* units .*not reachable"):
        pm.optimal_sizes(sides, 1e-140)  # about 1e280 units
    with pytest.raises(ValueError, match=r"variance of B_E \(inf\) is not finite"):
        pm.optimal_sizes([pm.Side("B_E", 8, math.inf, 4.0)], 0.1)
    assert pm.optimal_sizes([pm.Side("B_E", 8, 1e200, 4.0)], 1e100) == {"B_E": pm.MIN_UNITS}
    assert pm.se_rel_error([pm.Side("B_E", 8, 1e300, 1.0, rel_se_var=0.5)], {"B_E": 2}) == pytest.approx(0.25)
    assert pm.ustat_size_for(2.0, 30.0, math.inf) == 3
    with pytest.raises(ValueError, match="not reachable"):
        pm.ustat_size_for(2.0, 30.0, 1e-300)
    with pytest.raises(ValueError, match="not finite"):
        pm.ustat_size_for(math.nan, 30.0, 1.0)


def test_damaged_or_extreme_run_records_are_named(tmp_path):
    """An SE of 1e200 (its square was an OverflowError), a missing key, a record that is not an
    object, bytes that are not UTF-8, a sweep job without SE_jack: each says which file."""
    from entprobe.reporting.planning import PlanError
    run = tmp_path / "0"
    run.mkdir()
    res = {"mode": "single_batch", "M": 8, "B": 8, "unit_size": 1, "G": 4, "lr": 1e-3, "SE_deltaH1": 1e200,
           "pairs_per_block": 0}
    (run / "results.json").write_text(json.dumps(res))
    assert "not reachable: the per-unit variance of B (inf) is not finite" in "\n".join(plan_directory(run, 0.01))
    for record, says in (({k: v for k, v in res.items() if k != "G"}, "KeyError 'G'"),
                         ({**res, "M": "eight"}, "ValueError"), ([1], "holds a list")):
        (run / "results.json").write_text(json.dumps(record))
        with pytest.raises(PlanError, match=f"{run / 'results.json'}:? .*{says}"):
            plan_directory(run, 0.01)
    (run / "results.json").write_bytes(b'{"mode": "caf\xe9"}')
    with pytest.raises(PlanError, match="is not valid JSON"):
        plan_directory(run, 0.01)
    for job, M in ((0, 4), (1, 8)):  # a sweep of single_batch jobs, one without its jackknife SE
        (tmp_path / str(job)).mkdir(exist_ok=True)
        (tmp_path / str(job) / "results.json").write_text(json.dumps({**res, "M": M, **({"SE_jack": 0.1} if job else {})}))
    with pytest.raises(PlanError, match="KeyError 'SE_jack'"):
        plan_directory(tmp_path, 0.01)


def test_variance_rel_se_is_the_spread_of_the_sample_variance_and_a_floor_for_heavy_tails():
    """Normal units: the sample variance's actual spread over 4000 draws, sqrt(2/(B-1)), within 10%.
    Exponential units (excess kurtosis 6): above the normal value, below the actual spread (B
    units under-estimate a heavy tail): the planner prints it as a floor."""
    gen = torch.Generator().manual_seed(0)
    B = 40
    x = torch.randn(4000, B, generator=gen, dtype=torch.float64)
    actual = float(x.var(1).std() / x.var(1).mean())
    rel = torch.tensor([pm.variance_rel_se(r) for r in x[:400]])
    assert actual == pytest.approx(math.sqrt(2 / (B - 1)), rel=0.1)
    assert float(rel.mean()) == pytest.approx(actual, rel=0.1)
    x = torch.empty(4000, B, dtype=torch.float64).exponential_(generator=gen)
    actual = float(x.var(1).std() / x.var(1).mean())
    rel = float(torch.tensor([pm.variance_rel_se(r) for r in x[:400]]).mean())
    assert 1.3 * math.sqrt(2 / (B - 1)) < rel < actual  # measured 0.35 < 0.44
    assert math.isnan(pm.variance_rel_se(torch.ones(3)))


# ---------------------------------------------------------------- zeta_1, zeta_2 from a sweep over B
def _scalar_ustat_draws(B: int, R: int, gen: torch.Generator):
    """R draws of the U-statistic of h(u, v) = X_u Y_v on B units of correlated normal (X, Y)
    (means 0.3, 0.2, unit variances, correlation 0.3), and their delete-1 jackknife variances."""
    z = torch.randn(R, B, 2, generator=gen, dtype=torch.float64)
    X = 0.3 + z[..., 0]
    Y = 0.2 + 0.3 * z[..., 0] + math.sqrt(1 - 0.09) * z[..., 1]
    a, b, d = X * Y.mean(1, keepdim=True), Y * X.mean(1, keepdim=True), X * Y
    m = a.mean(1, keepdim=True)
    U = B / (B - 1) * m[:, 0] - d.sum(1) / (B * (B - 1))
    U_loo = (B * B * m - B * a - B * b + 2 * d - d.sum(1, keepdim=True)) / ((B - 1) * (B - 2))
    var_jack = (B - 1) / B * ((U_loo - U_loo.mean(1, keepdim=True)) ** 2).sum(1)
    u0 = est.u_statistic(a[0], b[0], d[0])  # the production jackknife, same numbers
    assert u0.U_cross == pytest.approx(float(U[0]), rel=1e-12)
    assert u0.SE_jack ** 2 == pytest.approx(float(var_jack[0]), rel=1e-9)
    return U, var_jack


def test_zeta_fit_recovers_known_zetas():
    """h(u,v) = X_u Y_v, symmetrised: zeta1 = Var(E[h|u]) = (my^2 + mx^2 + 2 mx my c)/4,
    zeta2 = Var(h_s) = (2 E[X^2]E[Y^2] + 2 E[XY]^2)/4 - (mx my)^2. Exact variances give them back
    to rounding; 4000 draws at each of 5 B (replicate variances, ``variance``; mean jackknife
    variances, ``jackknife``) within Monte-Carlo error."""
    mx, my, c = 0.3, 0.2, 0.3
    zeta1 = (my ** 2 + mx ** 2 + 2 * mx * my * c) / 4
    zeta2 = (2 * (1 + mx ** 2) * (1 + my ** 2) + 2 * (c + mx * my) ** 2) / 4 - (mx * my) ** 2
    Bs = [4, 6, 10, 16, 32]
    exact = pm.fit_zeta(Bs, [pm.ustat_variance(zeta1, zeta2, B) for B in Bs])
    assert (exact.zeta1, exact.zeta2) == pytest.approx((zeta1, zeta2), rel=1e-10) and exact.rel_rms_residual < 1e-10
    jk = pm.fit_zeta(Bs, [pm.ustat_jackknife_mean(zeta1, zeta2, B) for B in Bs], "jackknife")
    assert (jk.zeta1, jk.zeta2) == pytest.approx((zeta1, zeta2), rel=1e-10)

    gen = torch.Generator().manual_seed(3)
    Bs = [4, 5, 7, 10, 16]
    draws = [_scalar_ustat_draws(B, 4000, gen) for B in Bs]
    rep = pm.fit_zeta(Bs, [float(U.var()) for U, _ in draws], "variance")
    jack = pm.fit_zeta([B for B in Bs for _ in range(4000)], torch.cat([v for _, v in draws]).tolist(), "jackknife")
    for fit in (rep, jack):
        assert fit.zeta1 == pytest.approx(zeta1, rel=0.25), fit
        assert fit.zeta2 == pytest.approx(zeta2, rel=0.1), fit
    # power: the first-order model (no slope) misses small-B variance by far more than that
    assert pm.ustat_variance(zeta1, zeta2, 4) > 2 * 4 * zeta1 / 4
    # the B for a target variance, from the fitted zetas
    B = pm.ustat_size_for(zeta1, zeta2, 0.01)
    assert pm.ustat_variance(zeta1, zeta2, B) <= 0.01 < pm.ustat_variance(zeta1, zeta2, B - 1)
    with pytest.raises(ValueError, match="two or more distinct B"):
        pm.fit_zeta([8, 8], [1.0, 2.0])


# ---------------------------------------------------------------- the command on a real run
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real two-batch run of the built-in default (B_E = B_U = 6, G = 4)."""
    from conftest import compose_cfg
    from entprobe.cli.probe_job import run

    d = tmp_path_factory.mktemp("pilot")
    run(compose_cfg(d, "batch.B_E=6", "batch.B_U=6"))
    return d


def test_command_plans_from_a_real_run(run_dir, capsys):
    """per_unit.json holds the SEs results.json reports; the printed plan is the closed form
    on them; ``--target-se`` is the same command."""
    res = json.loads((run_dir / "results.json").read_text())
    proj = json.loads((run_dir / PER_UNIT_FILE).read_text())
    assert (proj["B_E"], proj["B_U"], proj["G"]) == (6, 6, 4) and proj["u"] is not None
    e = torch.tensor(list(proj["e"].values()), dtype=torch.float64).sum(0)
    assert math.sqrt(est.mean_variance(e)) == pytest.approx(res["SE_deltaH_pred"], rel=1e-9)
    assert math.sqrt(est.mean_variance(torch.tensor(proj["u"], dtype=torch.float64))) == pytest.approx(res["SE_deltaH_pred_U"], rel=1e-9)
    assert est.mean_variance(torch.tensor(proj["a"], dtype=torch.float64)) == pytest.approx(res["V_X"], rel=1e-9)
    assert est.mean_variance(torch.tensor(proj["b"], dtype=torch.float64)) == pytest.approx(res["V_Y"], rel=1e-9)

    target = res["SE_deltaH_pred"] / 3
    assert main([str(run_dir), f"target_se={target!r}"]) == 0
    out = capsys.readouterr().out
    need = math.ceil(6 * res["SE_deltaH_pred"] ** 2 / target ** 2 * (1 - 1e-12))  # 9 x 6 = 54
    row = next(line for line in out.splitlines() if line.startswith("deltaH_pred "))
    assert f"B_E={need} B_U=6" in row and f"{(need + 6) / 12:.3g} units" in row, row
    assert {line.split()[0] for line in out.splitlines()[3:6]} == {"deltaH_pred", "deltaH_pred_expected", "deltaH1"}
    assert "G held at 4" in out
    assert main([str(run_dir), "--target-se", repr(target)]) == 0
    assert capsys.readouterr().out == out


def test_bad_inputs_say_what_to_change(run_dir, tmp_path, capsys):
    def fails(argv, needle):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err, err

    fails([str(tmp_path / "nowhere"), "target_se=0.1"], "is not a directory")
    fails([str(tmp_path), "target_se=0.1"], "not a finished run or sweep")
    fails([str(run_dir), "target_se=0"], "must be a positive number")
    fails([str(run_dir), "target_se=-1"], "must be a positive number")
    fails([str(run_dir), "target_se=1e300"], "target_se=1e+300 is outside [1e-150, 1e+150]")  # was an OverflowError
    assert main([str(run_dir), "target_se=1e-140"]) == 0  # in range, but no batch gets there: each row says so
    assert capsys.readouterr().out.count("not reachable: target_se=1e-140 would need") == 3
    old = tmp_path / "old_run"
    shutil.copytree(run_dir, old)
    (old / PER_UNIT_FILE).unlink()
    fails([str(old), "target_se=0.1"], "variance_enabled")
    (old / "results.json").write_text("{trunc")
    fails([str(old), "target_se=0.1"], "not valid JSON")
    for argv, needle in (([str(run_dir)], "target_se=VALUE"), ([str(run_dir), "target_se=abc"], "not a number"),
                         ([str(run_dir), "target=0.1"], "unknown argument")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err  # one line, not argparse's usage block
        assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("entprobe: error: ") and needle in err


def test_sweep_directory_fits_zetas_and_plans_each_two_batch_job(run_dir, tmp_path):
    """Single-batch jobs at three B whose jackknife variances are the exact expectations for
    known zetas: the fit gives them back; a two-batch job gets its headline row."""
    zeta1, zeta2, lr = 2.0, 30.0, 1e-3
    for job, M in enumerate((4, 8, 16, 8)):
        res = {"mode": "single_batch", "M": M, "B": M, "unit_size": 1, "G": 4, "lr": lr, "pairs_per_block": 0,
               "SE_jack": math.sqrt(pm.ustat_jackknife_mean(zeta1, zeta2, M)), "U_cross": 1.0 + job,
               "SE_deltaH1": lr * math.sqrt(pm.ustat_jackknife_mean(zeta1, zeta2, M))}
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "results.json").write_text(json.dumps(res))
    shutil.copytree(run_dir, tmp_path / "4")
    lines = plan_directory(tmp_path, 0.01)
    text = "\n".join(lines)
    assert f"zeta1 = {zeta1:.4g}, zeta2 = {zeta2:.4g}" in text, text
    B = pm.ustat_size_for(zeta1, zeta2, (0.01 / lr) ** 2)
    assert f"SE(deltaH1) <= 0.01 at B = {B} prompts" in text
    assert f"{8 * float(torch.tensor([2.0, 4.0]).var()):>11.4g}" in text  # the replicate column at B = 8
    assert "job 4 (lr" in text and any(line.strip().startswith("deltaH_pred ") for line in lines)


def test_single_batch_run_plans_its_B():
    res = {"mode": "single_batch", "M": 8, "B": 16, "unit_size": 2, "G": 4, "lr": 1e-3, "SE_deltaH1": 0.2,
           "pairs_per_block": 0, "SE_deltaH_pred": 0.05, "gt/B_E": 10}
    from entprobe.reporting.planning import plan_rows, single_batch_targets
    rows = plan_rows(single_batch_targets(res), 0.1)
    assert rows[0].sizes == {"B": 32} and rows[0].cost == pytest.approx(4.0)  # 4x the units of 2 prompts
    assert rows[1].target.key == "deltaH_pred" and rows[1].sizes["B_E"] == 3


def test_verdict_row_says_what_resolves_the_sign():
    r = {"deltaH_pred": 0.01, "SE_deltaH_pred": 0.02, "B_E": 8, "B_U": 8, "G": 4}
    row = sign_plan_row(r)
    assert row is not None and row[1] == f"B_E = {math.ceil(8 * 0.02 ** 2 / 0.005 ** 2)}"  # 128
    assert "B_U = 8" in row[3] and f"{(128 + 8) / 16:.3g}x" in row[3]
    assert row in verdict_lines(r)
    tiny = sign_plan_row({**r, "deltaH_pred": 1e-200})  # no batch resolves it: said, not raised
    assert tiny[1] == "not reachable" and "target_se=5e-201" in tiny[3]
    for resolved in ({**r, "SE_deltaH_pred": 0.004}, {**r, "deltaH_pred": 0.0}, {**r, "SE_deltaH_pred": math.nan},
                     {k: v for k, v in r.items() if k != "B_E"}):
        assert sign_plan_row(resolved) is None and not any(x[0] == "to resolve its sign" for x in verdict_lines(resolved))


@pytest.mark.slow
def test_planning_doc_commands_run_verbatim(tmp_path, monkeypatch, capsys):
    """Every command in docs/planning.md's bash blocks, as written, from a fresh directory (the
    runs in their own process; the planner's commands through its ``main`` in this one, same argv)."""
    import os
    import re

    text = (ROOT / "docs" / "planning.md").read_text()
    cmds = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.strip().splitlines()]
    assert len(cmds) == 4 and all(c.startswith(".venv/bin/python -m entprobe.") for c in cmds)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    monkeypatch.chdir(tmp_path)
    outs = []
    for c in cmds:
        module, *args = c.split()[2:]
        if module == "entprobe.plan":
            assert main(args) == 0
            outs.append(capsys.readouterr().out)
            continue
        proc = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=400)
        assert proc.returncode == 0, (c, proc.stderr[-3000:])
    assert "deltaH_pred " in outs[0] and "G held at" in outs[0]
    assert "zeta1 = " in outs[1] and "SE(deltaH1) <= 0.01 at B = " in outs[1]
