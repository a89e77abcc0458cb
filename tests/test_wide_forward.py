"""``model.dtype=float64``: forward passes in fp64 throughout (runtime/wide_forward.py), so the
paired test's rounding floor is fp64's and it resolves at an lr where fp32's floor decides it.
The exact model's coverage with and without is in tests/test_paired_rounding.py."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from entprobe.checkpoints.builtin import build_tiny_llama
from entprobe.pipeline.stages.forward_precision import forward_dtype
from entprobe.reporting.verdict import paired_test
from entprobe.runtime.wide_forward import WIDE_SOFTMAX_ATTR, wide_forward_dtype, widen_forward

ROOT = Path(__file__).resolve().parents[1]
EPS_RATIO = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps  # 2^-29
IDS = torch.tensor([[1, 3, 4, 5, 3, 4, 2], [1, 5, 5, 3, 4, 2, 0]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=(IDS != 0).long()).logits


def test_fp32_and_bf16_models_are_left_as_they_are():
    """At fp32 and below transformers' fp32 norm and softmax widen, not narrow: nothing to do, the
    model is not marked and its logits are bitwise the same."""
    m32 = build_tiny_llama(6)
    before = _logits(m32)
    assert widen_forward(m32) is None and wide_forward_dtype(m32) is None
    assert torch.equal(_logits(m32), before)
    assert widen_forward(build_tiny_llama(6).to(torch.bfloat16)) is None


def test_a_float64_model_is_widened_and_other_models_keep_their_numbers():
    """An fp64 Llama: its RMSNorms and eager softmax now run in fp64 (its logits move by fp32
    rounding: the fp32 steps are gone), it is marked float64, and a second call changes nothing.
    The attention function is swapped for the whole modeling module, so an fp32 model and an
    un-widened fp64 model in the same process must keep their numbers bit for bit."""
    m32 = build_tiny_llama(6)
    plain64 = copy.deepcopy(m32).double()
    wide64 = copy.deepcopy(m32).double()
    ref32, ref64 = _logits(m32), _logits(plain64)
    assert widen_forward(wide64) is torch.float64 and wide_forward_dtype(wide64) is torch.float64
    z = _logits(wide64)
    assert torch.equal(_logits(m32), ref32) and torch.equal(_logits(plain64), ref64)
    assert not torch.equal(z, ref64)  # the fp32 steps were there
    # the same function: fp32's logits within fp32 rounding of these magnitudes
    assert float((z - ref32.double()).abs().max()) <= 1e3 * torch.finfo(torch.float32).eps * float(z.abs().max())
    assert widen_forward(wide64) is torch.float64 and torch.equal(_logits(wide64), z)
    assert all(getattr(a.self_attn, WIDE_SOFTMAX_ATTR, False) for a in wide64.model.layers)


def test_an_fp32_step_it_does_not_know_leaves_the_model_unmarked_and_unchanged():
    """A module whose forward upcasts (``.float()``) in code widen_forward does not know: the bound
    must stay fp32's, so the model is not marked, and nothing is patched."""
    class Upcast(torch.nn.Module):
        def forward(self, x):
            return x.float()

    m = build_tiny_llama(6).double()
    m.extra = Upcast()
    assert widen_forward(m) is None and wide_forward_dtype(m) is None
    assert "forward" not in vars(m.model.norm)
    m = build_tiny_llama(6).double()
    m.config._attn_implementation = "flash_attention_2"
    assert widen_forward(m) is None


def test_the_working_precision_is_read_through_wrappers():
    """``forward_dtype``: fp64 for a widened model (under a DDP-style ``.module`` wrapper too), fp32
    for an fp64 model left as transformers builds it, bf16 under bf16 autocast."""
    m = build_tiny_llama(6).double()
    params = list(m.parameters())
    ctx = lambda model, ac=None: SimpleNamespace(model=model, params=params, autocast_dtype=ac)  # noqa: E731
    assert forward_dtype(ctx(m)) is torch.float32
    widen_forward(m)
    wrapper = torch.nn.Module()
    wrapper.module = m
    assert forward_dtype(ctx(m)) is torch.float64 and forward_dtype(ctx(wrapper)) is torch.float64
    assert forward_dtype(ctx(m, torch.bfloat16)) is torch.bfloat16


DOCUMENTED = ("python -m entprobe.main model=hf model.path=tests/data/default_model "
              "batch.load=tests/data/batches/readme optimizer.lr=1e-7 model.dtype={}")


@pytest.fixture(scope="module")
def tiny_lr_runs(tmp_path_factory) -> dict:
    """docs/uncertainty.md's two commands, verbatim (their relative paths resolve through a link to
    tests/): the job at lr 1e-7 on the committed model and batches, in fp64 and in fp32."""
    out = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    for dt in ("float64", "float32"):
        d = tmp_path_factory.mktemp(f"wide_{dt}")
        (d / "tests").symlink_to(ROOT / "tests")
        cmd = DOCUMENTED.format(dt)
        proc = subprocess.run([sys.executable, *cmd.split()[1:]], cwd=d, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (run_dir,) = d.glob("outputs/*/*")
        out[dt] = json.loads((run_dir / "results.json").read_text())
    return out


def test_float64_bounds_rounding_at_fp64s_precision(tiny_lr_runs):
    """The measured change's rounding bound is the same magnitudes times eps(fp64) / eps(fp32)
    (within a factor 2: the two runs' log-probs differ by fp32 rounding)."""
    r32, r64 = tiny_lr_runs["float32"], tiny_lr_runs["float64"]
    assert (r32["forward_dtype"], r64["forward_dtype"]) == ("float32", "float64")
    ratio = r64["rounding_deltaH_true"] / r32["rounding_deltaH_true"]
    assert EPS_RATIO / 2 < ratio < EPS_RATIO * 2, ratio


def test_at_lr_1e7_fp32_sits_below_the_floor_and_float64_resolves(tiny_lr_runs):
    """At lr 1e-7 fp32's rounding bound is above the paired difference's sampling SE (measured 4.0e-7
    against 4.8e-8: the test resolves nothing and says so, pointing to float64); in fp64 the bound is
    ~1e-15 against a sampling SE of ~1e-10, the difference is the step's second order (~lr^2:
    1.7e-11 here, where fp32 read 5.0e-8) and the floor lr is far below this one."""
    r32, r64 = tiny_lr_runs["float32"], tiny_lr_runs["float64"]
    assert r32["rounding_true_minus_pred"] > r32["SE_deltaH_true_minus_pred_sampling"]
    assert "below the rounding floor" in paired_test(r32) and "model.dtype=float64" in paired_test(r32)
    assert r64["rounding_true_minus_pred"] < 1e-3 * r64["SE_deltaH_true_minus_pred_sampling"]
    assert r64["lr_floor_true_minus_pred"] < 1e-2 * 1e-7 < r32["lr_floor_true_minus_pred"]
    assert "rounding floor" not in paired_test(r64)
    assert abs(r64["deltaH_true_minus_pred"]) < 1e-2 * abs(r32["deltaH_true_minus_pred"])
    # the prediction is the same number: fp32's differs by its dots' rounding only
    assert r64["deltaH_pred"] == pytest.approx(r32["deltaH_pred"], rel=1e3 * torch.finfo(torch.float32).eps)
