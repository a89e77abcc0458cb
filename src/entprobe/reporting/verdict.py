"""What a person reads first: the predicted change of the real next step, the measured one, their
difference, each with its standard error, and plain-language flags. Pure functions of the flat
results (``flags``, ``verdict_lines``); ``print_verdict`` renders them with rich.
"""
from __future__ import annotations

import math

from entprobe.math.estimators import t_quantile
from entprobe.reporting.planning import sign_plan_row

Flag = tuple[str, str]  # (code, sentence)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _pm(x, se) -> str:
    if not _finite(x):
        return "n/a"
    x = x + 0.0  # -0.0 (e.g. -lr * 0) is shown as 0
    return f"{x:+.4g} ± {se:.2g}" if _finite(se) else f"{x:+.4g}"


ZERO_UPDATE = ("the update is exactly zero (no momentum or weight decay to apply either): nothing moves, so the "
               "predicted and measured changes are 0 exactly and the E pass and the real step were skipped")


def _gradient_free_step(r: dict) -> str:
    """What the step is when the update's gradient is zero, for the step model that predicts it."""
    if r.get("update_zero"):
        return ZERO_UPDATE
    kind = r.get("pred/step_model", "")
    if kind == "preconditioned_sgd":
        return "the step is exactly zero (deltaH_pred and deltaH1 are 0)"
    if kind == "sgd_closed_form":
        return "the step is SGD's momentum buffer and weight decay only (exactly zero without them; deltaH1 is 0)"
    if kind == "adamw_closed_form":
        return "the step is AdamW's momentum and weight decay only (deltaH1 is 0)"
    return "the step is what the optimizer does without a gradient (momentum, weight decay; deltaH1 is 0)"


def sgd_geometry(r: dict) -> bool:
    """True when the probe ran in plain SGD geometry: ``optimizer.preconditioner=identity`` and no
    optimizer state read (no momentum, no Adam statistics: the step is SGD's at the lr)."""
    return r.get("preconditioner") == "identity" and not r.get("optimizer_path") \
        and not str(r.get("optimizer_format", "")).startswith("in memory")


def deltaH1_note(r: dict) -> str:
    """What deltaH1 is, for the geometry the probe ran in: along P Ybar with P Adam's preconditioner,
    or the plain gradient Ybar with ``optimizer.preconditioner=identity`` (P = identity)."""
    if r.get("preconditioner") == "identity":
        rest = "the step SGD takes" if sgd_geometry(r) else "without momentum or weight decay (not the step AdamW takes)"
        return f"-lr Xbar.Ybar: first order along the plain gradient (P = identity), {rest}"
    return ("-lr Xbar.P.Ybar: first order along Adam's preconditioned gradient, without momentum or "
            "weight decay (not the step AdamW takes)")


def deltaH1_untrusted(r: dict) -> str:
    """Why deltaH1 is not a number to read in the headline, "" when it is. The criterion: a first-order
    change whose size, or whose SE, exceeds the entropy H itself is outside first order's regime
    (entropy cannot fall below 0, and a step that moves it by more than H is no small step; the same
    bound as the ``larger_than_entropy`` flag on deltaH_pred), so neither its value nor its interval
    says anything a step can do; it stays in the results table and results.json. (Its distance from
    deltaH_pred is no criterion: deltaH1 leaves out momentum and weight decay by design.)"""
    d1, se, H = r.get("deltaH1"), r.get("SE_deltaH1"), r.get("H_orig")
    if not (_finite(d1) and _finite(H) and H > 0):
        return ""
    if abs(d1) > H:
        return f"|deltaH1| {abs(d1):.3g} exceeds the entropy H = {H:.3g}"
    if _finite(se) and se > H:
        return f"its SE {se:.2g} exceeds the entropy H = {H:.3g}"
    return ""


def flags(r: dict, ess_threshold: float = 0.3, truncated_sampling: bool = False) -> list[Flag]:
    """The warnings a reader must not miss, from the flat results ``r``."""
    out: list[Flag] = []
    pred, se = r.get("deltaH_pred"), r.get("SE_deltaH_pred")
    H = r.get("H_orig")
    mean_U = r.get("batch_U/reward_mean")  # NaN: every U row unscorable
    if r.get("batch_U/frac_zero_var_groups") == 1.0 and isinstance(mean_U, float) and math.isnan(mean_U):
        out.append(("empty_gradient", "no U response has a reward (every reward function returned None for every "
                    f"row: task.reward_funcs), so every advantage is 0 and the update's gradient is zero: "
                    f"{_gradient_free_step(r)}. Check the functions' keyword columns against the task's fields."))
    elif r.get("batch_U/frac_zero_var_groups") == 1.0:
        out.append(("empty_gradient", "every U group has equal rewards, so the update's gradient is zero: "
                    f"{_gradient_free_step(r)}. Raise B_U or G, or use prompts the policy sometimes solves."))
    elif r.get("norm_PYbar") == 0.0:
        out.append(("empty_gradient", "the update's gradient on U is exactly zero although some group's rewards "
                    "differ: in every group the advantages cancel on identical log-prob gradients (e.g. identical "
                    f"responses at a low sampling.temperature): {_gradient_free_step(r)}. Raise the temperature, "
                    "B_U or G."))
    lo, hi = r.get("ci95_pred_low"), r.get("ci95_pred_high")
    if sgd_geometry(r):
        out.append(("sgd_geometry", "plain SGD geometry (optimizer.preconditioner=identity, no optimizer state): "
                    "the step predicted and taken is SGD's at the lr, without Adam's preconditioner, momentum or "
                    "weight decay; an AdamW run's next step differs: give its optimizer state "
                    "(optimizer.state_path) for Adam geometry."))
    if _finite(pred) and _finite(se) and se > abs(pred):
        out.append(("noise_dominated", f"the prediction is within its SE of 0 (|{pred:.3g}| < {se:.3g}): its sign "
                    "is not resolved; raise batch.B_E (the SE falls as 1/sqrt(B_E))."))
    elif _finite(lo) and _finite(hi) and lo <= 0 <= hi and not r.get("update_zero"):
        out.append(("sign_not_resolved", f"the prediction's 95% interval [{lo:.3g}, {hi:.3g}] holds 0: the sign of "
                    "the change is not resolved at 95%; raise batch.B_E (the row 'to resolve its sign' says how "
                    "far)."))
    if _finite(pred) and _finite(H) and abs(pred) > abs(H) > 0:
        out.append(("larger_than_entropy", f"the predicted change {pred:.3g} exceeds the entropy itself ({H:.3g}): "
                    "a first-order prediction cannot hold at this lr; lower optimizer.lr."))
    ess = r.get("ESS_frac")
    if r.get("measurable") is False:
        res_note = (f" The change on fresh responses sampled after the step is "
                    f"{_pm(r['deltaH_resample'], r.get('SE_deltaH_resample'))} (deltaH_resample; not paired with "
                    "the prediction)." if _finite(r.get("deltaH_resample")) else "")
        out.append(("unmeasurable", f"the measured change cannot be trusted ({r.get('unmeasurable_reason', '')}): "
                    "deltaH_true is not reported and first order is not tested. The step moves the policy too far "
                    "for re-weighting the responses drawn before it; lower optimizer.lr to measure it." + res_note))
    elif _finite(ess) and ess < ess_threshold:
        out.append(("low_ess", f"importance weights are degenerate (ESS/N {ess:.2f} < {ess_threshold}): the "
                    "measured change is unreliable and the step is far from first order; lower optimizer.lr."))
    if r.get("pred_consistent") is False and _finite(r.get("SE_deltaH_true_minus_pred")):
        out.append(("inconsistent", "measured and predicted changes differ beyond their 95% interval: first "
                    "order does not hold for this step (or the step model misses what the optimizer does)."))
    broken = precision_breaks_pairing(r)
    if broken:
        out.append(("pairing_broken_by_precision", broken))
    if truncated_sampling:
        out.append(("truncated_sampling", "top-k / top-p sampling: responses are not drawn from the policy, so "
                    "every estimate is biased; sample with top_k=0, top_p=1."))
    d1, nh = r.get("deltaH1"), r.get("deltaH1_no_history")
    if _finite(d1) and _finite(nh) and abs(nh) > 0.5 * abs(d1) > 0:
        out.append(("deltaH1_no_history", f"{abs(nh) / abs(d1):.0%} of deltaH1 (-lr Xbar.P.Ybar) comes from coordinates "
                    "Adam never updated (v = 0, P = 1/eps there), which the real step moves by only ~lr: "
                    "read deltaH_pred, not deltaH1."))
    why = deltaH1_untrusted(r)
    if why:
        out.append(("deltaH1_not_shown", f"deltaH1 {_pm(d1, r.get('SE_deltaH1'))} is left out of the headline: "
                    f"{why}, beyond first order; it stays in the results (results.json)."))
    measured = ("deltaH_true", "SE_deltaH_true") if r.get("measurable") is not False else ()  # NaN by design
    bad = [k for k in ("deltaH_pred", "SE_deltaH_pred", *measured, "deltaH1", "SE_deltaH1")
           if k in r and not _finite(r[k])]
    if bad:
        out.append(("non_finite", f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not finite: do not read "
                    "the headline; look for NaN / Inf log-probs or weights."))
    return out


def _ci(r: dict, lo: str, hi: str) -> str:
    return f"[{r[lo] + 0.0:.3g}, {r[hi] + 0.0:.3g}]" if _finite(r.get(lo)) and _finite(r.get(hi)) else ""


def paired_test(r: dict) -> str:
    """The paired difference's test in words: ``consistent: |t| 2.11 < 2.36 (7 df)`` (|t| = |diff| /
    SE against the two-sided 95% Student-t quantile of the interval's degrees of freedom,
    ``df_true_minus_pred``); ``NOT consistent: |t| 3.10 > 2.36 (7 df)`` when the interval excludes 0."""
    if r.get("update_zero"):
        return "0 exactly, no step taken (the update is exactly zero)"
    ok = r.get("pred_consistent")
    agree = "consistent" if ok else "NOT consistent"
    z, df = r.get("z_true_minus_pred"), r.get("df_true_minus_pred")
    if not _finite(z):
        return agree
    if not (_finite(df) and df >= 1):
        return f"{agree} (|t| {abs(z):.2f})" + _rounding_floor(r)
    return f"{agree}: |t| {abs(z):.2f} {'<' if ok else '>'} {t_quantile(df):.2f} ({df:g} df)" + _rounding_floor(r)


def _below_rounding_floor(r: dict) -> bool:
    """The paired SE is mostly the forward passes' rounding bound: ``rounding_true_minus_pred``
    above the sampling SE ``SE_deltaH_true_minus_pred_sampling``."""
    R, se = r.get("rounding_true_minus_pred"), r.get("SE_deltaH_true_minus_pred_sampling")
    return _finite(R) and _finite(se) and R > se


def _lower_precision(r: dict) -> str:
    """The forward passes' dtype when it is coarser than fp32 (``forward_dtype``: bf16 autocast,
    bf16 / fp16 weights), else ""."""
    dt = r.get("forward_dtype")
    return dt if dt and dt not in ("float32", "float64") else ""


def _rounding_floor(r: dict) -> str:
    """When the paired SE is mostly the rounding bound (``_below_rounding_floor``), the test resolves
    nothing at this lr: say so, with the dtype when it is coarser than fp32, the smallest lr at
    which it would (``lr_floor_true_minus_pred``) and, for fp32 passes, that fp64 ones
    (``model.dtype=float64``, runtime/wide_forward.py) have a far lower floor."""
    if not _below_rounding_floor(r):
        return ""
    floor = r.get("lr_floor_true_minus_pred")
    at = f"; it resolves from lr ~{floor:.1g}" if _finite(floor) else ""
    dt = _lower_precision(r)
    wider = "; model.dtype=float64 lowers the floor" if r.get("forward_dtype") == "float32" else ""
    return f", below the {dt + ' ' if dt else ''}rounding floor: not resolved at this lr{at}{wider}"


def precision_breaks_pairing(r: dict) -> str:
    """The flag's message when a dtype coarser than fp32 (``forward_dtype``) makes the paired test
    resolve nothing: its rounding bound R exceeds the sampling SE of measured - predicted, so
    ``SE(diff) = sqrt(SE_sampling^2 + R^2)`` is rounding, not the step, and SE(diff) / SE(pred)
    says how much of the pairing is left; "" otherwise (fp32, or above the floor)."""
    dt = _lower_precision(r)
    if not dt or r.get("measurable") is False or not _below_rounding_floor(r):
        return ""
    R, se_s = r["rounding_true_minus_pred"], r["SE_deltaH_true_minus_pred_sampling"]
    se_d, se_p, floor = r.get("SE_deltaH_true_minus_pred"), r.get("SE_deltaH_pred"), r.get("lr_floor_true_minus_pred")
    ratio = f"; SE(diff) / SE(pred) = {se_d / se_p:.2g}" if _finite(se_d) and _finite(se_p) and se_p > 0 else ""
    at = f" it resolves from lr ~{floor:.1g}, or" if _finite(floor) else ""
    return (f"under {dt} the forward passes' rounding bound on measured - predicted ({R:.2g}) exceeds its "
            f"sampling SE ({se_s:.2g}){ratio}: the paired test's SE is {dt} rounding, not the step's noise, "
            f"so 'consistent' means 'not resolved';{at} run it in fp32 (model.autocast=off, model.dtype=float32). "
            "The prediction and its SE stand.")


def setup_line(r: dict) -> str:
    """What was probed, in one line (the verdict's first): the task, its reward, the objective
    (the loss whose step is predicted) and the entropy functional; "" when the results name none."""
    named = (("task", "task"), ("reward", "task_reward"), ("objective", "objective"),
             ("entropy functional", "entropy_functional"))
    return " · ".join(f"{label} {r[key]}" for label, key in named if r.get(key) not in (None, ""))


def verdict_lines(r: dict) -> list[tuple[str, str, str, str]]:
    """Rows (what, value +- SE, 95% interval, what it is) of the headline."""
    rows = []
    if r.get("update_zero"):
        rows.append(("predicted", _pm(r.get("deltaH_pred"), r.get("SE_deltaH_pred")),
                     _ci(r, "ci95_pred_low", "ci95_pred_high"), "the update is exactly zero: nothing moves"))
        if "deltaH_true" in r:
            rows.append(("measured", _pm(r["deltaH_true"], r.get("SE_deltaH_true")),
                         _ci(r, "ci95_true_low", "ci95_true_high"), "no step taken: a zero update changes nothing"))
    elif "deltaH_pred" in r:
        parts = {k: r.get(f"deltaH_pred_{k}") for k in ("gradient", "momentum", "weight_decay")}
        split = ", ".join(f"{k.replace('_', ' ')} {v:+.2g}" for k, v in parts.items() if _finite(v))
        dom = r.get("pred/dominant_part")
        H = r.get("H_orig")  # the change relative to the entropy
        rel = f" ({100 * r['deltaH_pred'] / H:+.3g}% of H)" if _finite(H) and H > 0 and _finite(r["deltaH_pred"]) else ""
        note = f"first order, the optimizer's step on U{rel}" + (f": {split}; {dom.replace('_', ' ')} dominates"
                                                                if split and dom else "")
        rows.append(("predicted", _pm(r["deltaH_pred"], r.get("SE_deltaH_pred")),
                     _ci(r, "ci95_pred_low", "ci95_pred_high"), note))
        rows += [row for row in [sign_plan_row(r)] if row]  # the batch size that resolves its sign
    if r.get("measurable") is False:
        rows.append(("measured", "unmeasurable", "", f"one real step: {r.get('unmeasurable_reason', '')}"))
        if _finite(r.get("deltaH_resample")):
            rows.append(("resampled", _pm(r["deltaH_resample"], r.get("SE_deltaH_resample")),
                         _ci(r, "ci95_resample_low", "ci95_resample_high"),
                         "fresh responses drawn after the step (not paired with the prediction)"))
    elif "deltaH_true" in r and not r.get("update_zero"):
        rows.append(("measured", _pm(r["deltaH_true"], r.get("SE_deltaH_true")), _ci(r, "ci95_true_low", "ci95_true_high"),
                     f"one real step, E re-weighted ({r.get('is_mode', '')}, ESS/N {r.get('ESS_frac', float('nan')):.2f})"))
    if "SE_deltaH_true_minus_pred" in r and r.get("measurable") is not False:
        rows.append(("difference", _pm(r["deltaH_true_minus_pred"], r["SE_deltaH_true_minus_pred"]),
                     _ci(r, "ci95_true_minus_pred_low", "ci95_true_minus_pred_high"),
                     f"measured - predicted on the same responses: {paired_test(r)}"))
    if "deltaH1" in r and not deltaH1_untrusted(r):  # else left out, with a flag saying why
        rows.append(("deltaH1", _pm(r["deltaH1"], r.get("SE_deltaH1")), _ci(r, "ci95_low", "ci95_high"),
                     deltaH1_note(r)))
    return rows


def _what_if_label(key: str, w: dict) -> str:
    """What a what-if setting is, in words."""
    kind = w.get("setting")
    if kind == "lr":
        return f"lr x {w['lr_factor']:g} (lr {w['lr']:.3g})"
    if kind == "entropy_coef":
        return f"entropy bonus, coefficient {w['entropy_coef']:g} (H_bonus {w.get('H_bonus', float('nan')):.3g})"
    if kind == "clip_cov":
        return f"Clip-Cov, {w['masked_tokens']} of {w['tokens']} U tokens detached"
    if kind == "top_entropy_quantile":
        return f"TRL top_entropy_quantile, {w['masked_tokens']} of {w['tokens']} U tokens detached"
    if kind == "kl_cov":
        return f"KL-Cov, {w['penalised_tokens']} of {w['tokens']} U tokens: {w.get('note', '')}"
    return key


def what_if_lines(r: dict) -> list[tuple[str, str, str, str]]:
    """Rows (setting, predicted +- SE, 95% interval, what it is; measured where it was) of
    ``probe.what_if`` (empty without it)."""
    rows = []
    for key, w in (r.get("what_if") or {}).items():
        if w.get("setting") == "lr_for_target":
            if w.get("status") == "resolved":
                rows.append((key, f"lr {w['lr_star']:.3g} ± {w['SE_lr_star']:.2g}",
                             f"[{w['ci95_lr_low']:.3g}, {w['ci95_lr_high']:.3g}]",
                             f"the lr whose predicted change is {w['target_deltaH']:+.3g}"))
            else:
                rows.append((key, "not resolved", "", w.get("status", "").removeprefix("not resolved: ")))
            continue
        what = _what_if_label(key, w)
        if "deltaH_true" in w:
            if w.get("measurable") is False:
                what += "; measured: unmeasurable"
            else:
                agree = {True: "consistent with the prediction", False: "NOT consistent with the prediction"}.get(
                    w.get("pred_consistent"), "not tested against the prediction (no paired SE: "
                                              "probe.variance_enabled=false)")
                what += f"; measured {_pm(w['deltaH_true'], w.get('SE_deltaH_true'))}, {agree}"
        rows.append((key, _pm(w["deltaH_pred"], w.get("SE")), _ci(w, "ci95_low", "ci95_high"), what))
    return rows


def title(r: dict) -> str:
    """What the verdict's numbers are: the functional and the entropy they change."""
    H = r.get("H_orig")
    return (f"entropy change of the next step — {r.get('weighting_mode', '')} functional, nats "
            f"(H = {H:.4g}; ± is 1 SE, [ ] a 95% t interval)" if _finite(H)
            else "entropy change of the next step (± is 1 SE, [ ] a 95% t interval)")


def verdict_markdown(r: dict, fl: list[Flag]) -> str:
    """The same verdict as ``print_verdict`` as markdown: the title, a table of the headline rows,
    the flags as a list."""
    setup = [setup_line(r), ""] if setup_line(r) else []
    out = [*setup, f"**{title(r)}**", "", "| | value ± SE | 95% interval | what it is |", "|---|---:|:---:|---|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in verdict_lines(r)]
    out.append("")
    if what_if_lines(r):
        out += ["| what if | predicted ± SE | 95% interval | what it is |", "|---|---:|:---:|---|"]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in what_if_lines(r)]
        out.append("")
    out += [f"- **{code}**: {msg}" for code, msg in fl] or ["No flags: nothing the verdict warns about."]
    return "\n".join(out) + "\n"


def print_verdict(r: dict, fl: list[Flag], phases: dict[str, float] | None = None) -> None:
    """What was probed (``setup_line``), then a short panel: the headline rows, the entropy they
    refer to, the flags, one line of phase times."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(justify="center")
    t.add_column(style="dim")
    for row in verdict_lines(r):
        t.add_row(*row)
    con = Console(width=140)
    if setup_line(r):
        con.print(setup_line(r), markup=False, highlight=False, soft_wrap=True)  # one line, never wrapped
    con.print(Panel(t, title=title(r), expand=False))
    if what_if_lines(r):
        w = Table(show_header=False, box=None, pad_edge=False)
        for style, justify in (("bold", "left"), (None, "right"), (None, "center"), ("dim", "left")):
            w.add_column(style=style, justify=justify)
        for row in what_if_lines(r):
            w.add_row(*row)
        con.print(Panel(w, title="what if (the same step model, other settings)", expand=False))
    for code, msg in fl:
        con.print(f"[yellow]! {code}[/yellow]: {msg}")
    if phases:
        con.print("phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in phases.items()), style="dim")
