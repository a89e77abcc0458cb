"""A run dir holds one run: an earlier run's outputs are moved into ``previous-<time>/``, a failed run
leaves ``FAILED`` (and no results file), and a non-finite headline is flagged and warned about."""
from __future__ import annotations

import json
import math

import pytest

import entprobe.pipeline.in_memory as core
from conftest import compose_cfg
from entprobe.config import ConfigError
from entprobe.cli.probe_job import run
from entprobe.runtime.rundir import set_aside_earlier_run
from entprobe.reporting.verdict import flags

QUICK = ("importance.enabled=false", "probe.variance_enabled=false")


def test_a_rerun_moves_the_earlier_outputs_aside_and_a_failed_rerun_is_marked(tmp_path):
    first = run(compose_cfg(tmp_path, *QUICK))
    old = (tmp_path / "results.json").read_text()
    (tmp_path / "notes.txt").write_text("mine")  # not entprobe's: stays where it is
    with pytest.raises(ConfigError, match="batch.load"):
        run(compose_cfg(tmp_path, f"batch.load='{tmp_path / 'nope'}'", *QUICK))
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("previous-")]
    assert len(aside) == 1
    assert (aside[0] / "results.json").read_text() == old and (aside[0] / "attribution.csv").is_file()
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "attribution.csv").exists()
    failed = (tmp_path / "FAILED").read_text()
    assert "ConfigError: batch.load=" in failed and "Traceback" in failed
    assert (tmp_path / "notes.txt").read_text() == "mine"

    second = run(compose_cfg(tmp_path, *QUICK))  # the failed run's marker goes aside too
    assert second["deltaH1"] == first["deltaH1"]
    assert not (tmp_path / "FAILED").exists() and (tmp_path / "results.json").is_file()
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("previous-")]) == 2


def test_nothing_to_move_in_a_fresh_dir(tmp_path):
    assert set_aside_earlier_run(tmp_path / "new", "results.json") is None
    (tmp_path / "other.csv").write_text("x")
    assert set_aside_earlier_run(tmp_path, "results.json") is None


def test_every_non_finite_headline_value_is_flagged():
    ok = {"deltaH_pred": 0.1, "SE_deltaH_pred": 0.01, "deltaH1": 0.2, "SE_deltaH1": 0.02}
    assert "non_finite" not in [c for c, _ in flags(ok)]
    for key in ok:
        fl = dict(flags({**ok, key: math.nan}))
        assert key in fl["non_finite"], key


def test_a_non_finite_headline_is_warned_about_and_flagged_in_the_results(tmp_path, monkeypatch):
    def nan_probe(*args, **kwargs):
        return {"deltaH_pred": math.nan, "SE_deltaH_pred": 0.1, "deltaH1": 0.2, "SE_deltaH1": 0.1}
    monkeypatch.setattr(core, "run_two_batch", nan_probe)
    with pytest.warns(UserWarning, match="deltaH_pred is not finite"):
        res = run(compose_cfg(tmp_path, *QUICK))
    assert "non_finite" in res["flags"].split(",")
    assert "non_finite" in json.loads((tmp_path / "results.json").read_text())["flags"]
