"""Inputs that used to give silently wrong numbers now stop early with a message that names the key
or the file (and line) and says what to change."""
from __future__ import annotations

import pytest

from conftest import compose_cfg
from entprobe.config import ConfigError
from entprobe.pipeline.config_checks import validate
from entprobe.cli.probe_job import run
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.tasks.jsonl import JsonlTask


@pytest.mark.parametrize("override, key", [
    ("optimizer.betas=[1.0,0.999]", "optimizer.betas"),
    ("optimizer.betas=[0.9,-0.1]", "optimizer.betas"),
    ("optimizer.eps=-1", "optimizer.eps"),
    ("optimizer.eps=0", "optimizer.eps"),
    ("optimizer.step=0", "optimizer.step"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay"),
])
def test_optimizer_ranges_fail_before_anything_loads(tmp_path, override, key):
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        validate(compose_cfg(tmp_path, override))


@pytest.mark.parametrize("line, says", [
    ('{"prompt": "1+1=", "answer": null}', "'answer' is None"),
    ('{"prompt": "1+1=", "answer": true}', "'answer' is True"),
    ('{"prompt": "1+1=", "answer": ""}', "'answer' is ''"),
    ('{"prompt": "", "answer": 2}', "'prompt' must be a non-empty string"),
    ('{"prompt": "1+1=", "answer": 2', "not a JSON record"),
    ('[1, 2]', "needs 'prompt' and 'answer'"),
])
def test_jsonl_records_are_checked_with_file_and_line(tmp_path, line, says):
    f = tmp_path / "data.jsonl"
    f.write_text('{"prompt": "2+2=", "answer": 4}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"data\.jsonl:3: .*{__import__('re').escape(says)}"):
        JsonlTask(str(f))
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "2+2=", "answer": 4}\n{"prompt": "3+3=", "answer": "6"}\n')
    assert [p.answer for p in JsonlTask(str(ok)).prompts] == ["4", "6"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    run(compose_cfg(folder / "run", f"batch.save='{folder / 'b'}'", "importance.enabled=false"))
    return folder / "b"


@pytest.mark.parametrize("override, says", [
    ("sampling.temperature=0.5", "sampled at temperature 1.0, the config says sampling.temperature=0.5"),
    ("batch.B_E=6", "the saved E has 4 prompts, the config batch.B_E=6"),
    ("batch.B_U=3", "the saved U has 4 prompts, the config batch.B_U=3"),
    ("batch.G=3", "the saved E has G=4 responses per prompt, the config batch.G=3"),
])
def test_saved_batches_must_match_the_config(tmp_path, saved, override, says):
    with pytest.raises(ConfigError, match=__import__("re").escape(says)):
        run(compose_cfg(tmp_path, f"batch.load='{saved}'", override, "importance.enabled=false"))
    assert RolloutBatch.load(saved / "E.pt").B == 4  # the files themselves are untouched
