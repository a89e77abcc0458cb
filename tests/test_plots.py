"""The figures, drawn from hand-made numbers (no run): each plot function writes a PNG for normal
and degenerate inputs (a zero step, one lr, NaN SEs, few weights), and what it draws is read back
from the figure (``plots._save`` captured): the headline attribution's bars sum to deltaH_pred,
intervals are the 95% ones the verdict quotes, a sweep's colours mean the same in both panels and
its lines run along lr only, symmetric-log ticks never crowd 0."""
from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from entprobe.math.estimators import t_quantile
from entprobe.reporting import markdown, plots, sweep
from entprobe.reporting.attribution import summarize, write_csv

PNG = b"\x89PNG\r\n\x1a\n"
NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
         "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
         "model.layers.1.input_layernorm.weight", "model.norm.weight", "lm_head.weight"]


@pytest.fixture
def figs(monkeypatch):
    """Every figure a plot function saves, in order (the PNG is still written)."""
    out = []
    save = plots._save

    def keep(fig, path):
        out.append(fig)
        return save(fig, path)
    monkeypatch.setattr(plots, "_save", keep)
    return out


def texts(fig) -> str:
    return " | ".join(t.get_text() for ax in fig.axes for t in ax.texts)


def bar_heights(ax) -> list[float]:
    return [p.get_height() for p in ax.patches]


# ----------------------------------------------------------------------------- attribution
def test_headline_attribution_splits_deltaH_pred_in_nats_and_keeps_the_seeds_apart(tmp_path):
    step_terms = [0.004, -0.01, 0.002, 0.03, -0.001, 1e-5, -2e-4, 0.005]  # Xbar_i . Delta theta_i
    terms = [3.0, -1.0, 2.0, 0.5, 0.25, 0.0, 1.0, -4.0]  # Xbar_i . P_i . Ybar_i
    flat, rows = summarize(NAMES, terms, top_k=3, step_terms=step_terms, lr=1e-3)
    pred = -sum(step_terms)  # deltaH_pred = -Xbar . Delta theta
    kinds = {k.rsplit("/", 1)[1]: v for k, v in flat.items() if k.startswith("attr_pred/kind/")}
    layers = {k.rsplit("/", 1)[1]: v for k, v in flat.items() if k.startswith("attr_pred/layer/")}
    assert set(kinds) == {"attention", "mlp", "embeddings", "norms", "lm_head"}
    assert sum(kinds.values()) == pytest.approx(pred, rel=1e-12) and sum(layers.values()) == pytest.approx(pred, rel=1e-12)
    assert kinds["attention"] == pytest.approx(0.01 - 0.03)  # sign of the entropy change: minus the dot
    assert layers == pytest.approx({"non_layer": -0.004 + 2e-4 - 0.005, "layer_000": 0.01 - 0.002,
                                    "layer_001": -0.03 + 0.001 - 1e-5})
    assert flat["attr_pred/top01/name"] == NAMES[3] and flat["attr_pred/top01/deltaH_pred"] == -0.03
    assert sum(r["pred_share"] for r in rows) == pytest.approx(1.0)
    assert [r["deltaH1_term"] for r in rows] == pytest.approx([-1e-3 * t for t in terms])
    assert sum(v for k, v in flat.items() if k.startswith("attr/kind/")) == pytest.approx(sum(terms))  # the seeds'
    write_csv(rows, tmp_path / "attribution.csv")
    with (tmp_path / "attribution.csv").open() as f:
        header = next(csv.reader(f))
    assert header[:7] == ["parameter", "module", "layer", "kind", "deltaH_pred_term", "pred_share", "deltaH1_term"]


def test_attribution_plot_bars_sum_to_the_headline_and_a_zero_step_says_so(tmp_path, figs):
    flat, _ = summarize(NAMES, [1.0] * len(NAMES), step_terms=[0.004, -0.01, 0.002, 0.03, -0.001, 1e-5, -2e-4, 0.005])
    res = {**flat, "deltaH_pred": -0.02981}
    made, missing = markdown.make_plots(res, tmp_path)
    assert made["attribution"].read_bytes()[:8] == PNG and not missing.get("attribution")
    ax_layer, ax_kind = figs[0].axes
    for ax in (ax_layer, ax_kind):
        assert sum(bar_heights(ax)) == pytest.approx(res["deltaH_pred"], rel=1e-3)
        assert "nats" in ax.get_ylabel()
    assert [t.get_text() for t in ax_layer.get_xticklabels()] == ["0", "1", "outside\nlayers"]
    assert "-0.0298 nats" in figs[0].get_suptitle() and not texts(figs[0]).count("every part is 0")

    zero = {k: 0.0 for k in flat if k.startswith("attr_pred/")} | {"deltaH_pred": 0.0, "norm_PYbar": 0.0}
    made, _ = markdown.make_plots(zero, tmp_path)
    assert made["attribution"].read_bytes()[:8] == PNG
    assert "no U group has reward variance" in texts(figs[-1])  # the note on the empty plot
    momentum_only = {**flat, "deltaH_pred": -0.02981, "norm_PYbar": 0.0}  # no gradient, a momentum step
    markdown.make_plots(momentum_only, tmp_path)
    assert "momentum and weight decay only" in figs[-1].get_suptitle() and "every part" not in texts(figs[-1])
    plots.attribution({}, {}, tmp_path / "empty.png")
    assert "every part is 0" in texts(figs[-1])


# ----------------------------------------------------------------------------- weights and projections
@pytest.mark.parametrize("n", [0, 8, 200])
def test_importance_weights_few_as_a_strip_many_as_a_histogram_with_whole_counts(tmp_path, figs, n):
    lw = np.linspace(-0.5, 0.7, n)
    assert plots.importance_weights(lw, math.nan, 0.9, tmp_path / "w.png", "group").read_bytes()[:8] == PNG
    ax = figs[0].axes[0]
    if n < plots.FEW_WEIGHTS:
        assert not ax.patches and not len(ax.get_yticks())  # points, no bars, no count axis
    else:
        assert len(ax.patches) > 5
        assert all(float(t).is_integer() for t in ax.get_yticks())


def test_projections_bands_are_95_percent_and_E_and_U_prompts_get_their_own_axes(tmp_path, figs):
    E = [0.1, -0.2, 0.05, 0.3, -0.1, 0.0, 0.2, -0.05]
    meas = [x + 0.01 for x in E]
    rows = [[("step", "prompt of E", {"predicted": E, "measured": meas}, {"predicted": (-0.5, 0.4)})],
            [("E", "prompt of E", {"E": E}, {}), ("U", "prompt of U", {"U": [1.0, 2.0, float("nan")]}, {})]]
    plots.projections(rows, tmp_path / "p.png")
    step, ax_e, ax_u = figs[0].axes
    bands = [(p.get_y(), p.get_y() + p.get_height()) for p in step.patches]
    assert bands[0] == pytest.approx((-0.5, 0.4))  # the interval given (the verdict's)
    m, se = plots.mean_se(meas)
    h = t_quantile(len(meas) - 1) * se  # else the t interval of the values
    assert bands[1] == pytest.approx((m - h, m + h))
    assert ax_e.get_xlabel() == "prompt of E" and ax_u.get_xlabel() == "prompt of U"
    assert not ax_u.patches  # NaN SE: no band, still a figure
    assert len(step.lines) >= 2 + len(E)  # the pairs: one thin line per prompt
    assert not texts(figs[0])
    plots.projections([[("zero gradient", "prompt of U", {"U": [0.0] * 4}, {})]], tmp_path / "z.png")
    assert "every value is exactly 0" in texts(figs[-1]) and figs[-1].axes[0].get_ylim() == (-1, 1)


# ----------------------------------------------------------------------------- sweep
def sweep_rows(lrs=(1e-6, 1e-5, 1e-4, 1e-3), b_es=(8, 16)) -> list[dict]:
    rows = []
    for b in b_es:
        for lr in lrs:
            p = -0.07 * lr / 1e-6
            rows.append({"status": "ok", "lr": lr, "B_E": b, "B_U": 8, "deltaH_pred": p, "SE_deltaH_pred": abs(p) / 2,
                         "deltaH_true": p if lr < 1e-4 else 0.5, "SE_deltaH_true": 0.1})
    return rows


def test_sweep_summary_colours_series_alike_in_both_panels_lines_along_lr_95_percent_bars(tmp_path, figs):
    rows = sweep_rows()
    assert sweep.plot_summary(rows, tmp_path / "s.png").read_bytes()[:8] == PNG
    ax_raw, ax_per = figs[0].axes
    labels = [t.get_text() for t in ax_raw.get_legend().get_texts()]
    assert labels == ["predicted B_E=8", "measured B_E=8", "predicted B_E=16", "measured B_E=16"]
    lines = [c for c in ax_raw.containers]  # one errorbar container per series and quantity
    colours = [c.lines[0].get_color() for c in lines]
    assert colours[0] == colours[1] != colours[2] == colours[3]  # a series' one colour
    assert colours == [c.lines[0].get_color() for c in ax_per.containers]  # the same in both panels
    for c in lines:
        assert np.all(np.diff(c.lines[0].get_xdata()) > 0)  # along lr, in order
    # the bars are the 95% interval: t with B_E - 1 degrees of freedom times the SE
    seg = lines[0].lines[2][0].get_segments()[0]
    assert seg[1][1] - seg[0][1] == pytest.approx(2 * t_quantile(7) * rows[0]["SE_deltaH_pred"])
    assert ax_raw.get_yscale() == "symlog" and ax_per.get_yscale() == "linear"
    assert "nats" in ax_raw.get_ylabel() and "per unit lr" in ax_per.get_ylabel()


@pytest.mark.parametrize("case", ["one lr", "NaN SEs", "no measurement"])
def test_sweep_plot_on_degenerate_rows(tmp_path, figs, case):
    rows = sweep_rows(lrs=(3e-5,)) if case == "one lr" else sweep_rows(b_es=(8,))
    if case == "NaN SEs":
        rows = [{**r, "SE_deltaH_pred": math.nan, "SE_deltaH_true": math.nan} for r in rows]
    if case == "no measurement":
        rows = [{**r, "deltaH_true": math.nan} for r in rows]
    assert sweep.plot_summary(rows, tmp_path / "s.png").read_bytes()[:8] == PNG
    ax_raw = figs[0].axes[0]
    legend = [t.get_text() for t in ax_raw.get_legend().get_texts()]
    if case == "one lr":
        assert all(c.lines[0].get_linestyle() == "None" for c in ax_raw.containers)  # no line between settings
        lo, hi = ax_raw.get_xlim()
        assert lo < 1e-5 and hi > 3e-5 * 3  # a labelled decade, not a zoom onto one point
    if case == "NaN SEs":
        assert all("no interval" in t for t in legend)
    if case == "no measurement":
        assert legend == ["predicted"]


def test_symlog_ticks_leave_the_band_around_zero_to_zero(figs):
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    values = [-70.0, -7.0, -0.07, 0.002, 0.3, 7.0]
    assert plots.symlog_y(ax, values)
    ticks = list(ax.get_yticks())
    thresh = ax.yaxis.get_transform().linthresh
    assert 0.0 in ticks and len(ticks) <= 11
    assert all(abs(t) > thresh for t in ticks if t)  # nothing crowds the 0 label
    assert min(abs(t) for t in ticks if t) > 0.002 and max(ticks) >= 7.0
    assert not plots.symlog_y(Figure().subplots(), [0.1, -0.2, 0.5])  # one decade: stays linear


# ----------------------------------------------------------------------------- benchmarks/lr_sweep.py
def test_lr_sweep_figure_titles_by_folder_name_and_redraws_from_its_csv(tmp_path, figs):
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lr_sweep.py"
    spec = importlib.util.spec_from_file_location("lr_sweep_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    a = argparse.Namespace(builtin=False, checkpoint=str(tmp_path / "ck" / "smollm2_adamw"), B_E=6, B_U=6, G=4,
                           max_new_tokens=8, weighting_mode="sequence")
    header = bench.header_of(a)
    assert header.startswith("smollm2_adamw:") and str(tmp_path) not in header
    rows = []
    for lr, p, t in ((1e-6, -0.07, -0.071), (1e-4, -7.0, -5.2), (1e-3, -70.0, 0.28)):
        r = {**{k: math.nan for k in bench.KEYS}, **{k: "" for k in bench.EXTRA}, "lr": lr, "status": "ok",
             "error": "", "wall_s": 1.0, "stage12_s": 0.0, "deltaH_pred": p, "SE_deltaH_pred": abs(p),
             "ci95_pred_low": p - 3 * abs(p), "ci95_pred_high": p + 3 * abs(p), "deltaH_true": t,
             "SE_deltaH_true": math.nan, "deltaH1": 25 * p, "deltaH_true_minus_pred": t - p}
        rows.append(r)
    bench.write_csv(rows, tmp_path / "lr_sweep.csv")
    back = bench.read_csv(tmp_path / "lr_sweep.csv")
    assert back[0]["deltaH_pred"] == -0.07 and back[0]["status"] == "ok"
    bench.write_png(back, tmp_path / "lr_sweep.png", header)
    assert (tmp_path / "lr_sweep.png").read_bytes()[:8] == PNG
    ax = figs[-1].axes[0]
    assert ax.get_title() == header and "nats" in ax.get_ylabel() and ax.get_yscale() == "symlog"
    thresh = ax.yaxis.get_transform().linthresh
    assert all(abs(t) > thresh for t in ax.get_yticks() if t)  # no label beside 0's
    seg = ax.containers[0].lines[2][0].get_segments()[0]  # the run's own 95% interval
    assert (seg[0][1], seg[1][1]) == pytest.approx((-0.07 - 0.21, -0.07 + 0.21))
