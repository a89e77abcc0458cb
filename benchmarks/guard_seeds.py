"""The runs of ``entropy_guard.py --seeds`` side by side over seeds: per seed and run the steps whose
logged token entropy is below the floor, the mean |H - floor| from step 21 (how closely the entropy
tracks the floor as TRL's adaptive rule's target) and the mean reward over all steps; the totals over
seeds; and the issue's comparisons of the guarded run with its peer (TRL's ``use_adaptive_entropy``
at the same target) and with the lower fixed lr. Pure functions of ``entropy_guard.figures``'s dicts.
"""
from __future__ import annotations

import math
import statistics

COLUMNS = ("below_floor", "track", "reward_all")


def cell(f: dict) -> str:
    """``below / track / reward`` of one run's figures."""
    return f"{f['below_floor']} / {f['track']:.3f} / {f['reward_all']:.3f}"


def totals(figs: dict[int, dict[str, dict]], name: str) -> dict:
    """Over the seeds that ran ``name``: the steps below the floor summed, the mean |H - floor| and the
    reward averaged (nan where no seed has a figure)."""
    rows = [runs[name] for runs in figs.values() if name in runs]
    mean = lambda key: statistics.mean(r[key] for r in rows) if rows else math.nan  # noqa: E731
    return {"below_floor": sum(r["below_floor"] for r in rows), "track": mean("track"),
            "reward_all": mean("reward_all"), "seeds": len(rows)}


def standard_errors(figs: dict[int, dict[str, dict]], name: str) -> dict:
    """The standard errors of ``totals``'s means over seeds (the seeds' spread over sqrt(seeds); nan with
    fewer than 2 seeds, or when a seed's figure is nan, as the mean is: a run too short for step 21)."""
    rows = [runs[name] for runs in figs.values() if name in runs]

    def se(key: str) -> float:
        vals = [r[key] for r in rows]
        if len(vals) < 2 or not all(math.isfinite(v) for v in vals):
            return math.nan
        return statistics.stdev(vals) / math.sqrt(len(vals))
    return {"track": se("track"), "reward_all": se("reward_all")}


def comparisons(figs: dict[int, dict[str, dict]], guard: str = "recommended", peer: str = "trl_adaptive",
                lower: str = "lower_lr") -> list[str]:
    """The guarded run against its peer, seed by seed: no more steps below the floor, a mean |H - floor|
    at most half the peer's, a reward (all steps) no lower; and against the lower fixed lr: a reward no
    lower. Each as ``k of n seeds``, with the totals' figures."""
    out = []
    both = [s for s, runs in figs.items() if guard in runs and peer in runs]
    if both:
        g, p = totals({s: figs[s] for s in both}, guard), totals({s: figs[s] for s in both}, peer)
        below = sum(figs[s][guard]["below_floor"] <= figs[s][peer]["below_floor"] for s in both)
        half = sum(figs[s][guard]["track"] <= 0.5 * figs[s][peer]["track"] for s in both)
        reward = sum(figs[s][guard]["reward_all"] >= figs[s][peer]["reward_all"] for s in both)
        ratio = g["track"] / p["track"] if p["track"] > 0 else math.nan
        out += [f"- {guard} against {peer}: no more steps below the floor on {below} of {len(both)} seeds "
                f"({g['below_floor']} against {p['below_floor']} in all); a mean |H - floor| from step 21 at most "
                f"half the peer's on {half} of {len(both)} ({g['track']:.3f} against {p['track']:.3f} over the seeds, "
                f"a ratio of {ratio:.2f}); a reward no lower on {reward} of {len(both)} ({g['reward_all']:.3f} "
                f"against {p['reward_all']:.3f})"]
    both = [s for s, runs in figs.items() if guard in runs and lower in runs]
    if both:
        g, lo = totals({s: figs[s] for s in both}, guard), totals({s: figs[s] for s in both}, lower)
        reward = sum(figs[s][guard]["reward_all"] >= figs[s][lower]["reward_all"] for s in both)
        out.append(f"- {guard} against {lower}: a reward no lower on {reward} of {len(both)} seeds "
                   f"({g['reward_all']:.3f} against {lo['reward_all']:.3f}); steps below the floor "
                   f"{g['below_floor']} against {lo['below_floor']}")
    return out


def markdown(figs: dict[int, dict[str, dict]]) -> list[str]:
    """The table (a row per seed, a column per run, each cell ``below / track / reward``; then the
    totals: below summed, the others averaged) and ``comparisons``."""
    names = list(dict.fromkeys(n for runs in figs.values() for n in runs))
    lines = ["| seed | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for seed, runs in figs.items():
        lines.append(f"| {seed} | " + " | ".join(cell(runs[n]) if n in runs else "-" for n in names) + " |")
    lines.append("| all | " + " | ".join(cell(totals(figs, n)) for n in names) + " |")
    lines.append("(each cell: steps below the floor / mean |H - floor| from step 21 / reward, mean of all steps; "
                 "row 'all': the steps summed, the rest averaged over seeds)")
    lines.append("standard errors of row 'all''s means over seeds (mean |H - floor| / reward): " + "; ".join(
        f"{n} {e['track']:.3f} / {e['reward_all']:.3f}" for n, e in ((n, standard_errors(figs, n)) for n in names)))
    return lines + comparisons(figs)
