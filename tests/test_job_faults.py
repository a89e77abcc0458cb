"""The offline job's refusals and messages (issue 39, "main job"): each refused run is one line
``entprobe: error: ...``, exit 2, and (refused before Hydra starts) no run or sweep folder; the
verdict says what its numbers can and cannot tell.

Refusals run in process (``main()`` with the command line in ``sys.argv``): refused before any
model loads, a fraction of a second each.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import entprobe.main as entry
from conftest import QUIET_CLI

QUIET = QUIET_CLI


def refused(monkeypatch, capsys, *argv: str) -> str:
    """``python -m entprobe.main argv`` in process: it must exit 2 with one line on stderr; that line."""
    monkeypatch.setattr(sys, "argv", ["entprobe", *argv])
    with pytest.raises(SystemExit) as info:
        entry.main()
    out, err = capsys.readouterr()
    assert info.value.code == 2, err
    assert len(err.splitlines()) == 1 and out == "", err
    return err.strip()


@pytest.mark.parametrize("argv, want", [
    (["--lr", "1e-5"], "--lr is not an option: set optimizer.lr=1e-5"),
    (["--lr=1e-5"], "--lr is not an option: set optimizer.lr=1e-5"),
    (["--B_U", "4", "batch.G=4"], "--B_U is not an option: set batch.B_U=4"),
    (["-m", "--seed", "3"], "--seed is not an option: set seed=3"),
    (["--epochs", "3"], "--epochs is not an option: settings are key=value overrides (e.g. optimizer.lr=1e-5); "
                        "python -m entprobe.main --help lists every key"),
])
def test_an_unknown_flag_is_one_line_naming_the_override(cwd, monkeypatch, capsys, argv, want):
    """Not Hydra's 8-line usage: the override the flag means (common ones mapped), else --help."""
    assert refused(monkeypatch, capsys, *argv, *QUIET) == f"entprobe: error: {want}"
    assert list(cwd.iterdir()) == []


def test_hydra_flags_still_work(cwd, monkeypatch, capsys):
    """--cfg, -cn/--config-name, --help, --info are Hydra's and go through (no refusal)."""
    from entprobe.cli.command_line import unknown_flag

    for argv in (["--cfg", "job"], ["--help"], ["--hydra-help"], ["--info", "config"], ["-m", "batch.G=2,4"],
                 ["--multirun", "x=1"], ["--config-name", "config"], ["-cn", "config"], ["-cp", "conf"],
                 ["--config-dir=/tmp"], ["--", "--lr"]):
        assert unknown_flag(argv) is None, argv
    monkeypatch.setattr(sys, "argv", ["entprobe", "--cfg", "job", "batch.B_E=3"])
    entry.main()  # prints the job's config and returns
    assert "  B_E: 3\n" in capsys.readouterr().out and list(cwd.iterdir()) == []


@pytest.mark.parametrize("sweep, job", [
    (["batch.G=4,1"], "batch.G=1"),
    (["optimizer.lr=1e-6,-1.0", "batch.B_E=4"], "optimizer.lr=-1.0 batch.B_E=4"),
])
def test_a_sweep_checks_every_jobs_ranges_before_job_0(cwd, monkeypatch, capsys, sweep, job):
    """An out-of-range value in any job of a multirun refuses the sweep before job 0 runs: one line
    naming that job's overrides and the key, and no multirun/ folder (job 0 never ran)."""
    line = refused(monkeypatch, capsys, "-m", *sweep, *QUIET)
    key = "batch.G: is 1" if "G=" in job else "optimizer.lr: must be > 0"
    assert line.startswith(f"entprobe: error: job {job} logging.logger=none logging.progress=False: {key}"), line
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "multirun"])
def test_jsonl_without_a_path_says_it_is_unset(cwd, monkeypatch, capsys, multirun):
    argv = ["-m", "task=jsonl", "batch.seed_E=0,1"] if multirun else ["task=jsonl"]
    line = refused(monkeypatch, capsys, *argv, *QUIET)
    assert line.endswith("task.path is not set: task=jsonl needs task.path=FILE.jsonl (one prompt record per line)")
    assert list(cwd.iterdir()) == []


# hand-made flat results (the verdict is a pure function of them): a resolved prediction, Adam geometry
BASE = {"deltaH_pred": -0.05, "SE_deltaH_pred": 0.01, "ci95_pred_low": -0.074, "ci95_pred_high": -0.026,
        "H_orig": 2.0, "ESS_frac": 0.9, "batch_U/frac_zero_var_groups": 0.25, "deltaH_true": -0.04,
        "SE_deltaH_true": 0.01, "deltaH_true_minus_pred": 0.01, "SE_deltaH_true_minus_pred": 0.01,
        "pred_consistent": True, "deltaH1": -0.3, "SE_deltaH1": 0.1, "preconditioner": "adam",
        "optimizer_path": "/ckpt/optimizer.pt"}


def _codes(r: dict) -> list[str]:
    from entprobe.reporting.verdict import flags

    return [c for c, _ in flags(r)]


def _rows(r: dict) -> dict[str, str]:
    from entprobe.reporting.verdict import verdict_lines

    return {what: note for what, _, _, note in verdict_lines(r)}


def test_identity_preconditioner_is_named_sgd_geometry_and_deltaH1_says_P_is_identity():
    """optimizer.preconditioner=identity without a state (the SmolLM2 smoke run's GGUF): the verdict
    says SGD geometry and the deltaH1 row is the plain gradient's; with a state (the built-in model's
    own), deltaH1 is still along the plain gradient but the step is AdamW's (no sgd_geometry)."""
    from entprobe.reporting.verdict import flags, verdict_markdown

    assert _codes(BASE) == [] and "Adam's preconditioned gradient" in _rows(BASE)["deltaH1"]
    sgd = {**BASE, "preconditioner": "identity", "optimizer_path": None, "optimizer_format": None}
    assert _codes(sgd) == ["sgd_geometry"]
    assert _rows(sgd)["deltaH1"] == "-lr Xbar.Ybar: first order along the plain gradient (P = identity), " \
                                    "the step SGD takes"
    md = verdict_markdown(sgd, flags(sgd))
    assert "**sgd_geometry**: plain SGD geometry (optimizer.preconditioner=identity, no optimizer state)" in md
    assert "Adam's" not in _rows(sgd)["deltaH1"] and "No flags" not in md
    with_state = {**BASE, "preconditioner": "identity"}
    assert _codes(with_state) == []
    assert _rows(with_state)["deltaH1"].startswith("-lr Xbar.Ybar: first order along the plain gradient (P = identity)")
    assert "not the step AdamW takes" in _rows(with_state)["deltaH1"]


@pytest.mark.parametrize("change, why", [
    ({"deltaH1": 1.374e4, "SE_deltaH1": 3.3e4}, "|deltaH1| 1.37e+04 exceeds the entropy H = 2"),
    ({"deltaH1": -2.01}, "|deltaH1| 2.01 exceeds the entropy H = 2"),
    ({"deltaH1": 0.5, "SE_deltaH1": 2.01}, "its SE 2 exceeds the entropy H = 2"),
])
def test_an_untrustworthy_deltaH1_leaves_the_headline_with_a_note(change, why):
    """|deltaH1| or its SE beyond the entropy itself: out of the headline rows, a flag says why."""
    from entprobe.reporting.verdict import flags

    r = {**BASE, **change}
    assert "deltaH1" not in _rows(r) and _codes(r) == ["deltaH1_not_shown"]
    (msg,) = [m for c, m in flags(r) if c == "deltaH1_not_shown"]
    assert f"is left out of the headline: {why}, beyond first order" in msg
    # at the bound itself it stays: |deltaH1| = SE = H is not beyond it
    edge = {**BASE, "deltaH1": 2.0, "SE_deltaH1": 2.0}
    assert "deltaH1" in _rows(edge) and _codes(edge) == []


def test_a_95_interval_holding_0_says_the_sign_is_not_resolved():
    """SE < |pred| (not noise_dominated) but the t interval holds 0: a flag, not 'No flags'."""
    from entprobe.reporting.verdict import flags, verdict_markdown

    r = {**BASE, "SE_deltaH_pred": 0.03, "ci95_pred_low": -0.121, "ci95_pred_high": 0.021}
    assert _codes(r) == ["sign_not_resolved"]
    md = verdict_markdown(r, flags(r))
    assert "**sign_not_resolved**: the prediction's 95% interval [-0.121, 0.021] holds 0" in md
    assert "No flags" not in md
    assert _codes({**r, "SE_deltaH_pred": 0.06}) == ["noise_dominated"]  # the stronger flag alone
    assert _codes({**r, "ci95_pred_high": -1e-9}) == []  # excludes 0: resolved


@pytest.mark.parametrize("prompt, char", [("2+2=\\n", "'\\n' (U+000A)"), ("π+1=", "'π' (U+03C0)")])
def test_a_jsonl_prompt_with_a_character_the_tokenizer_lacks_names_line_and_character(tmp_path, prompt, char):
    """The built-in character tokenizer has no newline or π (its unknown token is its padding: the
    character would vanish): refused naming the file, the record's line and the character; a user
    error (one line, exit 2 at the command line). Prompts it can read pass."""
    from entprobe.checkpoints.builtin import build_char_tokenizer
    from entprobe.cli.user_errors import is_user_error
    from entprobe.tasks.base import check_encodable
    from entprobe.tasks.jsonl import JsonlTask

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "1+2=", "answer": "3"}\n\n{"prompt": "%s", "answer": "4"}\n' % prompt, encoding="utf-8")
    tok = build_char_tokenizer()
    with pytest.raises(Exception) as info:
        check_encodable(JsonlTask(str(f)), tok, f"task.path={f}")
    assert is_user_error(info.value)
    assert str(info.value).startswith(f"{f}:3: the prompt has {char}, which the tokenizer does not have")
    f.write_text('{"prompt": "1+2=", "answer": "3"}\n', encoding="utf-8")
    check_encodable(JsonlTask(str(f)), tok, f"task.path={f}")  # nothing to refuse


def test_an_optimizer_state_of_another_model_is_refused_before_the_model_loads(cwd, monkeypatch, capsys):
    """The committed model's optimizer.pt beside a config.json of a wider model (hidden 32 -> 48): the
    shapes are compared on a meta-device model built from config.json, so the refusal names the first
    bad parameter before any weight loads (load_model would raise here) and leaves no run folder."""
    import json
    import shutil

    import entprobe.cli.probe_job as probe_job

    folder = cwd / "ckpt"
    shutil.copytree(Path(__file__).parent / "data" / "default_model", folder)
    config = json.loads((folder / "config.json").read_text())
    hidden = config["hidden_size"]
    config["hidden_size"] = hidden + 16
    (folder / "config.json").write_text(json.dumps(config))

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model loaded before the optimizer state was checked")

    monkeypatch.setattr(probe_job, "load_model", must_not_load)
    line = refused(monkeypatch, capsys, "model=hf", f"model.path={folder}", f"optimizer.state_path={folder}", *QUIET)
    assert "state shape mismatch at parameter 'model.embed_tokens.weight'" in line, line
    assert f"vs model ({config['vocab_size']}, {hidden + 16})" in line, line
    assert sorted(p.name for p in cwd.iterdir()) == ["ckpt"]  # no outputs/ run folder
