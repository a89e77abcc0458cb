"""logging.logger: run names from overrides, the csv row, and the combination with logging.wandb.mode
(the wandb run itself: tests/test_sweep.py with a fake wandb module, tests/test_cli.py offline)."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from conftest import compose_cfg
from entprobe.config import ConfigError
from entprobe.reporting.loggers import WANDB_DIRS, CsvLogger, NullLogger, WandbLogger, make_logger, run_name
from entprobe.cli.probe_job import to_typed


def test_run_name_from_the_overrides():
    assert run_name(["optimizer.lr=1e-05", "batch.B_E=8"]) == "lr=1e-05,B_E=8"
    assert run_name(["model=hf", "+task.extra=1", "logging.logger=wandb", "hydra.run.dir=/x",
                     "model.device=cpu"]) == "model=hf,extra=1"
    assert run_name([]) == "default"
    long = run_name([f"batch.k{i}={i}" for i in range(50)])
    assert len(long) == 120 and long.endswith("...")


def test_logger_choice_and_its_combination_with_wandb_mode(tmp_path):
    def logger(*o):
        cfg = to_typed(compose_cfg(tmp_path, *o))
        return make_logger(cfg.logging, tmp_path, {}, True, [], None, cfg)

    assert isinstance(logger("logging.logger=csv"), CsvLogger)
    assert isinstance(logger("logging.logger=none", "logging.wandb.mode=offline"), NullLogger)
    assert isinstance(logger("logging.logger=wandb", "logging.wandb.mode=disabled"), NullLogger)
    with pytest.raises(ConfigError, match="logging.logger: is csv but logging.wandb.mode=online"):
        logger("logging.logger=csv", "logging.wandb.mode=online")
    with pytest.raises(Exception, match="logger"):
        logger("logging.logger=tensorboard")
    cfg = to_typed(compose_cfg(tmp_path, "logging.logger=csv"))
    assert isinstance(make_logger(cfg.logging, tmp_path, {}, False, [], None, cfg), NullLogger)  # rank > 0


def test_csv_logger_writes_one_row_of_scalars(tmp_path):
    CsvLogger(tmp_path).log({"deltaH_pred": -0.5, "flags": "low_ess", "pred_consistent": True, "n": 3,
                             "nan": float("nan"), "nested": {"x": 1}}, {})
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"deltaH_pred": "-0.5", "flags": "low_ess", "n": "3", "nan": "nan", "pred_consistent": "True"}]


WANDB_OFFLINE_RUN = """
import sys
from pathlib import Path
from types import SimpleNamespace
from entprobe.reporting.loggers import WandbLogger
w = SimpleNamespace(mode="offline", project="p", entity=None, name=None, group=None, tags=[], job_type=None)
lg = WandbLogger(w, Path(sys.argv[1]), {"a": 1}, "n", None, [], "two_batch")
lg.log({"deltaH_pred": 0.1, "SE_deltaH_pred": 0.1, "deltaH1": 0.2, "SE_deltaH1": 0.1}, {})
lg.finish(0)
print(lg.folder)
"""


def test_wandb_offline_writes_nothing_outside_the_run_dir(tmp_path):
    """Its staging (the results table), cache and service logs would go to ~/.local/share/wandb and
    ~/.cache/wandb: with HOME a fresh folder, nothing may appear there. wandb prints nothing of its
    own (its banner and summary: the run names the run's folder, ``folder``, in its last lines)."""
    import os
    import subprocess
    import sys

    home, run_dir = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "WANDB_"))}
    env.update(HOME=str(home), PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    res = subprocess.run([sys.executable, "-c", WANDB_OFFLINE_RUN, str(run_dir)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "wandb:" not in res.stdout + res.stderr, res.stdout + res.stderr
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    assert res.stdout == f"{folder}\n"
    assert list(home.rglob("*")) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "run"]  # nor in the working dir
    assert list((run_dir / "wandb").glob("offline-run-*/files/media/table/*.table.json"))
    assert (run_dir / "wandb" / "data").is_dir()  # the table's staging copy


def test_wandb_folders_are_set_for_the_run_only_and_a_users_setting_is_kept(tmp_path, monkeypatch):
    import os
    import sys
    from types import SimpleNamespace

    seen = {}

    def init(**kwargs):
        seen.update({v: os.environ.get(v) for v in WANDB_DIRS})
        return SimpleNamespace(finish=lambda exit_code: None)
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=init))
    for var in WANDB_DIRS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "mine"))
    w = SimpleNamespace(mode="offline", project="p", entity=None, name=None, group=None, tags=[], job_type=None)
    lg = WandbLogger(w, tmp_path / "run", {}, "n", None, [], "two_batch")
    assert seen == {"WANDB_DATA_DIR": str((tmp_path / "run" / "wandb" / "data").resolve()),
                    "WANDB_CACHE_DIR": str(tmp_path / "mine"),
                    "WANDB_ARTIFACT_DIR": str((tmp_path / "run" / "wandb" / "artifacts").resolve())}
    lg.finish(0)
    assert {v: os.environ.get(v) for v in WANDB_DIRS} == {"WANDB_DATA_DIR": None, "WANDB_ARTIFACT_DIR": None,
                                                          "WANDB_CACHE_DIR": str(tmp_path / "mine")}
