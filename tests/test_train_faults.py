"""``python -m entprobe.train`` faults of issue 39 ("train"): options refused up front with one line each,
the docs the help cites exist, no stray progress bar, and the printed probe / guard lines say which
numbers they compare, whose entropy each H is, and (guarded) the lr the step used."""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

import entprobe.integrations.grpo_trainer as GT
from entprobe.cli.train import main
from entprobe.config import ConfigError
from entprobe.integrations.grpo_trainer import ROLLOUTS_MIN_B, TrainArgs, check_args, train
from entprobe.integrations.guard import MAX_HORIZON
from entprobe.integrations.step_lines import probe_line
from entprobe.reporting import over_steps as OS

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(steps=3, B=4, G=4, max_new_tokens=4, probe_every=1, probe_B_E=4, save_every=3)
EPS64 = torch.finfo(torch.float64).eps


@pytest.fixture
def no_model(monkeypatch):
    """The model must not load: an option refused up front is refused before it."""
    def refuse(a):
        raise AssertionError("the model was loaded before the options were checked")
    monkeypatch.setattr(GT, "load_policy", refuse)


def one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("entprobe: error: ")
    return err[0][len("entprobe: error: "):]


def test_guard_horizon_beyond_the_bound_is_refused_before_the_model_loads(tmp_path, no_model, capsys):
    base = ["--out", str(tmp_path / "r"), "--probe-every", "1", "--probe-source", "rollouts", "--guard-floor", "0.1"]
    # the bound said (this check's wording, or EntropyGuard's own range's where it has one: param_error first)
    bound = re.compile(rf"(at most|from 1 to) {MAX_HORIZON}\b")
    for K in (1000000000, MAX_HORIZON + 1):
        msg = one_line_error([*base, "--guard-horizon", str(K)], capsys)
        assert msg.startswith(f"--guard-horizon={K}: ") and bound.search(msg), msg
    a = TrainArgs(out=str(tmp_path / "r"), probe_every=1, probe_source="rollouts", guard_floor=0.1,
                  guard_horizon=MAX_HORIZON)
    check_args(a)  # the bound itself is allowed
    assert "invalid int value: '2.5'" in one_line_error([*base, "--guard-horizon", "2.5"], capsys)


def test_rollouts_with_too_few_prompts_is_refused_up_front_with_the_minimum(tmp_path, no_model, capsys):
    msg = one_line_error(["--out", str(tmp_path / "r"), "--probe-every", "1", "--probe-source", "rollouts",
                          "--B", "2"], capsys)
    assert msg.startswith(f"--B=2: --probe-source rollouts needs --B >= {ROLLOUTS_MIN_B} prompts a step")
    assert "jackknife" in msg and msg.endswith("or --probe-source held_out")
    check_args(TrainArgs(out=str(tmp_path / "r"), B=2, probe_source="rollouts"))  # no probe: no U-statistic
    check_args(TrainArgs(out=str(tmp_path / "r"), B=2, probe_every=1))  # the held-out source predicts on E


def test_the_minimum_B_is_the_real_one(tmp_path):
    """ROLLOUTS_MIN_B prompts run the rollouts probe (the refusal is no stricter than the estimator)."""
    lines = []
    train(TrainArgs(out=str(tmp_path / "r"), **{**TINY, "steps": 2, "B": ROLLOUTS_MIN_B, "probe_B_E": 0},
                    probe_source="rollouts"), log=lines.append)
    probes = [x for x in lines if x.startswith("[entprobe] step 2: predicted ")]
    assert len(probes) == 1 and "from the step's rollouts (H " in probes[0] and probes[0].endswith(
        ")") and "; not measured" in probes[0]


@pytest.mark.parametrize("argv, want, others", [
    (["--lr", "0"], "--lr=0.0: the AdamW peak learning rate must be a finite number > 0", ("--max-grad-norm", "--probe-every")),
    (["--lr", "nan"], "--lr=nan: the AdamW peak learning rate must be a finite number > 0", ("--max-grad-norm", "--probe-every")),
    (["--max-grad-norm", "-1"], "--max-grad-norm=-1.0: must be a finite number >= 0 (0: no clipping)", ("--lr", "--probe-every")),
    (["--probe-every", "-1"], "--probe-every=-1: must be >= 0 (N: probe every N steps; 0: no probe)", ("--lr", "--max-grad-norm")),
])
def test_each_condition_has_its_own_message(tmp_path, no_model, capsys, argv, want, others):
    msg = one_line_error(["--out", str(tmp_path / "r"), *argv], capsys)
    assert msg == want and not any(o in msg for o in others)


def test_the_docs_the_sources_and_help_cite_exist(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    cited = set(re.findall(r"docs/[\w.-]+\.md", capsys.readouterr().out))
    for path in (ROOT / "src").rglob("*.py"):
        cited |= set(re.findall(r"docs/[\w.-]+\.md", path.read_text()))
    assert "docs/rollouts.md" in cited
    assert sorted(c for c in cited if not (ROOT / c).is_file()) == []


def test_checkpoints_are_saved_without_a_progress_bar_and_warnings_still_show(tmp_path, capfd, caplog):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # as a user's session has it
    train(TrainArgs(out=str(tmp_path / "r"), **{**TINY, "steps": 1, "probe_every": 0, "save_every": 1}), log=print)
    out, err = capfd.readouterr()
    assert (tmp_path / "r" / "checkpoint-1" / "model.safetensors").is_file()
    assert "Writing model shards" not in out + err and "Loading weights" not in out + err
    assert hf_logging.is_progress_bar_enabled()  # put back as it was
    with GT.no_progress_bars(), caplog.at_level("WARNING"):
        hf_logging.get_logger("transformers.modeling_utils").warning("entprobe-test warning")
    assert [r.getMessage() for r in caplog.records] == ["entprobe-test warning"]  # the logger is not the bar


# the issue's line: a rollouts prediction, measured on E against E's own prediction
ISSUE_METRICS = {"entprobe/deltaH_pred": 8.576e-02, "entprobe/SE_deltaH_pred": 3.9e-02, "entprobe/deltaH_true": -6.882e-02,
                 "entprobe/SE_deltaH_true": 1.8e-02, "entprobe/pred_consistent": 1.0, "entprobe/deltaH_pred_E": -5.84e-02,
                 "entprobe/H_orig": 0.386, "entprobe/time_s": 0.1}


def test_the_rollouts_line_names_both_numbers_it_compares_and_each_H():
    assert probe_line(7, ISSUE_METRICS, "rollouts", 0.298) == (
        "step 7: predicted +8.576e-02 ± 3.9e-02 from the step's rollouts (H 0.298); measured on held-out E "
        "(H 0.386) -6.882e-02 ± 1.8e-02 vs predicted on E -5.840e-02: consistent (0.1 s)")
    held = {k: v for k, v in ISSUE_METRICS.items() if k != "entprobe/deltaH_pred_E"}
    assert probe_line(7, {**held, "entprobe/pred_consistent": 0.0}, "held_out") == (
        "step 7: predicted +8.576e-02 ± 3.9e-02 on held-out E (H 0.386); measured -6.882e-02 ± 1.8e-02 vs "
        "predicted +8.576e-02: inconsistent (0.1 s)")
    assert probe_line(7, {**ISSUE_METRICS, "entprobe/pred_consistent": math.nan}, "rollouts", 0.298).endswith(
        "measured on held-out E (H 0.386): unmeasurable (too few effective importance weights), not compared with "
        "the predicted on E -5.840e-02 (0.1 s)")
    unmeasured = {k: v for k, v in held.items() if "true" not in k and "consistent" not in k}
    assert probe_line(7, unmeasured, "rollouts") == (  # no E: H_orig is the rollouts'
        "step 7: predicted +8.576e-02 ± 3.9e-02 from the step's rollouts (H 0.386); not measured (0.1 s)")


def test_trainer_rollouts_run_prints_and_tables_the_numbers_it_logged(tmp_path):
    lines = []
    out = tmp_path / "r"
    train(TrainArgs(out=str(out), **TINY, probe_source="rollouts"), log=lines.append)
    state = __import__("json").loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    logged = {e["step"]: e for e in state["log_history"] if "entprobe/deltaH_pred" in e}
    printed = {int(x.split()[2][:-1]): x for x in lines if re.match(r"\[entprobe\] step \d+: predicted ", x)}
    assert sorted(printed) == sorted(logged) == [1, 2, 3]
    rows = {r["step"]: r for r in OS.read_csv(out / "entprobe_over_steps.csv")}
    for step, e in logged.items():
        x = printed[step]
        assert f"from the step's rollouts (H {e['entprobe/H_rollouts']:.3g}); " in x
        assert f"measured on held-out E (H {e['entprobe/H_orig']:.3g}) {e['entprobe/deltaH_true']:+.3e} ± " in x
        assert f" vs predicted on E {e['entprobe/deltaH_pred_E']:+.3e}: " in x
        assert x.split(": ")[-1].startswith("consistent" if e["entprobe/pred_consistent"] else "inconsistent")
        r = rows[step]
        assert r["H_batch"] == "E" and r["H"] == pytest.approx(e["entprobe/H_orig"], rel=4 * EPS64)
        assert r["H_rollouts"] == pytest.approx(e["entprobe/H_rollouts"], rel=4 * EPS64)
        assert r["H_rollouts"] != r["H"]  # E's and the step's batch's entropy: two batches, two numbers


def test_over_steps_rows_say_whose_H_it_is():
    rollouts_only = {"step": 2, "H_orig": 0.3, "deltaH_pred": 0.01, "forecast_H_k1": 0.31}
    (r,) = OS.history_rows([rollouts_only])
    assert r["H_batch"] == "rollouts" and r["H_rollouts"] == 0.3
    (r,) = OS.history_rows([{**rollouts_only, "deltaH_pred_E": 0.02}])  # measured on E: H_orig is E's
    assert r["H_batch"] == "E" and math.isnan(r["H_rollouts"])
    (r,) = OS.history_rows([{"step": 2, "H_orig": 0.3, "deltaH_pred": 0.01, "B_E": 8}])
    assert r["H_batch"] == "E"
    assert OS.over_steps_row(10, "ok", {"H_orig": 0.3, "forecast_H_k1": 0.2})["H_batch"] == "E"  # a checkpoint's job


def test_a_guarded_step_prints_one_line_at_the_lr_it_used(tmp_path, monkeypatch):
    """The guard's factor forced to 0.25 at step 2: one line for that step, the decision first, its lr
    the schedule's x 0.25 and its prediction the logged one (the scheduler's x 0.25)."""
    import entprobe.integrations.guard as G

    real = G.decide
    monkeypatch.setattr(G, "decide", lambda *a: dataclasses.replace(real(*a), factor=0.25, action="cut")
                        if a[1] == 2 else real(*a))
    lines = []
    guard = {}
    real_guard = GT.EntropyGuard

    def keep(*a, **k):
        guard["g"] = real_guard(*a, **k)
        return guard["g"]
    monkeypatch.setattr(GT, "EntropyGuard", keep)
    out = tmp_path / "r"
    train(TrainArgs(out=str(out), **{**TINY, "steps": 2}, guard_max_decay=0.05), log=lines.append)
    step2 = [x for x in lines if x.startswith("[entprobe] step 2: ") and " -> " not in x]
    assert len(step2) == 1, lines
    e = __import__("json").loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"][1]
    d = guard["g"].decisions[-1]
    assert e["entprobe/lr"] == pytest.approx(0.25 * 1e-3, rel=4 * EPS64)
    assert e["entprobe/deltaH_pred"] == pytest.approx(0.25 * d.deltaH_pred, rel=4 * EPS64)
    assert step2[0].startswith(f"[entprobe] step 2: guard cut: lr x0.25 = 0.00025 (was x1, max_decay 0.05); "
                               f"predicted {e['entprobe/deltaH_pred']:+.3e} ± {e['entprobe/SE_deltaH_pred']:.1e} at that "
                               f"lr on held-out E (H {e['entprobe/H_orig']:.3g}); measured ")
    assert f" vs predicted {e['entprobe/deltaH_pred']:+.3e}: " in step2[0]
    assert f"{d.deltaH_pred:+.3e}" not in step2[0]  # the scheduler's-lr prediction is not printed as well
