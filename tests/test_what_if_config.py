"""``probe.what_if`` as a user meets it (docs/what_if.md): the verdict and report show the settings
only when set, the config is off by default and each bad value is one ConfigError naming its key
(also on the composed DictConfig and under torchrun), and the README's what-if command measures
each setting paired with its prediction (a deterministic computation on committed inputs)."""
from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from entprobe.config import ConfigError, EntprobeConfig, WhatIfConfig, register_configs
from entprobe.pipeline.config_checks import WHAT_IF_MAX, validate
from entprobe.pipeline.stages.what_if import KL_COV_NOTE

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the verdict and the report
BASE = {"deltaH_pred": 3.49e-6, "SE_deltaH_pred": 1.9e-6, "ci95_pred_low": -1e-6, "ci95_pred_high": 8e-6,
        "H_orig": 0.3, "weighting_mode": "dr_grpo"}
WHAT_IF = {
    "lr_x2": {"setting": "lr", "lr_factor": 2.0, "lr": 2e-7, "deltaH_pred": 7e-6, "SE": 4e-6, "ci95_low": -2e-6,
              "ci95_high": 1.6e-5, "deltaH_true": 6.9e-6, "SE_deltaH_true": 4e-6, "measurable": True,
              "deltaH_true_minus_pred": -4e-8, "SE_deltaH_true_minus_pred": 4.6e-8, "pred_consistent": True},
    "kl_cov=0.01": {"setting": "kl_cov", "kl_cov": 0.01, "penalised_tokens": 1, "tokens": 37, "note": KL_COV_NOTE,
                    "deltaH_pred": 3.49e-6, "SE": 1.9e-6, "ci95_low": -1e-6, "ci95_high": 8e-6},
    "lr_for_target": {"setting": "lr_for_target", "target_deltaH": 1e-5, "lr": 1e-7, "lr_star": 2.9e-7,
                      "SE_lr_star": 1e-7, "ci95_lr_low": 1e-7, "ci95_lr_high": 1e-6, "status": "resolved"}}


def test_verdict_and_report_show_the_what_if_settings_only_when_set(capsys):
    from entprobe.reporting.markdown import render
    from entprobe.reporting.tables import console_table
    from entprobe.reporting.verdict import verdict_markdown, what_if_lines

    assert what_if_lines(BASE) == [] and "what if" not in verdict_markdown(BASE, [])
    assert "## What-if" not in render(BASE, [], {}, {})
    r = {**BASE, "what_if": WHAT_IF}
    rows = what_if_lines(r)
    assert [row[0] for row in rows] == ["lr_x2", "kl_cov=0.01", "lr_for_target"]
    assert rows[0][1:3] == ("+7e-06 ± 4e-06", "[-2e-06, 1.6e-05]")
    assert rows[0][3] == "lr x 2 (lr 2e-07); measured +6.9e-06 ± 4e-06, consistent with the prediction"
    assert rows[1][3].startswith("KL-Cov, 1 of 37 U tokens: equal to the plain step")
    assert rows[2][1:] == ("lr 2.9e-07 ± 1e-07", "[1e-07, 1e-06]", "the lr whose predicted change is +1e-05")
    md = verdict_markdown(r, [])
    assert md.index("| predicted |") < md.index("| what if |") < md.index("| lr_x2 |")
    report = render(r, [], {}, {})
    assert "## What-if" in report and "| `lr_x2` | 7e-06 | 4e-06 |" in report and KL_COV_NOTE in report
    assert "lr for a predicted change of 1e-05: 2.9e-07 (SE 1e-07, 95% interval [1e-07, 1e-06])" in report
    unresolved = {**r, "what_if": {"lr_for_target": {**WHAT_IF["lr_for_target"], "status": "not resolved: why"}}}
    assert what_if_lines(unresolved) == [("lr_for_target", "not resolved", "", "why")]
    console_table(r)  # the nested what_if is the verdict's, not a table row
    assert "what_if" not in capsys.readouterr().out


def test_a_measurement_without_a_paired_se_is_not_called_inconsistent():
    """With ``probe.variance_enabled=false`` a measured setting has no per-prompt contributions, so
    no paired test (no ``pred_consistent``): the verdict said "NOT consistent with the prediction"
    for a measurement 0.3% from it; it says no test was made."""
    from entprobe.reporting.verdict import what_if_lines

    untested = {k: v for k, v in WHAT_IF["lr_x2"].items() if k not in ("SE_deltaH_true_minus_pred", "pred_consistent")}
    (row,) = what_if_lines({**BASE, "what_if": {"lr_x2": untested}})
    assert row[3] == ("lr x 2 (lr 2e-07); measured +6.9e-06 ± 4e-06, not tested against the prediction (no paired "
                      "SE: probe.variance_enabled=false)")
    (row,) = what_if_lines({**BASE, "what_if": {"lr_x2": {**WHAT_IF["lr_x2"], "pred_consistent": False}}})
    assert row[3].endswith("NOT consistent with the prediction")


def test_a_step_whose_importance_weights_all_underflow_is_unmeasurable():
    """A large what-if lr factor (measured: lr_factors=[1e6] with measure=true on the README's
    command) puts every importance weight at 0: the measurement is unmeasurable (ESS/N, k-hat),
    where it was a ZeroDivisionError traceback (max weight / mean weight)."""
    from entprobe.pipeline.stages.ground_truth import measurability

    zero = {"ESS_frac": 0.125, "psis_khat": 0.9, "is/w_max": 0.0, "is/mean_importance_ratio": 0.0}
    assert measurability(zero, 0.3) == "ESS/N 0.12 < 0.3; k-hat 0.90 > 0.7"


# ---------------------------------------------------------------- the config
def _cfg(**what_if) -> EntprobeConfig:
    cfg = EntprobeConfig()
    cfg.probe.what_if = WhatIfConfig(**what_if)
    return cfg


def test_what_if_is_off_by_default():
    assert not EntprobeConfig().probe.what_if.enabled
    validate(EntprobeConfig())


@pytest.mark.parametrize("what_if,key", [
    ({"lr_factors": [0.0]}, "probe.what_if.lr_factors"),
    ({"entropy_coef": [-0.1]}, "probe.what_if.entropy_coef"),
    ({"clip_cov": [1.5]}, "probe.what_if.clip_cov"),
    ({"kl_cov": [0.0]}, "probe.what_if.kl_cov"),
    ({"top_entropy_quantile": [1.5]}, "probe.what_if.top_entropy_quantile"),
    ({"target_deltaH": 0.0}, "probe.what_if.target_deltaH"),
    ({"clip_cov": [0.1], "clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, "probe.what_if.clip_cov_lb"),
    ({"measure": True}, "probe.what_if.measure"),
    ({"lr_factors": [2.0, 2.0]}, "probe.what_if.lr_factors"),  # one results key: one value was lost
    ({"lr_factors": [1.0000001, 1.0]}, "probe.what_if.lr_factors"),  # both lr_x1
    ({"clip_cov": [0.1, 0.1]}, "probe.what_if.clip_cov"),
    ({"clip_cov": [0.1], "seed": 10**23}, "probe.what_if.seed"),  # was torch's OverflowError after the passes
    # with measure=true these ended in tracebacks naming no setting: lr x 1e308 is no float32 step size
    # (torch's RuntimeError in the step), a 1e30 bonus's gradient squared overflows Adam's second moment
    ({"lr_factors": [1e308], "measure": True}, "probe.what_if.lr_factors: has 1e+308; give values <= 1e+06"),
    ({"entropy_coef": [1e30], "measure": True}, "probe.what_if.entropy_coef: has 1e+30; give values <= 1e+06"),
    ({"lr_factors": [2.0, 1e6 * (1 + 1e-15)]}, "probe.what_if.lr_factors: has 1000000.000000001"),
])
def test_bad_what_if_values_are_one_config_error_naming_the_key(what_if, key):
    with pytest.raises(ConfigError) as exc:
        validate(_cfg(**what_if))
    assert str(exc.value).startswith(key) and "\n" not in str(exc.value)


def test_what_if_scales_up_to_the_limit_pass():
    """The limit itself is accepted, with measure on (the case it guards) and off; the next float
    above it is refused naming it."""
    assert WHAT_IF_MAX == 1e6
    for measure in (False, True):
        cfg = _cfg(lr_factors=[WHAT_IF_MAX], entropy_coef=[WHAT_IF_MAX, 0.0], measure=measure)
        assert validate(cfg) is None
        assert list(cfg.probe.what_if.lr_factors) == [WHAT_IF_MAX]  # validate leaves the values as given
    with pytest.raises(ConfigError, match=r"^probe.what_if.lr_factors: has 1000000.0000000001; give values <= 1e\+06"):
        validate(_cfg(lr_factors=[math.nextafter(WHAT_IF_MAX, math.inf)], measure=True))


def test_token_selecting_settings_are_refused_under_torchrun_before_the_passes(monkeypatch):
    """Clip-Cov / KL-Cov / top_entropy_quantile select over U on one process: under torchrun the
    stage refused them after Stages 1-2 had run; the config check refuses them first."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for what_if in ({"clip_cov": [0.1]}, {"kl_cov": [0.1]}, {"top_entropy_quantile": [0.2]}):
        with pytest.raises(ConfigError, match=r"^probe.what_if.clip_cov/kl_cov/top_entropy_quantile: .*torchrun"):
            validate(_cfg(**what_if))
    validate(_cfg(lr_factors=[2.0], entropy_coef=[0.01]))  # these run on every process


def test_composed_what_if_is_validated_on_the_dictconfig(tmp_path):
    """``validate`` also takes the composed DictConfig (no dataclass properties there)."""
    from conftest import compose_cfg

    validate(compose_cfg(tmp_path, "probe.what_if.lr_factors=[0.5,2]", "probe.what_if.measure=true"))
    with pytest.raises(ConfigError, match=r"^probe.what_if.lr_factors: has 0.0"):
        validate(compose_cfg(tmp_path, "probe.what_if.lr_factors=[0]"))


def test_what_if_is_refused_in_single_batch_mode_and_measure_needs_the_reused_gradient():
    cfg = _cfg(lr_factors=[2.0])
    cfg.probe.mode = "single_batch"
    with pytest.raises(ConfigError, match="probe.what_if: is set with probe.mode=single_batch"):
        validate(cfg)
    cfg = _cfg(lr_factors=[2.0], measure=True)
    cfg.importance.reuse_probe_gradient = False
    with pytest.raises(ConfigError, match="importance.reuse_probe_gradient=true"):
        validate(cfg)


# ---------------------------------------------------------------- end to end (the documented command)
def _readme_what_if_command() -> list[str]:
    """docs/what_if.md's command (it was the README's before the README moved detail to docs/)."""
    text = (ROOT / "docs" / "what_if.md").read_text()
    (cmd,) = [c for c in text.split("```bash")[1:] if "probe.what_if" in c.split("```")[0]]
    line = " ".join(x.rstrip("\\").strip() for x in cmd.split("```")[0].strip().splitlines())
    return shlex.split(line)


def test_readme_what_if_command_measures_each_setting_paired_with_its_prediction(tmp_path, monkeypatch):
    """docs/what_if.md's what-if command, composed as ``python -m entprobe.main`` does and run in
    process on the committed model and batches: every setting's real step agrees with its
    prediction (paired interval holds 0, SE of the difference a small fraction of the
    measurement's), lr x f is f times the plain prediction, KL-Cov is the plain one with its note,
    and the entropy bonus and Clip-Cov change the prediction."""
    from entprobe.cli.probe_job import run

    cmd = _readme_what_if_command()
    assert cmd[:3] == ["python", "-m", "entprobe.main"]
    monkeypatch.chdir(ROOT)  # the command's paths are the repository's
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "src" / "entprobe" / "conf")):
            cfg = compose(config_name="config", overrides=[*cmd[3:], f"run_dir='{tmp_path}'", "model.device=cpu",
                                                           "logging.wandb.mode=disabled", "logging.progress=false"])
    finally:
        GlobalHydra.instance().clear()
    res = run(cfg)
    w = res["what_if"]
    assert set(w) == {"lr_x0.5", "lr_x2", "entropy_coef=0.001", "clip_cov=0.0002", "kl_cov=0.0002", "lr_for_target"}
    for f in (0.5, 2.0):  # a power of 2: f times the headline is exact in fp64
        r = w[f"lr_x{f:g}"]
        assert (r["deltaH_pred"], r["SE"], r["SE_expected"]) == (
            f * res["deltaH_pred"], f * res["SE_deltaH_pred"], f * res["SE_deltaH_pred_expected"])
    kl = w["kl_cov=0.0002"]
    assert kl["deltaH_pred"] == res["deltaH_pred"] and kl["note"] == KL_COV_NOTE and "deltaH_true" not in kl
    for key, r in w.items():  # every setting has its value, SE, interval and how it was formed
        assert key == "lr_for_target" or {"deltaH_pred", "SE", "ci95_low", "ci95_high", "df", "how"} <= set(r), key
    assert w["entropy_coef=0.001"]["deltaH_pred"] != res["deltaH_pred"]
    assert w["clip_cov=0.0002"]["masked_tokens"] == 1 and w["clip_cov=0.0002"]["deltaH_pred"] != res["deltaH_pred"]
    for key in ("lr_x0.5", "lr_x2", "entropy_coef=0.001", "clip_cov=0.0002"):
        r = w[key]
        assert r["measurable"] is True and r["pred_consistent"] is True, (key, r)
        assert r["SE_deltaH_true_minus_pred"] < 0.05 * r["SE_deltaH_true"], (key, r)
    t = w["lr_for_target"]
    assert t["status"] == "resolved" or t["status"].startswith("not resolved"), t
    assert (tmp_path / "results.json").is_file()


def test_with_gradient_clipping_lr_factors_are_scaled_not_restepped(tmp_path, monkeypatch):
    """``importance.max_grad_norm``: the clipped AdamW step is in closed form and linear in the lr
    (the clip factor does not depend on it), so ``lr_x<f>`` is f times the plain prediction, not a
    recomputed update; a new update (the entropy bonus) is clipped by its own gradient's norm."""
    from conftest import committed_batches, compose_cfg
    from entprobe.cli.probe_job import run
    from entprobe.pipeline.stages import what_if

    rebuilt = []
    real = what_if.build_step_model
    monkeypatch.setattr(what_if, "build_step_model", lambda *a, **k: rebuilt.append(a[3]) or real(*a, **k))
    res = run(compose_cfg(tmp_path, *committed_batches("readme"), "batch.B_E=8", "batch.B_U=8", "importance.enabled=false",
                          "importance.max_grad_norm=0.5", "optimizer.lr=1e-5", "probe.what_if.lr_factors=[0.5,2]",
                          "probe.what_if.entropy_coef=[0.001]"))
    assert res["pred/step_model"] == "adamw_closed_form" and res["pred/grad_clip_factor"] < 1.0
    w = res["what_if"]
    for f in (0.5, 2.0):
        r = w[f"lr_x{f:g}"]
        assert r["how"] == "scaled (linear in lr)"
        # f times the plain numbers, one fp64 product each (f a power of 2: exact)
        assert (r["deltaH_pred"], r["SE"], r["SE_expected"]) == (
            f * res["deltaH_pred"], f * res["SE_deltaH_pred"], f * res["SE_deltaH_pred_expected"])
    assert len(rebuilt) == 1 and w["entropy_coef=0.001"]["how"] == "recomputed update"  # the bonus's own update
