"""Per-rank peak memory of the probe under ``ddp.strategy=fsdp2`` on 1, 2 and 4 CPU ranks (gloo).

A random SmolLM2-135M-shaped checkpoint (``random_checkpoint.py``) gets an AdamW state from one
step on a random gradient (``optimizer.pt``, one param group in model order); one one-process run
samples and saves E and U; then the probe runs on them under fsdp2 at each world size. Each rank
reports, once the model is loaded and sharded and the optimizer state is read and sharded:
- ``sharded MiB``: the bytes of this rank's shards of the parameters and the AdamW moments
  (falls as 1/world by construction: the check that sharding happened);
- ``probe peak MiB``: the largest resident set of the probe itself (``VmHWM`` reset through
  ``/proc/self/clear_refs`` when the probe starts): the sharded buffers, gradients, snapshot and
  step, plus what does not shard (the activations of a microbatch, the all-gathered layer, the
  process's fixed overhead: torch, transformers, the gloo group).
- ``at start MiB``: the resident set when the probe starts (what loading left behind).

Loading reads the full checkpoint on every rank before keeping its shard, so the process's own
high-water mark (``ru_maxrss``) does not fall with the world size; the probe's does.

    OMP_NUM_THREADS=1 python benchmarks/bench_fsdp_memory.py                  # ~10 min on 2 CPU cores
    python benchmarks/bench_fsdp_memory.py --worlds 1 2 --ckpt /tmp/smol_fsdp

Exits 0 whatever the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import compose, proc_kb, reexec_with_bench_env  # noqa: E402

PROBE = ["task._target_=random_checkpoint.LetterFractionTask", "batch.B_E=4", "batch.B_U=4", "batch.G=2",
         "sampling.max_new_tokens=8", "probe.mb_size_prompts=1", "probe.projection=backward",
         "importance.resample_on_low_ess=false", "logging.wandb.mode=disabled", "logging.progress=false",
         "logging.verdict=false", "logging.report=false", "model.device=cpu"]


def build_checkpoint(ckpt: Path) -> None:
    """The random SmolLM2-shaped checkpoint and an AdamW state from one step on a random gradient."""
    import torch
    from transformers import AutoModelForCausalLM

    if not (ckpt / "config.json").is_file():
        subprocess.run([sys.executable, str(HERE / "random_checkpoint.py"), str(ckpt)], check=True)
    if (ckpt / "optimizer.pt").is_file():
        return
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt.step()
    torch.save(opt.state_dict(), ckpt / "optimizer.pt")


def worker(args) -> None:
    """One rank: the probe on the saved batches, memory recorded around it."""
    import torch

    import entprobe.main as M
    from entprobe.runtime.sharding import local

    torch.set_num_threads(1)
    seen: dict = {}
    real_geometry, real_batches = M.build_geometry, M.get_batches

    def geometry(cfg, lm, params, buf_dev, stored):
        geo, meta = real_geometry(cfg, lm, params, buf_dev, stored)
        state = [v for p in params for v in geo.optimizer.state[p].values() if isinstance(v, torch.Tensor)]
        seen["sharded_mib"] = sum(local(t).numel() * t.element_size() for t in [*params, *state]) / 2**20
        return geo, meta

    def batches(*a, **kw):  # the probe starts here: the model and the state are loaded and sharded
        import gc
        gc.collect()
        seen["start_mib"] = proc_kb("VmRSS") / 1024
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        return real_batches(*a, **kw)

    M.build_geometry, M.get_batches = geometry, batches
    res = M.run(compose(args.overrides + [f"run_dir={args.run_dir}"]))
    seen["probe_peak_mib"] = proc_kb("VmHWM") / 1024
    seen.update(rank=int(os.environ.get("RANK", 0)), world=res["world_size"], deltaH1=res["deltaH1"],
                SE_deltaH1=res["SE_deltaH1"], deltaH_true=res["deltaH_true"])
    Path(args.out).with_suffix(f".rank{seen['rank']}.json").write_text(json.dumps(seen))
    from entprobe.runtime import distributed as D
    D.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default="/tmp/entprobe_fsdp_bench/ckpt")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    reexec_with_bench_env()
    ckpt = Path(args.ckpt)
    work = ckpt.parent
    build_checkpoint(ckpt)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    common = [*PROBE, "model=hf", f"model.path={ckpt}", f"optimizer.state_path={ckpt}"]
    saved = work / "batches"
    if not (saved / "U.pt").is_file():
        subprocess.run([sys.executable, "-m", "entprobe.main", *common, f"batch.save={saved}",
                        "importance.enabled=false", "probe.variance_enabled=false",
                        f"hydra.run.dir={work / 'sample_run'}"], env=env, check=True)
    rows = []
    for w in args.worlds:
        out = work / f"world{w}"
        launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(w)]
                                     if w > 1 else [])
        cmd = [*launch, str(HERE / "bench_fsdp_memory.py"), "--worker", "--out", str(out),
               "--run-dir", str(work / f"run{w}"), "--", *common, "ddp.strategy=fsdp2", f"batch.load={saved}"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"world {w}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}")
            continue
        rows += [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(w)]
    print("| world | rank | sharded MiB (params + AdamW state) | at start MiB | probe peak MiB | "
          "probe peak - start MiB | deltaH1 | SE_deltaH1 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world']} | {r['rank']} | {r['sharded_mib']:.0f} | {r['start_mib']:.0f} | "
              f"{r['probe_peak_mib']:.0f} | {r['probe_peak_mib'] - r['start_mib']:.0f} | {r['deltaH1']:.6g} | "
              f"{r['SE_deltaH1']:.6g} |")
    base = [r for r in rows if r["world"] == 1]
    for w in sorted({r["world"] for r in rows} - {1}):
        if base:
            ws = [r for r in rows if r["world"] == w]
            sh = max(r["sharded_mib"] for r in ws) / base[0]["sharded_mib"]
            pk = max(r["probe_peak_mib"] for r in ws) / base[0]["probe_peak_mib"]
            grow = max(r["probe_peak_mib"] - r["start_mib"] for r in ws) / (
                base[0]["probe_peak_mib"] - base[0]["start_mib"])
            print(f"world {w}: sharded part x{sh:.3f} of one rank's (1/world = {1 / w:.3f}); "
                  f"probe peak x{pk:.3f}, its growth over the start x{grow:.3f}")


if __name__ == "__main__":
    main()
