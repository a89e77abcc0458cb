"""report.md after a run: the verdict as the console prints it (one source), the headline table, and
PNG plots drawn from per_unit.json, whose per-prompt values give back the headline means and SEs.
A plot that fails is a warning; results.json and report.md are still written."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import compose_cfg, fp_tol
from entprobe.reporting import plots
from entprobe.cli.probe_job import run
from entprobe.reporting.markdown import PLOT_FILES, REPORT_FILE
from entprobe.reporting.verdict import flags, verdict_markdown

PNG = b"\x89PNG\r\n\x1a\n"


def test_report_md_with_plots_and_the_per_prompt_values_behind_the_ses(tmp_path):
    res = run(compose_cfg(tmp_path, "logging.report=true"))
    text = (tmp_path / REPORT_FILE).read_text()
    assert verdict_markdown(res, flags(res)) in text  # the verdict's own text, flags included
    assert f"| `deltaH_pred` | {res['deltaH_pred']:.6g} |" in text
    for name, file in PLOT_FILES.items():
        assert (tmp_path / file).read_bytes()[:8] == PNG, name
        assert f"![{name}]({file})" in text

    # the attribution plot's numbers: the headline split by module kind and by layer, in nats; each
    # split sums to deltaH_pred (per-tensor fp32 dots against the fp64 dot of the whole: ~1e-6)
    for split in ("attr_pred/kind/", "attr_pred/layer/"):
        parts = [v for k, v in res.items() if k.startswith(split)]
        assert len(parts) >= 2 and sum(parts) == pytest.approx(res["deltaH_pred"], rel=1e-5), split

    pu = json.loads((tmp_path / "per_unit.json").read_text())
    # the SEs are these values' sd / sqrt(n); the prediction itself is the fp64 dot of the means, the
    # per-prompt values are fp32 projections (agree to ~1e-6 of their scale)
    for key, mean, se, tol in (("E/deltaH_pred", "deltaH_pred", "SE_deltaH_pred", 1e-5),
                               ("E/deltaH_true", "deltaH_true", "SE_deltaH_true", 1e-9)):
        m, s = plots.mean_se(pu[key])
        assert len(pu[key]) == res["B_E"]
        scale = max(abs(x) for x in pu[key])
        assert m == pytest.approx(res[mean], rel=tol, abs=tol * scale) and s == pytest.approx(res[se], rel=1e-9), key
    lr = res["lr"]
    for key, n, V in (("E/deltaH1", res["B_E"], res["V_X"]), ("U/deltaH1", res["B_U"], res["V_Y"])):
        m, s = plots.mean_se(pu[key])
        scale = max(abs(x) for x in pu[key])
        assert len(pu[key]) == n and m == pytest.approx(res["deltaH1"], rel=1e-5, abs=1e-5 * scale)
        assert s == pytest.approx(lr * math.sqrt(V), rel=1e-6), key
    # TRL / verl names beside ours: the same numbers
    assert res["actor/entropy"] == res["entropy"] == res["token_entropy_orig"]
    assert res["frac_reward_zero_std"] == res["batch_U/frac_zero_var_groups"]
    assert res["completions/mean_length"] == res["response_length/mean"] == pytest.approx(res["batch_U/mean_gen_length"])
    assert res["reward"] == res["critic/score/mean"] == pytest.approx(res["batch_U/reward_mean"])
    lw = pu["E/log_weights"]
    assert len(lw) == res["B_E"] and {len(row) for row in lw} == {res["G"]}
    # token_mean (the default): the responses' whole-sequence weights, ESS within each prompt
    # (ESS_frac_sequence; ESS_frac is that of the per-decision weights the measured change uses)
    ess = [sum(w) ** 2 / sum(x * x for x in w) / len(w) for w in ([math.exp(v) for v in row] for row in lw)]
    # per_unit's log-weights are differences of two fp32 sums of L log-probs (ESS_frac_sequence sums
    # them in fp64): each off by up to eps32 |S| sqrt(L), |S| ~ L H per token (4x headroom for the
    # longest response), and ESS_frac moves by at most 2 max|dl|
    L = res["batch_E/mean_gen_length"]
    tol = 2 * fp_tol(torch.float32, 2 * 4 * L * res["H_orig_per_token"], max(1, round(L)))
    assert sum(ess) / len(ess) == pytest.approx(res["ESS_frac_sequence"], abs=tol)
    assert res["is/weights"] == "per_decision" and 0 < res["ESS_frac"] <= 1


def test_a_failing_plot_is_a_warning_and_the_run_keeps_its_results(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no canvas")

    monkeypatch.setattr(plots, "attribution", broken)
    with pytest.warns(UserWarning, match="plot attribution failed"):
        res = run(compose_cfg(tmp_path, "logging.report=true", "importance.enabled=false"))
    assert json.loads((tmp_path / "results.json").read_text())["deltaH_pred"] == res["deltaH_pred"]
    text = (tmp_path / REPORT_FILE).read_text()
    assert "- attribution: failed: RuntimeError: no canvas" in text
    assert "- importance_weights: no data in this run" in text  # no step taken: no weights
    assert (tmp_path / "projections.png").read_bytes()[:8] == PNG
    assert not (tmp_path / "attribution.png").exists() and not (tmp_path / "importance_weights.png").exists()


def test_no_report_when_switched_off(tmp_path):
    run(compose_cfg(tmp_path, "logging.report=false", "importance.enabled=false", "probe.variance_enabled=false"))
    assert (tmp_path / "results.json").is_file() and not (tmp_path / REPORT_FILE).exists()
    assert not list(tmp_path.glob("*.png"))


def test_trainer_metric_names_on_a_hand_made_batch():
    import torch

    from entprobe.reporting.trainer_metrics import trainer_metrics
    from entprobe.rollouts.sampling import RolloutBatch

    mask = torch.zeros(2, 2, 4, dtype=torch.long)
    for (n, g), L in {(0, 0): 4, (0, 1): 1, (1, 0): 2, (1, 1): 4}.items():
        mask[n, g, :L] = 1
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    U = RolloutBatch(mask, mask, mask, mask.float(), rewards, rewards, torch.arange(2))
    m = trainer_metrics(U, max_new_tokens=4, token_entropy=0.7)
    assert m["frac_reward_zero_std"] == 0.5 and m["reward"] == 0.75 and m["critic/score/min"] == 0.0
    assert m["reward_std"] == pytest.approx(0.5) and m["actor/entropy"] == m["entropy"] == 0.7
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == (2.75, 1.0, 4.0)
    assert m["response_length/clip_ratio"] == 0.5  # two of four responses reached the cap
    assert "entropy" not in trainer_metrics(U, 4, None)


def test_the_verdict_says_what_its_numbers_are_and_what_a_gradient_free_step_is():
    """The title says ± is 1 SE and [ ] a 95% t interval; the predicted row gives the change as a
    share of H; no row is named after the specs ("seeds'"); a zero gradient's step is described
    for the optimizer that takes it (plain SGD's is zero, not "AdamW's momentum")."""
    from entprobe.reporting.verdict import flags, title, verdict_lines

    r = {"H_orig": 2.0, "weighting_mode": "sequence", "deltaH_pred": -0.02, "SE_deltaH_pred": 0.01,
         "ci95_pred_low": -0.04, "ci95_pred_high": 0.0, "deltaH1": -0.3, "SE_deltaH1": 0.1}
    assert "± is 1 SE, [ ] a 95% t interval" in title(r)
    rows = verdict_lines(r)
    assert "(-1% of H)" in rows[0][3] and not any("seeds" in c for row in rows for c in row)
    said = {}
    for kind in ("adamw_closed_form", "sgd_closed_form", "preconditioned_sgd", "optimizer_step"):
        fl = dict(flags({"batch_U/frac_zero_var_groups": 1.0, "pred/step_model": kind}))
        said[kind] = fl["empty_gradient"]
    assert "AdamW's momentum and weight decay only" in said["adamw_closed_form"]
    assert "SGD's momentum buffer" in said["sgd_closed_form"] and "AdamW" not in said["sgd_closed_form"]
    assert "exactly zero" in said["preconditioned_sgd"] and "AdamW" not in said["preconditioned_sgd"]
    assert "AdamW" not in said["optimizer_step"]
