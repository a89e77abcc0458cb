"""What a tied step costs the online probe (``source="rollouts"``) on the built-in default model (CPU):
a batch whose every group is tied (all advantages 0: the gradient is exactly 0) against the same
batch with its own advantages, each probed with ``OnlineProbe`` (``before_step`` + ``after_step``).

    OMP_NUM_THREADS=1 python benchmarks/zero_update_probe.py --reps 5

Three tied cases: AdamW's first step without weight decay (nothing carried, nothing decays: the
update is exactly 0, so no pass runs), the same step with weight decay 0.01 (the decay moves theta:
X only, no Y backward), and AdamW with momentum carried (one real step in; X only). Each probe's
process CPU time (``time.process_time``: one core's work with OMP_NUM_THREADS=1) is timed, the
median over ``--reps`` probes printed with its ratio to the normal probe's. Exits 0 whatever they are.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch

from entprobe.checkpoints.default_checkpoint import policy_loss
from entprobe.config import SamplingConfig
from entprobe.integrations import OnlineProbe
from entprobe.integrations.grpo_trainer import TrainArgs, load_policy, load_task
from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch


def cost(model, tok, opt, batch, reps: int) -> tuple[float, dict]:
    """Median CPU seconds of a probe of ``batch`` (``before_step`` + ``after_step``; the optimizer's step
    is taken on a copy of the state and undone, so every rep probes the same step) and its passes."""
    state = copy.deepcopy(opt.state_dict())
    theta = [p.detach().clone() for p in model.parameters()]
    times, passes = [], {}
    for _ in range(reps):
        opt.zero_grad()
        policy_loss(model, batch, "dr_grpo").backward()
        probe = OnlineProbe(model, opt, tok, None, every=1, source="rollouts")
        c0 = time.process_time()
        probe.before_step(1, rollouts=batch)
        passes = dict(probe._ctx.stats.passes)
        c1 = time.process_time()
        opt.step()
        c2 = time.process_time()
        probe.after_step()
        times.append(time.process_time() - c2 + c1 - c0)
        with torch.no_grad():
            for p, t in zip(model.parameters(), theta):
                p.copy_(t)
        opt.load_state_dict(state)
    return statistics.median(times), passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--G", type=int, default=4)
    a = ap.parse_args()
    model, tok = load_policy(TrainArgs(out=""))
    task = load_task(TrainArgs(out=""))
    batch = sample_batch(model, tok, task, draw_prompt_indices(len(task.prompts), a.B, 3), a.G,
                         SamplingConfig(max_new_tokens=4), 3, "dr_grpo", 1e-6)
    tied = dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))

    def adamw(wd):
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=wd)
    carried = adamw(0.0)  # one real step in: momentum carried
    carried.zero_grad()
    policy_loss(model, batch, "dr_grpo").backward()
    theta = [p.detach().clone() for p in model.parameters()]
    carried.step()
    with torch.no_grad():  # the same theta for every case (the state keeps its momentum)
        for p, t in zip(model.parameters(), theta):
            p.copy_(t)
    normal_s, normal_passes = cost(model, tok, adamw(0.0), batch, a.reps)
    print(f"normal probe (AdamW first step, B={a.B} x G={a.G}): {1e3 * normal_s:.1f} ms CPU, passes {normal_passes}")
    for name, opt in (("tied, AdamW first step, no decay (update exactly 0)", adamw(0.0)),
                      ("tied, AdamW first step, weight decay 0.01 (X only)", adamw(0.01)),
                      ("tied, AdamW with momentum carried (X only)", carried)):
        s, passes = cost(model, tok, opt, tied, a.reps)
        print(f"{name}: {1e3 * s:.2f} ms CPU = {s / normal_s:.1%} of the normal probe, passes {passes}")


if __name__ == "__main__":
    main()
