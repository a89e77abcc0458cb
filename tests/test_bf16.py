"""The probe under bf16 autocast (``model.autocast``), on the CPU: the key, the rounding bound at
bf16's precision in the job and in the online probe, and the verdict's flag when bf16 rounding
leaves the paired test no power (docs/uncertainty.md "Under bf16")."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import DATA, committed_batches, compose_cfg
from entprobe.cli.probe_job import run
from entprobe.reporting.verdict import paired_test, precision_breaks_pairing
from entprobe.rollouts.logprobs import autocast_dtype

ROOT = Path(__file__).resolve().parents[1]
# finfo(bf16).eps / finfo(fp32).eps = 2^-7 / 2^-23: the bound on each forward pass is eps times
# magnitudes the two precisions share to within their rounding
EPS_RATIO = torch.finfo(torch.bfloat16).eps / torch.finfo(torch.float32).eps


def test_model_autocast_resolves_on_every_device():
    """auto keeps what every run did (bf16 on CUDA when autocast_bf16, none on CPU); bf16 / fp16
    apply on the CPU too; off is none, on CUDA as well."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    m = lambda mode, bf16=True: SimpleNamespace(autocast=mode, autocast_bf16=bf16)  # noqa: E731
    assert autocast_dtype(m("auto"), cpu) is None
    assert autocast_dtype(m("auto"), cuda) is torch.bfloat16
    assert autocast_dtype(m("auto", False), cuda) is None
    assert autocast_dtype(m("bf16"), cpu) is torch.bfloat16
    assert autocast_dtype(m("fp16", False), cpu) is torch.float16
    assert autocast_dtype(m("off"), cuda) is None


def test_a_bad_autocast_value_is_one_line_naming_the_key():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run([sys.executable, "-m", "entprobe.main", "model.autocast=bf17", "logging.logger=none"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == ["entprobe: error: model.autocast=bf17: model.autocast takes one of "
                                                "auto, bf16, fp16, off, not 'bf17'; did you mean bf16?"]


@pytest.fixture(scope="module")
def small_lr_runs(tmp_path_factory) -> dict:
    """The job at lr 1e-5 on the committed model and batches, in fp32 and under bf16 autocast."""
    out = {}
    for ac in ("off", "bf16"):
        d = tmp_path_factory.mktemp(f"bf16_{ac}")
        out[ac] = (run(compose_cfg(d, *committed_batches("readme"), "batch.B_E=8", "batch.B_U=8", "optimizer.lr=1e-5", f"model.autocast={ac}",
                                   "logging.report=true")), d)
    return out


def test_the_job_bounds_rounding_at_bf16s_precision(small_lr_runs):
    """Under bf16 the forward passes' bound is bf16's: the same magnitudes times eps(bf16) /
    eps(fp32) = 2^16 (within a factor 2: the two runs' log-probs differ by bf16 rounding)."""
    r32, r16 = small_lr_runs["off"][0], small_lr_runs["bf16"][0]
    assert (r32["autocast"], r32["forward_dtype"]) == ("off", "float32")
    assert (r16["autocast"], r16["forward_dtype"]) == ("bfloat16", "bfloat16")
    ratio = r16["rounding_deltaH_true"] / r32["rounding_deltaH_true"]
    assert EPS_RATIO / 2 < ratio < EPS_RATIO * 2, ratio


def test_bf16_at_a_small_lr_flags_the_pairing_broken_and_fp32_does_not(small_lr_runs):
    """At lr 1e-5 bf16's rounding bound exceeds the paired difference's sampling SE: the flag, its
    line in report.md and the verdict's difference line name bfloat16; fp32 on the same batches
    resolves the difference (its bound is below the sampling SE) and carries no flag."""
    (r32, _), (r16, d16) = small_lr_runs["off"], small_lr_runs["bf16"]
    assert r32["rounding_true_minus_pred"] < r32["SE_deltaH_true_minus_pred_sampling"]
    assert "pairing_broken_by_precision" not in r32["flags"].split(",")
    assert r16["rounding_true_minus_pred"] > r16["SE_deltaH_true_minus_pred_sampling"]
    assert "pairing_broken_by_precision" in r16["flags"].split(",")
    report = (d16 / "report.md").read_text()
    assert "pairing_broken_by_precision" in report and "under bfloat16 the forward passes' rounding bound" in report
    assert "below the bfloat16 rounding floor" in paired_test(r16)
    assert json.loads((d16 / "results.json").read_text())["flags"] == r16["flags"]


def test_the_flag_needs_a_coarser_dtype_and_rounding_above_the_sampling_se():
    r = {"forward_dtype": "bfloat16", "rounding_true_minus_pred": 3e-2, "SE_deltaH_true_minus_pred_sampling": 1e-3,
         "SE_deltaH_true_minus_pred": 3.0017e-2, "SE_deltaH_pred": 1e-3, "lr_floor_true_minus_pred": 5e-5}
    msg = precision_breaks_pairing(r)
    assert msg.startswith("under bfloat16 the forward passes' rounding bound on measured - predicted (0.03) exceeds "
                          "its sampling SE (0.001); SE(diff) / SE(pred) = 30")
    assert "it resolves from lr ~5e-05, or run it in fp32 (model.autocast=off" in msg
    assert precision_breaks_pairing({**r, "forward_dtype": "float32"}) == ""  # the rounding-floor line says it
    assert precision_breaks_pairing({**r, "SE_deltaH_true_minus_pred_sampling": 4e-2}) == ""
    assert precision_breaks_pairing({**r, "measurable": False}) == ""


def test_the_online_probe_bounds_rounding_at_bf16s_precision():
    """The online probe reads model.autocast too, and its measured change's rounding bound is the
    autocast dtype's (it was fp32's whatever the autocast: 2^16 too small under bf16)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from entprobe.integrations import OnlineProbe
    from entprobe.tasks.arithmetic import ArithmeticTask

    res = {}
    for ac in ("off", "bf16"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(DATA / "default_model")
        tok = AutoTokenizer.from_pretrained(DATA / "default_model")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = tok(["12+34=46", "5+6=11"], return_tensors="pt", padding=True).input_ids
        for _ in range(2):
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            if _ == 0:
                opt.step()
        probe = OnlineProbe(model, opt, tok, ArithmeticTask(512, 9, seed=0), every=1, batch={"B_E": 4},
                            **{"model.autocast": ac})  # `model` is the probe's first argument
        assert probe.before_step(2)
        opt.step()
        probe.after_step()
        res[ac] = probe.history[-1]  # every figure (after_step returns the logged ones)
    assert res["off"]["forward_dtype"] == "float32" and res["bf16"]["forward_dtype"] == "bfloat16"
    ratio = res["bf16"]["rounding_deltaH_true"] / res["off"]["rounding_deltaH_true"]
    assert EPS_RATIO / 2 < ratio < EPS_RATIO * 2, ratio


def test_the_documented_benchmark_command_runs_shortened(tmp_path):
    """docs/uncertainty.md's bf16 command, verbatim but for one draw at B = 4 and one lr: it exits
    0, prints both precisions and the summary, and writes its figures as one JSON object."""
    cmd = ".venv/bin/python benchmarks/bench_bf16.py --json /tmp/bench_bf16.json"
    assert cmd in (ROOT / "docs" / "uncertainty.md").read_text()
    out = tmp_path / "bench_bf16.json"
    line = cmd.replace(".venv/bin/python", sys.executable).replace("/tmp/bench_bf16.json", str(out))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(line + " --draws 1 --B 4 --lrs 1e-5", shell=True, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for s in ("    fp32  pred", "    bf16  pred", "bf16 - fp32: pred", "summary over draws"):
        assert s in proc.stdout, (s, proc.stdout[-2000:])
    fig = json.loads(out.read_text())
    assert [s["lr"] for s in fig["summary"]] == [1e-5] and fig["rows"][0]["bf16"]["forward_dtype"] == "bfloat16"
