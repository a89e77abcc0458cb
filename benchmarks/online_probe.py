"""The online probe inside TRL's GRPOTrainer on the built-in default model (CPU): how often the
measured change agrees with the prediction, and the callback's cost.

    OMP_NUM_THREADS=1 python benchmarks/online_probe.py --steps 60 --every 1                     # agreement
    OMP_NUM_THREADS=1 python benchmarks/online_probe.py --steps 50 --every 10 --B-E 8 --overhead  # and cost
    OMP_NUM_THREADS=1 python benchmarks/online_probe.py --steps 50 --every 10 --source rollouts --overhead

``--calls`` adds where the CPU time goes, call by call (``call_times``): the probe's backward passes and
forwards, the trainer's backward passes and its generation.

``--source rollouts`` predicts from the step's own batch (no generation; ``--measure`` adds a fresh E of
``--B-E`` prompts to measure on, which the agreement figures need: without it they are not printed).

Agreement: each probe's measured change (importance sampling on the held-out E after the real
step) against its prediction (before the step, same E): the fraction of probes whose difference's
95% interval (paired SE) holds 0, and the fraction whose measured value lies inside the
prediction's own 95% interval.

Overhead (``--overhead``): after that first run (which also pays the process's one-time costs:
imports, the first probe), ``--pairs`` pairs of the same run (same seed) with and without the
callback, interleaved (with/without, then without/with, ...) so that a drift in the machine's
load hits both sides. Each run's ``trainer.train()`` is timed by wall clock and by process CPU
time (``time.process_time``: with ``OMP_NUM_THREADS=1`` one core's work, insensitive to other jobs
waiting for the core). Reported: the medians, the extra time as a fraction of the plain run's by
either clock, the probe's own time (``callback.history``'s ``time_s`` / ``cpu_time_s``) as a
fraction of the plain run's, and the probe's time per probe by phase (medians over the timed
runs' probes). Prints them; exits 0 whatever they are.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

from grpo_setup import build_trainer  # noqa: E402  (the benchmarks' folder is on sys.path)


def agreement(history: list[dict]) -> tuple[float, float]:
    """(fraction with the difference's 95% interval holding 0, fraction with deltaH_true inside the
    prediction's 95% interval)."""
    n = len(history)
    paired = sum(bool(r["pred_consistent"]) for r in history) / n
    inside = sum(r["ci95_pred_low"] <= r["deltaH_true"] <= r["ci95_pred_high"] for r in history) / n
    return paired, inside


def step_clock():
    """A TrainerCallback recording each optimizer step's wall and CPU seconds (``on_step_begin`` to
    ``on_step_end``: generation, forward/backward, the probe when it runs, the optimizer step)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps: list[tuple[int, float, float]] = []  # (step, wall s, CPU s)

        def on_step_begin(self, args, state, control, **kwargs):
            self._t = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append((state.global_step, time.perf_counter() - self._t[0], time.process_time() - self._t[1]))
    return StepClock()


def process_peak_mib(device: str) -> float:
    """The process's peak memory so far, MiB: CPU ``VmHWM`` (resident set), CUDA the allocator's maximum."""
    import torch

    if device != "cpu":
        return torch.cuda.max_memory_allocated() / 2**20
    from _common import proc_kb
    return proc_kb("VmHWM") / 1024


def timed_run(out: str, a, probe: bool) -> dict:
    """``trainer.train()`` with or without the callback: ``wall`` and ``cpu`` seconds, the
    callback's ``history`` and the ``steps`` of ``step_clock``."""
    from entprobe.integrations import EntropyProbeCallback

    tr = build_trainer(out, a.steps, model=a.model, prompts_per_step=a.prompts_per_step, max_new=a.max_new,
                       lr=a.lr, question=a.question, device=a.device)
    cb, clock = None, step_clock()
    if probe:
        pk = {k: v for k, v in (("projection", a.projection), ("weighting_mode", a.weighting_mode),
                                ("x_estimator", a.x_estimator), ("unit_grads_budget_mb", a.unit_grads_budget_mb),
                                ("rollouts_prompts", a.rollouts_prompts))
              if v is not None}
        extra = {"probe": pk} if pk else {}
        if a.source == "rollouts":
            extra.update(source="rollouts", measure=a.measure, fused_backward=a.fused_backward)
        cb = EntropyProbeCallback(tr, every_n_steps=a.every, batch={"B_E": a.B_E}, **extra)
        tr.add_callback(cb)
    tr.add_callback(clock)
    t0, c0 = time.perf_counter(), time.process_time()
    tr.train()
    return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
            "history": cb.history if cb else [], "steps": clock.steps}


# the probe's phases (ProbeContext.phase names), in the order they run
PHASES = {"sample_E": "sample E (the trainer's generation)", "geometry": "geometry + update model",
          "step_parts": "update's parts (closed form)", "x_constants": "token_mean's constants (a forward)",
          "rollouts_fused": "rollouts: passes in the trainer's step (fused)",
          "rollouts_units": "rollouts: per prompt X, Y and dots",
          "rollouts_y": "rollouts: Y . J Xbar (second pass)",
          "accumulate_X_E": "X pass over E, per-prompt projections",
          "gt_eval_E": "E's log-probs after the step", "importance": "importance sampling"}


def phase_table(hist: list[dict], per_steps_cpu: float | None = None) -> list[str]:
    """Per-probe medians (ms) by phase, wall and CPU; ``other`` is the rest of ``time_s``
    (context, gradient copy, RNG and modes kept, the callback's logging). ``per_steps_cpu``
    (seconds: ``every`` plain steps' CPU time) adds each phase's CPU time as a share of it."""
    def med(key):
        return 1e3 * statistics.median(r.get(key, 0.0) for r in hist)
    rows = []
    for k, label in PHASES.items():
        rows.append((label, med(f"time/{k}_s"), med(f"cpu_time/{k}_s")))
    rows.append(("other", 1e3 * statistics.median(r["time_s"] - sum(r.get(f"time/{k}_s", 0.0) for k in PHASES)
                                                  for r in hist),
                 1e3 * statistics.median(r["cpu_time_s"] - sum(r.get(f"cpu_time/{k}_s", 0.0) for k in PHASES)
                                         for r in hist)))
    rows.append(("total per probe", med("time_s"), med("cpu_time_s")))
    share = (lambda c: f" = {c / 1e3 / per_steps_cpu:6.2%} of the steps") if per_steps_cpu else (lambda c: "")
    return [f"  {label:<40} {w:8.1f} ms wall {c:8.1f} ms CPU{share(c)}" for label, w, c in rows]


def overhead(out: str, a, first_probe: dict) -> None:
    """Interleaved pairs with and without the callback (module docstring); prints the figures."""
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(a.pairs):
        for probe in ((True, False) if i % 2 == 0 else (False, True)):
            runs[probe].append(timed_run(out, a, probe))
    hist = [r for run in runs[True] for r in run["history"]]
    per_run = len(runs[True][0]["history"])
    print(f"overhead at every={a.every}, B_E={a.B_E}: {a.pairs} interleaved pairs, {per_run} probes per run")
    cpu_steps = None
    for clock, own_key, j in (("wall", "time_s", 1), ("cpu", "cpu_time_s", 2)):
        w, p = [r[clock] for r in runs[True]], [r[clock] for r in runs[False]]
        own = statistics.median(sum(h[own_key] for h in r["history"]) for r in runs[True])
        mw, mp = statistics.median(w), statistics.median(p)
        print(f"  {clock:>4}, whole runs: with {mw:.2f} s, without {mp:.2f} s (medians of "
              f"{', '.join(f'{x:.2f}' for x in w)} / {', '.join(f'{x:.2f}' for x in p)}): {(mw - mp) / mp:+.1%}; "
              f"the probe's own time {own:.2f} s = {own / mp:.1%} of the plain run")
        step = statistics.median(s[j] for r in runs[False] for s in r["steps"])
        probed = {h["step"] for h in hist}
        other = statistics.median(s[j] for r in runs[True] for s in r["steps"] if s[0] not in probed)
        per_probe = statistics.median(h[own_key] for h in hist)
        print(f"  {clock:>4}, per step (medians): a plain step {1e3 * step:.1f} ms (an unprobed step of the "
              f"probed runs {1e3 * other:.1f} ms), a probe {1e3 * per_probe:.1f} ms: "
              f"{per_probe / (a.every * step):.1%} of {a.every} steps (target <= 5%)")
        if clock == "cpu":
            cpu_steps = a.every * step
    print(f"per probe, by phase (medians over the timed runs' probes; shares of {a.every} plain steps' CPU time):")
    print("\n".join(phase_table(hist, cpu_steps)))
    steady = statistics.median(h["time_s"] for h in hist)
    print(f"the process's first probe: {first_probe['time_s']:.3f} s wall ({first_probe['time_s'] - steady:+.3f} s "
          "over the median probe)")


@contextlib.contextmanager
def call_times():
    """Process CPU time (``time.process_time``) of the calls a probe's and a step's time go to, summed
    over the run: inside a probe (``OnlineProbe.before_step``) its backward passes and its forwards
    (``ProbeContext.forward_S``), and the probe as a whole; outside, the trainer's backward passes and
    its generation and scoring (``GRPOTrainer._generate_and_score_completions``). Yields the totals
    ``{name: [seconds, calls]}``; the patched callables are restored on exit."""
    import torch
    import trl

    from entprobe.integrations import trl_fused
    from entprobe.integrations.online import OnlineProbe
    from entprobe.pipeline.stages.context import ProbeContext

    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    inside = [False]

    def timed(fn, name_of, flag: bool = False):
        def wrapper(*args, **kwargs):
            if flag:
                inside[0] = True
            t = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                name = name_of()
                if name:
                    totals[name][0] += time.process_time() - t
                    totals[name][1] += 1
                if flag:
                    inside[0] = False
        return wrapper

    patches = [(torch.Tensor, "backward", lambda: "probe: backward" if inside[0] else "trainer: backward", False),
               (ProbeContext, "forward_S", lambda: "probe: forward" if inside[0] else None, False),
               (OnlineProbe, "before_step", lambda: "probe: whole", True),
               # fused_backward: the probe's passes made in the trainer's compute_loss, in place of its backward
               (trl_fused, "per_prompt_passes", lambda: "probe: passes in the trainer's step (fused)", True),
               (trl.GRPOTrainer, "_generate_and_score_completions", lambda: "trainer: generation + scoring", False),
               (trl.GRPOTrainer, "compute_loss", lambda: None if inside[0] else "trainer: loss forward", False)]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _, _ in patches]
    for owner, attr, name_of, flag in patches:
        setattr(owner, attr, timed(getattr(owner, attr), name_of, flag))
    try:
        yield totals
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def units(hist: list[dict], calls: dict, steps: int, step_s: float, gen_shares: list[float], clock: str,
          step_times: dict[int, float] | None = None) -> dict:
    """The probe in the trainer's units: its median time (``cpu_time_s``, or ``time_s`` for the wall
    clock) over the median unprobed step's (``step_s``), and over the trainer's forward + backward a
    step (``call_times``: the loss's forward and the backward, generation and the optimizer left out;
    CPU time). On a GPU, where generation takes a share g of the step and the forward + backward about
    the rest, the probe would be about ``(1 - g) x`` its forward + backward units of a step (no
    generation in the probe). With ``probe.rollouts_prompts`` the probes of the subset only, with
    ``fused_backward`` the fused ones (the first probe takes every prompt, unfused). ``step_times``:
    each step's own time by step (the same clock); the probed steps' median less ``step_s`` is what a
    probe adds to its step: with ``fused_backward`` the probe's passes replace the trainer's backward,
    so the probe's own time is not its cost; this is, and the forward + backward units and the GPU
    projection are then taken from it."""
    sub = [r for r in hist if r.get("rollouts/probed", r.get("rollouts/B")) != r.get("rollouts/B")
           or r.get("rollouts/fused_backward")]  # the first probe checks the objective on the whole batch, unfused
    key = "cpu_time_s" if clock == "cpu" else "time_s"
    probe = statistics.median(r[key] for r in (sub or hist))  # a subset's: the first probe takes all
    fb = (calls.get("trainer: loss forward", [0.0])[0] + calls.get("trainer: backward", [0.0])[0]) / steps
    out = {"clock": clock, "probe_s": probe, "step_s": step_s, "probe_steps": probe / step_s,
           "probes": len(sub or hist), "subset": any(r.get("rollouts/probed", r.get("rollouts/B")) != r.get("rollouts/B")
                                                      for r in sub)}
    later = [step_times[r["step"]] for r in (sub or hist) if r["step"] in (step_times or {})]
    if later:
        out.update(added_s=statistics.median(later) - step_s, added_steps=statistics.median(later) / step_s - 1)
    if fb > 0 and clock == "cpu":
        cost = out.get("added_s", probe)
        out.update(fb_s=fb, probe_fb=cost / fb, gpu_share={str(g): (1 - g) * cost / fb for g in gen_shares})
    return out


def units_lines(u: dict) -> list[str]:
    """``units`` in words."""
    out = [f"the probe in training-step units ({u['clock']} clock, median of {u['probes']}"
           f"{' subset' if u['subset'] else ''} probe(s)): {u['probe_s']:.2f} s a probe = {u['probe_steps']:.2f} "
           f"steps ({u['step_s']:.2f} s each, generation included)"]
    if "added_s" in u:
        out.append(f"a probed step over an unprobed one: {u['added_s']:.2f} s = {u['added_steps']:.2f} steps (what a "
                   "probe adds to its step; with --fused-backward less than its own time: its passes are the step's "
                   "backward)")
    if "fb_s" in u:
        out[-1] += f" = {u['probe_fb']:.2f} x the trainer's forward + backward ({u['fb_s']:.2f} s a step)"
        out += [f"  projected on a GPU step whose generation is {float(g):.0%}: {v:.2f} steps a probe"
                for g, v in u["gpu_share"].items()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--B-E", type=int, default=16)
    ap.add_argument("--overhead", action="store_true", help="also time the run with and without the callback")
    ap.add_argument("--pairs", type=int, default=3, help="interleaved with/without pairs for --overhead")
    ap.add_argument("--model", choices=["default", "smollm2"], default="default")
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=4, help="completion tokens per response")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--projection", default=None, help="probe.projection for the callback (default: auto)")
    ap.add_argument("--source", choices=["held_out", "rollouts"], default="held_out")
    ap.add_argument("--measure", action="store_true", help="--source rollouts: also measure on a fresh E of --B-E")
    ap.add_argument("--weighting-mode", default=None, help="probe.weighting_mode (default: the callback's)")
    ap.add_argument("--x-estimator", default=None, help="probe.x_estimator (default: auto)")
    ap.add_argument("--unit-grads-budget-mb", type=float, default=None,
                    help="probe.unit_grads_budget_mb (rollouts: 0 takes Y . J Xbar in a second pass, keeping no Y_n)")
    ap.add_argument("--rollouts-prompts", type=int, default=None,
                    help="probe.rollouts_prompts (rollouts: X and Y on this many of the step's prompts; default all)")
    ap.add_argument("--gpu-generation-share", type=float, nargs="*", default=[0.5, 0.8],
                    help="with --calls: the shares of a GPU step that generation takes, for the projected probe share")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where TRL trains (cuda: bf16)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default=None,
                    help="the units' clock (default: process CPU time on CPU, wall clock on cuda)")
    ap.add_argument("--json", default=None, help="also write the units as one JSON object to this file")
    ap.add_argument("--fused-backward", action="store_true", help="--source rollouts: the callback's fused_backward "
                    "(a probed step's gradient from the probe's per-prompt passes, the trainer's backward skipped)")
    ap.add_argument("--question", action="store_true", help="the arithmetic questions of task=arithmetic_question, "
                    "scored on the last number (SmolLM2 answers some)")
    ap.add_argument("--calls", action="store_true", help="also print the CPU time of the probe's backward passes and "
                    "forwards and of the trainer's backward passes and generation (call_times)")
    a = ap.parse_args()
    a.clock = a.clock or ("cpu" if a.device == "cpu" else "wall")
    with tempfile.TemporaryDirectory() as out:
        import datasets, trl  # noqa: F401, E401  (the trainer's own imports, untimed)

        t0 = time.perf_counter()
        from entprobe.integrations import EntropyProbeCallback  # noqa: F401
        t1 = time.perf_counter()
        from entprobe.math.importance import psis_backend
        psis_backend()
        print(f"one-time, before training: importing entprobe.integrations {t1 - t0:.2f} s, the PSIS dependency "
              f"(arviz-stats, imported when the callback is made) {time.perf_counter() - t1:.2f} s")
        with call_times() if a.calls else contextlib.nullcontext() as calls:
            first = timed_run(out, a, True)
        with_probe, hist = first["wall"], first["history"]
        print(f"{a.model}: {len(hist)} probes over {a.steps} steps (every {a.every}, source {a.source}"
              f"{', measured' if a.measure else ''}, B_E={a.B_E}, G=4, {a.prompts_per_step} prompts a step, "
              f"{a.max_new} new tokens, projection {a.projection or 'auto'}):")
        if a.source == "held_out" or a.measure:
            paired, inside = agreement(hist)
            print(f"  difference's 95% interval holds 0: {paired:.1%} (target 90-99%; rollouts: against E's own prediction)")
            print(f"  measured inside the prediction's 95% interval: {inside:.1%}")
        closed = max(abs(r["deltaH1_step"] - r.get("deltaH_pred_plain", r["deltaH_pred"]))  # rollouts: Xbar of the batch
                     / max(abs(r.get("deltaH_pred_plain", r["deltaH_pred"])), 1e-12) for r in hist)
        print(f"  closed-form update vs the real step: max relative gap {closed:.1e}")
        print(f"  probe time {sum(r['time_s'] for r in hist):.1f} s of {with_probe:.1f} s")
        peak = process_peak_mib(a.device)
        print(f"  process peak through the run with the probe: {peak:.0f} MiB "
              f"({'VmHWM: model, trainer, generation and probe' if a.device == 'cpu' else 'CUDA max allocated'})")
        probed = {h["step"] for h in hist}
        unprobed = [c for st, _, c in first["steps"] if st not in probed]
        if unprobed:  # this run's own unprobed steps as the plain step (--overhead times plain runs too)
            step_cpu = statistics.median(unprobed)
            print(f"per probe, by phase (medians over this run's probes; shares of {a.every} of its unprobed "
                  f"steps' CPU time, {1e3 * step_cpu:.1f} ms each):")
            print("\n".join(phase_table(hist, a.every * step_cpu)))
        if calls:
            print(f"CPU time by call over the run ({a.steps} steps, {len(hist)} probes; process time):")
            for name, (sec, n) in sorted(calls.items()):
                per, unit = (sec / len(hist), "probe") if name.startswith("probe") else (sec / a.steps, "step")
                print(f"  {name:<34} {sec:8.2f} s over {n:3d} calls: {per:7.3f} s a {unit}")
        if unprobed:
            walls = [w for st, w, _ in first["steps"] if st not in probed]
            at = {st: (c if a.clock == "cpu" else w) for st, w, c in first["steps"]}
            u = units(hist, calls or {}, a.steps, step_cpu if a.clock == "cpu" else statistics.median(walls),
                      a.gpu_generation_share, a.clock, at)
            print("\n".join(units_lines(u)))
            if a.json:
                Path(a.json).write_text(json.dumps({"model": a.model, "prompts_per_step": a.prompts_per_step,
                                                    "max_new": a.max_new, "rollouts_prompts": a.rollouts_prompts,
                                                    "source": a.source, "device": a.device, "peak_mib": peak,
                                                    **u}, indent=1))
        assert all(math.isfinite(r["deltaH_pred"]) for r in hist)
        if a.overhead:
            overhead(out, a, hist[0])


if __name__ == "__main__":
    main()
