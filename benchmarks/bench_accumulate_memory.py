"""Peak memory of the Stage 1 accumulation (Y over U, then X over E) versus the batch size.

Peak memory is one microbatch plus a fixed number of parameter-sized buffers, so at
fixed ``mb_size_prompts`` it must not grow with B_E = B_U = B. Each (model, B) runs in a fresh
subprocess that loads the model and two saved batches, takes its baseline, runs both
accumulations and reports the peak increase over the baseline:

- CPU: the kernel's high-water mark ``VmHWM`` (reset to the current RSS at the baseline by
  writing 5 to ``/proc/self/clear_refs``), minus ``VmRSS`` at the baseline; the children run with
  ``MALLOC_MMAP_THRESHOLD_=131072`` (unless set) so that RSS tracks live tensors;
- CUDA: ``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` at the baseline.

Models: ``default`` is the built-in checkpoint (real sampled arithmetic batches; parameters and
activations are both tiny, so the figure is mostly autograd's fixed overhead); ``big`` is a
random tiny Llama (hidden 256, 4 layers, 128-token sequences) on synthetic batches, where one
microbatch's activations outweigh the parameter buffers, so a leak across microbatches would show.
The control rows repeat ``big`` with ``mb_size_prompts = B`` (no microbatching): memory then grows
with B, which shows the measurement can see growth. Every batch is padded to the same width T.

    OMP_NUM_THREADS=1 python benchmarks/bench_accumulate_memory.py              # default + big + control
    python benchmarks/bench_accumulate_memory.py --models default --Bs 4 8 16 32 --mb 2

Exit status 1 when a fixed-mb series is not flat (any ratio to B=4 outside 1 +- 0.10).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import proc_kb
from entprobe.math import paramvec as pv
from entprobe.rollouts.sampling import RolloutBatch, group_advantages

BIG = dict(hidden=256, layers=4, heads=4, max_positions=256)
BIG_PROMPT, BIG_RESPONSE = 16, 112  # tokens: T = 128


# ---------------------------------------------------------------- batches (built in the parent)
def pad_to(batch: RolloutBatch, T: int) -> RolloutBatch:
    """Right-pad every [B, G, T] tensor to width T (padding is masked out: S is unchanged)."""
    extra = T - batch.input_ids.shape[-1]
    if extra <= 0:
        return batch
    pad = lambda t: torch.nn.functional.pad(t, (0, extra))  # noqa: E731
    return RolloutBatch(pad(batch.input_ids), pad(batch.attention_mask), pad(batch.response_mask),
                        pad(batch.sampler_logprobs), batch.rewards, batch.advantages, batch.prompt_index,
                        batch.temperature)


def synthetic_batch(B: int, G: int, vocab: int, seed: int) -> RolloutBatch:
    """Random prompts and responses; response lengths in [R/2, R], the first of each group of length R."""
    gen = torch.Generator().manual_seed(seed)
    P, R = BIG_PROMPT, BIG_RESPONSE
    ids = torch.randint(3, vocab, (B, G, P + R), generator=gen)
    ids[..., 0] = 1  # BOS
    lengths = torch.randint(R // 2, R + 1, (B, G), generator=gen)
    lengths[:, 0] = R
    col = torch.arange(P + R)
    resp = ((col >= P) & (col < P + lengths.unsqueeze(-1))).long()
    att = (col < P + lengths.unsqueeze(-1)).long()
    ids = torch.where(att.bool(), ids, 0)
    rewards = torch.randint(0, 2, (B, G), generator=gen).float()
    return RolloutBatch(ids, att, resp, torch.zeros(B, G, P + R), rewards,
                        group_advantages(rewards, "dr_grpo"), torch.arange(B))


def default_batches(Bs: list[int], G: int, folder: Path) -> None:
    """Sampled E and U batches from the built-in checkpoint (built and cached on first use)."""
    from entprobe.config import ModelConfig, SamplingConfig
    from entprobe.checkpoints.models import load_model
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch
    from entprobe.tasks.arithmetic import ArithmeticTask

    lm = load_model(ModelConfig(device="cpu"))
    task = ArithmeticTask()
    sampling = SamplingConfig()
    batches = {}
    for B in Bs:
        for label, seed in (("E", 1), ("U", 2)):
            idx = draw_prompt_indices(len(task.prompts), B, seed)
            batches[(B, label)] = sample_batch(lm.model, lm.tokenizer, task, idx, G, sampling, seed, "dr_grpo",
                                               1e-6, "never")
    T = max(b.input_ids.shape[-1] for b in batches.values())
    for (B, label), b in batches.items():
        pad_to(b, T).save(folder / f"default_B{B}_{label}.pt")


# ---------------------------------------------------------------- measurement (in the child)
def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child(model_name: str, B: int, mb: int, folder: Path) -> dict:
    from entprobe.pipeline.stages.accumulate import accumulate, x_loss_of, y_loss_of
    from entprobe.pipeline.stages.context import ProbeContext

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if model_name == "default":
        from entprobe.config import ModelConfig
        from entprobe.checkpoints.models import load_model
        model = load_model(ModelConfig(device=str(device))).model
    else:
        from entprobe.checkpoints.builtin import build_char_tokenizer, build_tiny_llama
        model = build_tiny_llama(len(build_char_tokenizer()), seed=0, **BIG).to(device)
        model.train()
    E = RolloutBatch.load(folder / f"{model_name}_B{B}_E.pt")
    U = RolloutBatch.load(folder / f"{model_name}_B{B}_U.pt")
    names, params = pv.trainable(model)
    autocast = torch.bfloat16 if device.type == "cuda" else None  # as the probe runs on CUDA
    ctx = ProbeContext(model, names, params, device, autocast, 1.0, "dr_grpo", mb, torch.device("cpu"),
                       torch.float32)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base_kb = proc_kb("VmRSS")
        exact = _reset_hwm()
    t0 = time.perf_counter()
    accY = accumulate(ctx, U, y_loss_of(ctx), "Y over U")
    accX = accumulate(ctx, E, x_loss_of(ctx), "X over E", with_entropy=True)
    seconds = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak_mib, how = (torch.cuda.max_memory_allocated() - base) / 2**20, "cuda max_memory_allocated"
    elif exact:
        peak_mib, how = (proc_kb("VmHWM") - base_kb) / 1024, "VmHWM - VmRSS (clear_refs)"
    else:  # no resettable high-water mark: ru_maxrss since process start
        import resource
        peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kb) / 1024
        how = "ru_maxrss - VmRSS"
    n = sum(p.numel() for p in params)
    assert accX.B == accY.B == B
    return {"model": model_name, "B": B, "mb": mb, "T": E.input_ids.shape[-1], "peak_mib": peak_mib,
            "param_buffers_mib": 3 * n * 4 / 2**20,  # sum_X, sum_Y (fp32) + .grad (fp32 model)
            "n_params": n, "seconds": seconds, "device": device.type, "how": how}


# ---------------------------------------------------------------- driver
def run_child(model: str, B: int, mb: int, folder: Path) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # a fixed glibc mmap threshold returns freed blocks to the OS at once, so RSS follows live
    # tensors instead of the allocator's heap (the default dynamic threshold adds +-10% noise)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    out = subprocess.run([sys.executable, __file__, "--child", model, str(B), str(mb), str(folder)],
                         env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(title: str, rows: list[dict]) -> float:
    """Print a series and return its largest |ratio - 1| against the first (smallest) B."""
    ref = rows[0]["peak_mib"]
    print(f"\n{title}  (device {rows[0]['device']}, {rows[0]['how']}; {rows[0]['n_params']:,} params, "
          f"3 param-sized fp32 tensors = {rows[0]['param_buffers_mib']:.1f} MiB)")
    print(f"{'B':>4} {'mb':>4} {'T':>4} {'peak MiB':>10} {'ratio':>7} {'seconds':>8}")
    worst = 0.0
    for r in rows:
        ratio = r["peak_mib"] / ref
        worst = max(worst, abs(ratio - 1))
        print(f"{r['B']:>4} {r['mb']:>4} {r['T']:>4} {r['peak_mib']:>10.1f} {ratio:>7.3f} {r['seconds']:>8.2f}")
    return worst


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, model, B, mb, folder = sys.argv
        print(json.dumps(child(model, int(B), int(mb), Path(folder))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["default", "big"], choices=["default", "big"])
    ap.add_argument("--Bs", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--mb", type=int, default=2, help="mb_size_prompts (fixed across B)")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--no-control", action="store_true", help="skip the mb_size_prompts = B rows")
    a = ap.parse_args()
    flat_ok = True
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if "default" in a.models:
            default_batches(a.Bs, a.G, folder)
        if "big" in a.models:
            from entprobe.checkpoints.builtin import build_char_tokenizer
            vocab = len(build_char_tokenizer())
            for B in a.Bs:
                synthetic_batch(B, a.G, vocab, seed=1).save(folder / f"big_B{B}_E.pt")
                synthetic_batch(B, a.G, vocab, seed=2).save(folder / f"big_B{B}_U.pt")
        for model in a.models:
            rows = [run_child(model, B, a.mb, folder) for B in a.Bs]
            worst = report(f"[{model}] Stage 1 accumulation, mb_size_prompts={a.mb}, G={a.G}", rows)
            flat_ok &= worst <= 0.10
            print(f"max |ratio - 1| = {worst:.3f}: {'FLAT' if worst <= 0.10 else 'NOT FLAT'} (limit 0.10)")
        if "big" in a.models and not a.no_control:
            rows = [run_child("big", B, B, folder) for B in a.Bs]
            report(f"[big, control] no microbatching: mb_size_prompts = B, G={a.G}", rows)
            print("(expected to grow with B: the check above can fail)")
    return 0 if flat_ok else 1


if __name__ == "__main__":
    sys.exit(main())
