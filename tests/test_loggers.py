"""logging.logger: run names from overrides, the csv row, and the combination with logging.wandb.mode
(the wandb run itself: tests/test_sweep.py with a fake wandb module, tests/test_cli.py offline)."""
from __future__ import annotations

import csv

import pytest

from conftest import compose_cfg
from entprobe.config import ConfigError
from entprobe.reporting.loggers import CsvLogger, NullLogger, make_logger, run_name
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
