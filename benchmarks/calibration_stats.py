"""The per-(checkpoint, lr) statistics of benchmarks/calibration.py: over the measurable draws, the
paired intervals' coverage of 0 with its binomial SE and one-sided p-value, sign agreement, the
ratio of mean measured to mean predicted change (delta-method SE, percentile bootstrap) and the
slope through the origin, and per checkpoint the lowest lr where first order stops holding."""
from __future__ import annotations

import math
import random
import statistics

NAN = float("nan")


def fmt(x: float, sig: int = 3) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.{sig}g}"


def is_measurable(r: dict) -> bool:
    return (r["status"] == "ok" and r["measurable"] is not False and str(r["measurable"]) != "False"
            and all(math.isfinite(r[k]) for k in ("deltaH_true", "deltaH_pred", "ci95_true_minus_pred_low",
                                                   "ci95_true_minus_pred_high")))


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k), X ~ Binomial(n, p)."""
    return sum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(k, n + 1))


def ratio_of_means(t: list[float], p: list[float], reps: int = 2000) -> tuple[float, float, float, float]:
    """mean(t)/mean(p), its delta-method SE and a 95% percentile bootstrap interval over draws."""
    n = len(t)
    if n < 2 or statistics.fmean(p) == 0:
        return NAN, NAN, NAN, NAN
    mt, mp = statistics.fmean(t), statistics.fmean(p)
    R = mt / mp
    resid = [ti - R * pi for ti, pi in zip(t, p)]
    se = statistics.stdev(resid) / math.sqrt(n) / abs(mp)
    rng = random.Random(0)
    boot = []
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in range(n)]
        bp = sum(p[i] for i in idx)
        if bp != 0:
            boot.append(sum(t[i] for i in idx) / bp)
    boot.sort()
    lo = boot[int(0.025 * (len(boot) - 1))] if boot else NAN
    hi = boot[int(0.975 * (len(boot) - 1))] if boot else NAN
    return R, se, lo, hi


def slope(t: list[float], p: list[float], reps: int = 2000) -> tuple[float, float, float]:
    """Least-squares slope of measured on predicted through the origin, sum(t p) / sum(p^2), and a 95%
    percentile bootstrap interval over draws. With U fixed, the predictions of different E draws
    scatter around a mean that can be near 0 (then the ratio of means is ill-conditioned); the slope
    weights each draw by its own prediction."""
    n = len(t)
    if n < 2 or not any(p):
        return NAN, NAN, NAN
    b = sum(x * y for x, y in zip(t, p)) / sum(y * y for y in p)
    rng = random.Random(1)
    boot = []
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in range(n)]
        den = sum(p[i] ** 2 for i in idx)
        if den > 0:
            boot.append(sum(t[i] * p[i] for i in idx) / den)
    boot.sort()
    return b, boot[int(0.025 * (len(boot) - 1))], boot[int(0.975 * (len(boot) - 1))]


def median(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return statistics.median(xs) if xs else NAN


def summarise(rows: list[dict], B_E: int = 8) -> list[dict]:
    from entprobe.math.estimators import t_quantile

    q = t_quantile(B_E - 1)  # the prediction's 95% t interval (B_E - 1 df)
    out = []
    seen = []
    for r in rows:
        if (r["checkpoint"], r["lr"]) not in seen:
            seen.append((r["checkpoint"], r["lr"]))
    for ck, lr in seen:
        rs = [r for r in rows if r["checkpoint"] == ck and r["lr"] == lr]
        ok = [r for r in rs if r["status"] == "ok"]
        m = [r for r in ok if is_measurable(r)]
        n = len(m)
        k = sum(r["ci95_true_minus_pred_low"] <= 0 <= r["ci95_true_minus_pred_high"] for r in m)
        hi_ess = [r for r in m if r["ESS_frac"] >= 0.9]
        p = k / n if n else NAN
        res = [r for r in m if abs(r["deltaH_pred"]) > r["SE_deltaH_pred"]
               and abs(r["deltaH_true"]) > r["SE_deltaH_true"]]  # both resolved beyond 1 SE
        agree_res = sum((r["deltaH_pred"] > 0) == (r["deltaH_true"] > 0) for r in res)
        agree_all = sum((r["deltaH_pred"] > 0) == (r["deltaH_true"] > 0) for r in m)
        R, Rse, Rlo, Rhi = ratio_of_means([r["deltaH_true"] for r in m], [r["deltaH_pred"] for r in m])
        b, blo, bhi = slope([r["deltaH_true"] for r in m], [r["deltaH_pred"] for r in m])
        z = [r["deltaH_true_minus_pred"] / r["SE_deltaH_true_minus_pred"] for r in m
             if r["SE_deltaH_true_minus_pred"] > 0]
        out.append({
            "checkpoint": ck, "lr": lr, "runs": len(rs), "errors": len(rs) - len(ok), "measurable": n,
            "unmeasurable": len(ok) - n,
            "unmeasurable_khat": sum("k-hat" in str(r["unmeasurable_reason"]) for r in ok if not is_measurable(r)),
            "unmeasurable_ess": sum("ESS" in str(r["unmeasurable_reason"]) for r in ok if not is_measurable(r)),
            "holds0": p, "SE_holds0": math.sqrt(p * (1 - p) / n) if n else NAN,
            "rejections": n - k, "p_excess_rejections": binom_sf(n - k, n, 0.05) if n else NAN,
            "n_ess_ge_0.9": len(hi_ess), "holds0_ess_ge_0.9": (sum(
                r["ci95_true_minus_pred_low"] <= 0 <= r["ci95_true_minus_pred_high"] for r in hi_ess) / len(hi_ess)
                if hi_ess else NAN),
            "sign_resolved_n": len(res), "sign_resolved_agree": agree_res, "sign_all_agree": agree_all,
            # the prediction's own resolution: the verdict's (|pred| > its SE, else noise_dominated), its 95%
            # interval excludes 0 (by sign), its spread over draws
            "pred_resolved": sum(abs(r["deltaH_pred"]) > r["SE_deltaH_pred"] for r in ok),
            "pred_excl0_pos": sum(r["deltaH_pred"] > q * r["SE_deltaH_pred"] for r in ok),
            "pred_excl0_neg": sum(r["deltaH_pred"] < -q * r["SE_deltaH_pred"] for r in ok),
            "sd_pred": statistics.stdev([r["deltaH_pred"] for r in ok]) if len(ok) > 1 else NAN,
            "median_se_pred": median([r["SE_deltaH_pred"] for r in ok]),
            "ratio": R, "SE_ratio": Rse, "ratio_lo": Rlo, "ratio_hi": Rhi, "slope": b, "slope_lo": blo, "slope_hi": bhi,
            "sd_z": statistics.stdev(z) if len(z) > 1 else NAN,
            "median_se_ratio": median([r["SE_deltaH_true_minus_pred"] / r["SE_deltaH_true"] for r in m
                                       if r["SE_deltaH_true"] > 0]),
            "median_ESS_frac": median([r["ESS_frac"] for r in ok]),
            "median_U_zero_var": median([r["batch_U/frac_zero_var_groups"] for r in ok]),
            "mean_pred": statistics.fmean([r["deltaH_pred"] for r in m]) if m else NAN,
            "mean_true": statistics.fmean([r["deltaH_true"] for r in m]) if m else NAN,
            "median_wall_s": median([r["wall_s"] for r in rs]),
        })
    return out


def breakdown(summary: list[dict]) -> dict[str, str]:
    """Per checkpoint: the lowest lr where rejections are clearly above 5% or the ratio leaves 1."""
    res = {}
    for s in summary:
        ck = s["checkpoint"]
        if ck in res:
            continue
        why = []
        if math.isfinite(s["p_excess_rejections"]) and s["p_excess_rejections"] < 0.05:
            why.append(f"{s['rejections']}/{s['measurable']} rejected (binomial p {s['p_excess_rejections']:.2g})")
        if math.isfinite(s["ratio_lo"]) and not (s["ratio_lo"] <= 1 <= s["ratio_hi"]):
            why.append(f"measured/predicted {fmt(s['ratio'])} [{fmt(s['ratio_lo'])}, {fmt(s['ratio_hi'])}]")
        if math.isfinite(s["slope_lo"]) and not (s["slope_lo"] <= 1 <= s["slope_hi"]):
            why.append(f"slope {fmt(s['slope'])} [{fmt(s['slope_lo'])}, {fmt(s['slope_hi'])}]")
        if s["measurable"] == 0 and s["unmeasurable"]:
            why.append("every draw unmeasurable")
        if why:
            res[ck] = f"lr {s['lr']:g}: " + "; ".join(why)
    for s in summary:
        res.setdefault(s["checkpoint"], "not within the lrs run")
    return res
