"""What a person meets after a mistake on the command line: one line ``entprobe: error: ...`` naming
the override and what to write, exit status 2, and no run folder, at every entry point that takes
Hydra overrides (``python -m entprobe.main`` single and ``-m``, the ``entprobe`` console script,
``python -m entprobe.probe_run``); the traceback only with ``HYDRA_FULL_ERROR=1``.

The check runs before Hydra starts (cli/command_line.py), so most of it is tested in process
(``main()`` with the command line in ``sys.argv``, a fraction of a second each); three subprocesses
run it as a user does: the module, the console script, and a file refused after Hydra made the run
dir (the run dir removed, wandb never started).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

import entprobe.main as entry
from conftest import QUIET_CLI
from entprobe.cli import probe_run
from entprobe.cli.user_errors import exits_on_user_error
from entprobe.config import ConfigError
from entprobe.pipeline.api import compose_config
from entprobe.pipeline.config_errors import did_you_mean
from entprobe.tasks.jsonl import JsonlTask

HELP = "python -m entprobe.main --help lists every key"
# the four mistakes of a command line and the one line each gives
MISTAKES = {
    "batch.BE=16": f"batch.BE=16: batch has no key BE (did you mean batch.B_E?); {HELP}",
    "+batch.BE=16": f"+batch.BE=16: batch has no key BE (did you mean batch.B_E?), and '+' cannot add one to "
                    f"entprobe's typed config; {HELP}",
    "objective=trll": "objective=trll: objective has no option 'trll'; choose one of entprobe, trl, verl "
                      "(did you mean objective=trl?)",
    "sampling.temperature=hot": "sampling.temperature=hot: sampling.temperature takes a number, not 'hot'",
}
QUIET = QUIET_CLI


def main_exits(monkeypatch, *argv: str) -> int:
    """``python -m entprobe.main argv`` in process; the exit status (it must exit)."""
    monkeypatch.setattr(sys, "argv", ["entprobe", *argv])
    with pytest.raises(SystemExit) as info:
        entry.main()
    return info.value.code


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "multirun"])
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_is_one_line_exit_2_and_leaves_no_folder(cwd, monkeypatch, capsys, mistake, multirun):
    """The unknown key, ``+key`` on the schema, the unknown group option and the wrong type, in a
    single run and in a sweep (checked job by job: the schema merge's error names the job)."""
    argv = ["-m", mistake, "batch.seed_E=0,1"] if multirun else [mistake]
    assert main_exits(monkeypatch, *argv, *QUIET) == 2
    want = MISTAKES[mistake]
    if multirun and mistake.startswith("+"):
        want = f"job {mistake} batch.seed_E=0 logging.logger=none logging.progress=False: {want}"
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"entprobe: error: {want}"] and out == ""
    assert list(cwd.iterdir()) == []  # no outputs/ or multirun/ folder


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_probe_run_refuses_each_mistake_in_one_line_before_any_checkpoint(cwd, capsys, mistake):
    run = cwd / "grpo"
    (run / "checkpoint-1").mkdir(parents=True)
    with pytest.raises(SystemExit) as info:
        probe_run.main([str(run), mistake, "--out", str(cwd / "out")])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"entprobe: error: {MISTAKES[mistake]}"]
    assert sorted(p.name for p in cwd.iterdir()) == ["grpo"]


@pytest.mark.parametrize("argv, line", [
    (["batch.B_E=4,8"], "batch.B_E=4,8: a value with commas is a sweep: add -m to run one job per value "
                        "(python -m entprobe.main -m batch.B_E=4,8), or write a list as batch.B_E=[4,8]"),
    (["batch.B_E=[1"], "batch.B_E=[1: not an override Hydra reads (no viable alternative at input '[1'); write "
                       "key=value, a list as key=[a,b], and quote a value that holds spaces, brackets or commas: "
                       "key='a, b'"),
    (["lr=1e-5"], f"lr=1e-5: the config has no key or group lr (did you mean optimizer.lr?); {HELP}"),
    (["probe.mode=bogus"], "probe.mode=bogus: probe.mode takes one of two_batch, single_batch, not 'bogus'"),
    (["batch.B_E=null"], "batch.B_E=null: batch.B_E takes an integer, not null"),
    (["probe.what_if.lr_factors=[a]"], "probe.what_if.lr_factors=[a]: probe.what_if.lr_factors takes a list of "
                                       "numbers, e.g. [0.5,2], not 'a'"),
    (["+objective=trl"], "+objective=trl: objective has an option already; choose with objective=trl (no '+')"),
    (["~batch.B_E"], "~batch.B_E: a key of entprobe's typed config cannot be deleted; set its value instead "
                     "(batch.B_E=<value>)"),
    (["model=hf"], "model.path: is required with model=hf: the save_pretrained checkpoint folder"),
    (["--cfg", "job", "batch.BE=3"], f"batch.BE=3: batch has no key BE (did you mean batch.B_E?); {HELP}"),
], ids=["sweep_without_m", "syntax", "top_level_key", "enum", "null", "list_item", "plus_group", "delete",
        "range_check", "cfg"])
def test_other_mistakes_are_one_line_too(cwd, monkeypatch, capsys, argv, line):
    assert main_exits(monkeypatch, *argv) == 2
    assert capsys.readouterr().err.splitlines() == [f"entprobe: error: {line}"]
    assert list(cwd.iterdir()) == []


def test_full_error_raises_with_hydras_exception_as_the_cause(cwd, monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setattr(sys, "argv", ["entprobe", "batch.BE=16"])
    with pytest.raises(ConfigError, match="did you mean batch.B_E") as info:
        entry.main()
    assert isinstance(info.value.__cause__, ConfigCompositionException)


def test_nearest_keys_and_free_mappings():
    """The suggestion: a key of the same node with a like name, else one of that name anywhere, else
    the nearest dotted name; a free mapping (task.chat_template_kwargs) takes '+' for a new key."""
    assert [did_you_mean(k) for k in ("batch.b_e", "batch.temperature", "objectiv", "probe.whatif.lr_factors",
                                      "hydra.run.dirr", "zzz")] == \
        ["batch.B_E", "sampling.temperature", "objective", "probe.what_if.lr_factors", "hydra.run.dir", None]
    with pytest.raises(ConfigError) as info:
        compose_config(["task.chat_template_kwargs.enable_thinking=false"])
    assert str(info.value) == ("task.chat_template_kwargs.enable_thinking=false: task.chat_template_kwargs has no "
                               "key enable_thinking yet; add it with +task.chat_template_kwargs.enable_thinking=<value>")
    assert compose_config(["+task.chat_template_kwargs.enable_thinking=false"]).task.chat_template_kwargs == \
        {"enable_thinking": False}


def test_a_jsonl_record_error_is_one_line_naming_file_and_line(tmp_path, capsys, monkeypatch):
    """The JSONL task's record errors are user errors (TaskFileError): one line, exit 2."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    f = tmp_path / "d.jsonl"
    for text, says in (('{"prompt": "1+1=", "answer": null}\n', "d.jsonl:1: 'answer' is None"),
                       ('{"prompt": 1+\n', "d.jsonl:1: not a JSON record"),
                       ('[1, 2]\n', "d.jsonl:1: each record needs 'prompt' and 'answer'"),
                       ('{"prompt": [], "answer": 1}\n', "d.jsonl:1: 'prompt' must be a non-empty string or a list")):
        f.write_text(text)
        with pytest.raises(SystemExit) as info, exits_on_user_error():
            JsonlTask(str(f))
        err = capsys.readouterr().err.splitlines()
        assert info.value.code == 2 and len(err) == 1 and err[0].startswith("entprobe: error: ") and says in err[0]


# ----------------------------------------------------------------------------- as a user runs it
def _run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    for var in ("HYDRA_FULL_ERROR", "WANDB_SILENT", "WANDB_QUIET"):
        env.pop(var, None)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_module_prints_one_line_and_makes_no_folder(tmp_path):
    proc = _run([sys.executable, "-m", "entprobe.main", "batch.BE=16"], tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"entprobe: error: {MISTAKES['batch.BE=16']}\n")
    assert list(tmp_path.iterdir()) == []


def test_the_console_script_prints_one_line_for_a_sweep(tmp_path):
    script = Path(sys.executable).parent / "entprobe"
    if not script.is_file():
        pytest.skip("no entprobe console script beside this python (pip install -e . makes it)")
    proc = _run([str(script), "-m", "objective=trll,trl"], tmp_path)
    assert (proc.returncode, proc.stderr) == (2, f"entprobe: error: {MISTAKES['objective=trll']}\n")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_model_folder_is_refused_before_wandb_and_leaves_no_run_folder(tmp_path):
    """A file error comes after Hydra made the run dir (the config was fine): the run dir it made
    is removed (outputs/ too, which it made), and wandb, which starts after the checks, printed nothing."""
    proc = _run([sys.executable, "-m", "entprobe.main", "model=hf", f"model.path={tmp_path / 'nope'}",
                 "logging.logger=wandb", "logging.wandb.mode=offline"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [f"entprobe: error: model.path='{tmp_path / 'nope'}' must be a save_pretrained "
                                        "folder (config.json + weights) or a PEFT adapter folder "
                                        "(adapter_config.json); nothing is downloaded"]
    assert "wandb" not in proc.stdout
    assert list(tmp_path.iterdir()) == []
