"""The config surface: what composition rejects, what validate() rejects, and that every shipped YAML
composes onto the typed schema with the values it states."""
from __future__ import annotations

import json
import math
import shutil
from enum import Enum

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from conftest import CONF_DIR, compose_cfg
from entprobe.config import ConfigError
from entprobe.pipeline.config_checks import validate
from entprobe.cli.probe_job import run, to_typed
from entprobe.tasks import build_task
from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint


def error_chain(exc: BaseException) -> str:
    """Every message in the exception chain, as Hydra prints it on the command line."""
    out = []
    while exc is not None:
        out.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(out)


def test_unknown_key_fails_at_compose(tmp_path):
    with pytest.raises(ConfigCompositionException) as info:
        compose_cfg(tmp_path, "batch.foo=1")
    msg = error_chain(info.value)
    assert "batch.foo" in msg and "not in 'BatchConfig'" in msg


def test_appended_unknown_key_is_rejected_before_anything_loads(tmp_path):
    """``+batch.foo=1`` passes Hydra 1.3's compose: ``+`` is applied with ``force_add``, which lifts
    struct mode even on a structured-config node. The schema merge in ``to_typed`` -- the first thing
    run() and main() do, before any model is loaded -- rejects it as a ConfigError naming the
    override (the one the user gave), the nearest key and why '+' does not add it."""
    cfg = compose_cfg(tmp_path, "+batch.BE=1")
    with pytest.raises(ConfigError) as info:
        to_typed(cfg, explicit=["+batch.BE=1"])
    assert str(info.value) == ("+batch.BE=1: batch has no key BE (did you mean batch.B_E?), and '+' cannot add "
                               "one to entprobe's typed config; python -m entprobe.main --help lists every key")
    assert isinstance(info.value.__cause__, ConfigKeyError)
    with pytest.raises(ConfigError, match=r"^batch\.BE: batch has no key BE"):  # no override given: the key
        run(cfg)
    assert not (tmp_path / "results.json").exists()


def test_bad_choice_names_key_and_lists_allowed_values(tmp_path):
    with pytest.raises(ConfigCompositionException) as info:
        compose_cfg(tmp_path, "importance.is_mode=foo")
    msg = error_chain(info.value)
    assert "importance.is_mode" in msg and "expected one of [cv, snis, clip, psis]" in msg
    with pytest.raises(MissingConfigException) as info:
        compose_cfg(tmp_path, "model=nope")
    msg = str(info.value)
    assert "model/nope" in msg and all(opt in msg for opt in ("hf", "smollm2", "tiny"))


def test_clip_mode_reaches_run(tmp_path):
    """With clip_c = 1 some weights are clipped, so clipped IS differs from SNIS and deltaH_true must
    be the clipped estimate."""
    res = run(compose_cfg(tmp_path, "importance.is_mode=clip", "importance.clip_c=1.0"))
    assert res["is_mode"] == "clip"
    assert res["is/clip_fraction"] > 0
    assert res["deltaH_true"] == res["deltaH_clip"]
    assert res["deltaH_clip"] != res["deltaH_snis"]
    assert json.loads((tmp_path / "results.json").read_text())["deltaH_true"] == res["deltaH_clip"]


@pytest.mark.parametrize("override,key", [
    ("batch.G=1", "batch.G"),
    ("batch.B_E=1", "batch.B_E"),
    ("batch.B_U=1", "batch.B_U"),
    ("sampling.temperature=0", "sampling.temperature"),
    ("sampling.top_p=0", "sampling.top_p"),
    ("optimizer.lr=-1e-3", "optimizer.lr"),
    ("model=hf", "model.path"),
])
def test_validate_range_checks_name_the_key(tmp_path, override, key):
    cfg = compose_cfg(tmp_path, override)
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        validate(cfg)
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        to_typed(cfg)


def test_validate_accepts_defaults_and_single_batch_with_one_E_prompt(tmp_path):
    assert validate(compose_cfg(tmp_path)) is None  # raises ConfigError on any range violation
    # E is unused by single_batch without the ground truth ...
    single = compose_cfg(tmp_path, "probe.mode=single_batch", "batch.B_E=1", "importance.enabled=false")
    assert validate(single) is None and single.batch.B_E == 1
    # ... and is the held-out batch the step is measured on with it
    with pytest.raises(ConfigError, match="batch.B_E"):
        validate(compose_cfg(tmp_path, "probe.mode=single_batch", "batch.B_E=1"))
    with pytest.raises(ConfigError, match="probe.cross_fit"):
        validate(compose_cfg(tmp_path, "probe.cross_fit=true"))  # default mode dr_grpo


def _plain(v):
    return v.value if isinstance(v, Enum) else v


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def group_options() -> list[tuple[str, str]]:
    return sorted((str(p.parent.relative_to(CONF_DIR)), p.stem) for p in CONF_DIR.rglob("*.yaml")
                  if p.parent != CONF_DIR)


def test_every_group_option_composes_onto_the_schema(tmp_path):
    """Each YAML of each group composes, passes the schema + validate(), and every value it states
    arrives in the typed config. ``model=hf`` needs model.path; ``task=jsonl`` needs task.path."""
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    extra = {("model", "hf"): [f"model.path='{tmp_path}'"], ("task", "jsonl"): [f"task.path='{jsonl}'"]}
    options = group_options()
    groups = {g for g, _ in options}
    assert {"batch", "sampling", "probe", "importance", "optimizer", "ddp", "model", "task",
            "logging", "experiment"} <= groups
    for group, name in options:
        in_hydra = group.startswith("hydra/")  # e.g. hydra/launcher: lives under the cfg's hydra node
        cfg = compose_cfg(tmp_path, f"{group}={name}", *extra.get((group, name), []),
                          return_hydra_config=in_hydra)
        typed = OmegaConf.structured(to_typed(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])))
        stated = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"))
        stated.pop("defaults", None)
        if group != "experiment":  # experiments are `# @package _global_`
            stated = {group.replace("/", "."): stated}
        for key, want in _flatten(stated).items():
            if want == "???":
                continue
            got = _plain(OmegaConf.select(cfg if in_hydra else typed, key))
            if key in ("batch.B_E", "batch.B_U", "batch.G", "logging.progress", "logging.verdict",
                       "logging.report", "logging.wandb.mode", "model.device"):
                continue  # the test shrink overrides these on purpose
            assert got == want, f"{group}={name}: {key} composed to {got!r}, the YAML says {want!r}"
        if group == "task":
            task = build_task(OmegaConf.to_container(cfg.task))
            assert len(task.prompts) == (1 if name == "jsonl" else cfg.task.num_prompts)
            assert task.reward(task.prompts[0].answer, task.prompts[0]) == 1.0


def test_hf_model_without_optimizer_state_refuses_then_runs_in_identity_geometry(tmp_path):
    """A save_pretrained folder with no optimizer.pt: Adam geometry is refused with the way out
    (optimizer.preconditioner=identity); taking it, deltaH1 = -lr * Xbar . Ybar with the given lr."""
    src = ensure_default_checkpoint()
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in src.iterdir():
        if f.name not in ("optimizer.pt", "scheduler.pt", "trainer_state.json"):
            shutil.copy(f, hf / f.name)
    with pytest.raises(ConfigError, match=r"optimizer\.preconditioner=identity"):
        run(compose_cfg(tmp_path / "a", "model=hf", f"model.path='{hf}'"))
    res = run(compose_cfg(tmp_path / "b", "model=hf", f"model.path='{hf}'", "optimizer.preconditioner=identity",
                          "optimizer.lr=1e-3"))
    assert res["preconditioner"] == "identity" and res["lr"] == 1e-3
    assert res["lr_source"] == "optimizer.lr (config)"
    assert res["model_source"] == f"hf:{hf}"
    assert res["bars_dot"] != 0 and math.isfinite(res["deltaH1"])
    assert res["deltaH1"] == -1e-3 * res["bars_dot"]  # est.delta_h1: the same one fp64 product


def test_report_per_token_puts_per_token_entropy_in_the_headline(tmp_path, capsys):
    from entprobe.cli.probe_job import run

    run(compose_cfg(tmp_path, "importance.report_per_token=true", "logging.console_table=true"))
    out = capsys.readouterr().out
    # headline rows come before the alphabetical rest, which starts with attr/...
    assert out.index("deltaH_true_per_token") < out.index("attr/")


def test_former_group_name_probe_rework_is_read_as_probe(tmp_path):
    """``probe_rework`` (the probe group's former name) still works on the command line, with a
    FutureWarning: every override form is rewritten to ``probe`` and then composes."""
    from entprobe.cli.probe_job import renamed_overrides

    argv = ["probe_rework.projection=jvp", "+probe_rework.x=1", "~probe_rework.top_k_params", "probe_rework=default",
            "batch.B_E=8", "probe.mode=two_batch", "probe_reworked.a=1"]
    with pytest.warns(FutureWarning, match="'probe_rework' is now 'probe'"):
        out = renamed_overrides(argv)
    assert out == ["probe.projection=jvp", "+probe.x=1", "~probe.top_k_params", "probe=default",
                   "batch.B_E=8", "probe.mode=two_batch", "probe_reworked.a=1"]
    assert compose_cfg(tmp_path, out[0]).probe.projection == "jvp"
