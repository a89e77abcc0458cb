"""The online probe inside TRL's GRPOTrainer on the built-in default model (CPU): how often the
measured change agrees with the prediction, and the callback's cost.

    OMP_NUM_THREADS=1 python benchmarks/online_probe.py --steps 60 --every 1      # agreement, ~5 min
    OMP_NUM_THREADS=1 python benchmarks/online_probe.py --steps 40 --every 10 --overhead

Agreement: each probe's measured change (importance sampling on the held-out E after the real
step) against its prediction (before the step, same E): the fraction of probes whose difference's
95% interval (paired SE) holds 0, and the fraction whose measured value lies inside the
prediction's own 95% interval. Overhead: the same run (same seed) with and without the callback;
the extra wall time as a fraction of the plain run's. Prints both; exits 0 whatever they are.
"""
from __future__ import annotations

import argparse
import math
import re
import tempfile
import time


def trainer_parts(out_dir: str, steps: int, seed: int = 0, lr: float = 1e-3, prompts_per_step: int = 8,
                  G: int = 4, max_new: int = 4) -> dict:
    """What a GRPOTrainer on the built-in default checkpoint and the arithmetic task takes (CPU):
    ``model``, ``tokenizer``, ``reward_fn`` (1 when a completion's first number is the answer),
    ``dataset`` (``prompt`` / ``answer``) and ``grpo_config``."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from entprobe.tasks.arithmetic import ArithmeticTask
    from entprobe.train import ensure_default_checkpoint

    folder = ensure_default_checkpoint()
    task = ArithmeticTask(512, 9, seed=0)

    def reward_fn(prompts, completions, answer, **_):
        return [float(bool(m) and m.group(0) == a) for c, a in zip(completions, answer)
                for m in [re.search(r"-?\d+", c)]]

    return {"model": AutoModelForCausalLM.from_pretrained(folder), "tokenizer": AutoTokenizer.from_pretrained(folder),
            "reward_fn": reward_fn,
            "dataset": Dataset.from_dict({"prompt": [p.text for p in task.prompts],
                                          "answer": [p.answer for p in task.prompts]}),
            "grpo_config": GRPOConfig(
                output_dir=out_dir, per_device_train_batch_size=prompts_per_step * G, num_generations=G,
                max_completion_length=max_new, max_steps=steps, learning_rate=lr, weight_decay=0.01,
                lr_scheduler_type="constant", use_cpu=True, report_to=[], bf16=False, save_strategy="no",
                seed=seed, logging_steps=1, loss_type="dr_grpo", disable_tqdm=True)}


def build_trainer(out_dir: str, steps: int, **kw):
    """The GRPOTrainer of ``trainer_parts``."""
    from trl import GRPOTrainer

    p = trainer_parts(out_dir, steps, **kw)
    return GRPOTrainer(model=p["model"], reward_funcs=p["reward_fn"], args=p["grpo_config"],
                       processing_class=p["tokenizer"], train_dataset=p["dataset"])


def agreement(history: list[dict]) -> tuple[float, float]:
    """(fraction with the difference's 95% interval holding 0, fraction with deltaH_true inside the
    prediction's 95% interval)."""
    n = len(history)
    paired = sum(bool(r["pred_consistent"]) for r in history) / n
    inside = sum(r["ci95_pred_low"] <= r["deltaH_true"] <= r["ci95_pred_high"] for r in history) / n
    return paired, inside


def main() -> None:
    from entprobe.integrations import EntropyProbeCallback

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--B-E", type=int, default=16)
    ap.add_argument("--overhead", action="store_true", help="also time the same run without the callback")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        tr = build_trainer(out, a.steps)
        cb = EntropyProbeCallback(tr, every_n_steps=a.every, batch={"B_E": a.B_E})
        tr.add_callback(cb)
        t0 = time.perf_counter()
        tr.train()
        with_probe = time.perf_counter() - t0
        hist = cb.history
        paired, inside = agreement(hist)
        print(f"{len(hist)} probes over {a.steps} steps (every {a.every}, B_E={a.B_E}, G=4):")
        print(f"  difference's 95% interval holds 0: {paired:.1%} (target 90-99%)")
        print(f"  measured inside the prediction's 95% interval: {inside:.1%}")
        closed = max(abs(r["deltaH1_step"] - r["deltaH_pred"]) / max(abs(r["deltaH_pred"]), 1e-12) for r in hist)
        print(f"  closed-form update vs the real step: max relative gap {closed:.1e}")
        print(f"  probe time {sum(r['time_s'] for r in hist):.1f} s of {with_probe:.1f} s")
        if a.overhead:
            tr = build_trainer(out, a.steps)
            t0 = time.perf_counter()
            tr.train()
            plain = time.perf_counter() - t0
            probe_s = sum(r["time_s"] for r in hist)
            print(f"overhead at every={a.every}: {with_probe:.1f} s vs {plain:.1f} s without: "
                  f"{(with_probe - plain) / plain:+.1%} of the training time by wall clock; the probe's own "
                  f"time {probe_s:.1f} s = {probe_s / plain:.1%} of it (target <= 20%)")
        assert all(math.isfinite(r["deltaH_pred"]) for r in hist)


if __name__ == "__main__":
    main()
