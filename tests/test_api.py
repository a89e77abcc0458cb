"""``entprobe.probe`` on a model and optimizer in memory against the command line on the same checkpoint.

The built-in default's model and AdamW state are loaded the command line's way (``load_model``,
``load_optimizer``), given some ``.grad`` tensors, a module in eval mode and an RNG state of their
own; the API's results on the CLI's saved batches, and on batches it samples itself from the same
task and seeds, equal the CLI's, and everything the API promises to leave alone is bit-identical after.
"""
from __future__ import annotations

import dataclasses
import re

import json
import math

import pytest
import torch

import entprobe
from conftest import compose_cfg
from entprobe.rollouts.saved_batches import load_batches
from entprobe.config import ConfigError
from entprobe.cli.probe_job import run, to_typed
from entprobe.checkpoints.models import load_model
from entprobe.checkpoints.optim_state import load_optimizer
from entprobe.checkpoints.preflight import check_inputs
from entprobe.pipeline.stages.snapshot import state_fingerprint
from entprobe.tasks import build_task

QUIET = {"logging": {"progress": False, "verdict": False, "report": False}}
# differ by construction: where things came from (the task too: passed in, not a config's), wall
# time and memory
SOURCE_KEYS = {"model_source", "batch_source", "lr_source", "optimizer_path", "lr_last_step", "optimizer_format",
               "task", "task_reward"}


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """The CLI's run on the shrunk default (its batches saved) and its typed config."""
    tmp = tmp_path_factory.mktemp("cli")
    cfg = compose_cfg(tmp / "run", f"batch.save='{tmp / 'batches'}'")
    return run(cfg), to_typed(cfg), tmp / "batches"


def loaded_like_the_cli(cfg):
    """The default model and its AdamW, loaded as the command line loads them."""
    lm = load_model(cfg.model)
    opt = load_optimizer(lm.model, check_inputs(cfg).optimizer_state).optimizer
    return lm.model, opt, lm.tokenizer


def everything(model, opt) -> dict:
    """What the API must leave alone, cloned."""
    return {"state": state_fingerprint(list(model.parameters()), opt),
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "modes": [m.training for m in model.modules()], "rng": torch.get_rng_state(),
            "opt_keys": sorted(opt.__dict__)}


def assert_same(before: dict, after: dict) -> None:
    for a, b in zip(before["state"], after["state"], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(before["grads"], after["grads"], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert before["groups"] == after["groups"] and before["modes"] == after["modes"]
    assert torch.equal(before["rng"], after["rng"]) and before["opt_keys"] == after["opt_keys"]


def assert_results_equal(api: dict, cli: dict) -> None:
    keys = {k for k in cli if not k.startswith(("time/", "mem/")) and k not in SOURCE_KEYS}
    assert keys <= set(api), keys - set(api)
    for k in sorted(keys):
        a, c = api[k], cli[k]
        if isinstance(c, float) and math.isnan(c):
            assert math.isnan(a), k
        else:
            assert a == c, (k, a, c)


def test_api_equals_the_cli_and_leaves_model_and_optimizer_as_they_were(cli):
    res_cli, cfg, batches = cli
    model, opt, tok = loaded_like_the_cli(cfg)
    gen = torch.Generator().manual_seed(5)
    for p in list(model.parameters())[::3]:  # a training loop's gradients, there when the probe is called
        p.grad = torch.randn(p.shape, generator=gen)
    model.model.layers[0].eval()  # modes are restored module by module
    torch.manual_seed(1234)
    before = everything(model, opt)

    E, U, _ = load_batches(batches, 60)
    res = entprobe.probe(model, opt, tok, (E, U), **QUIET)
    assert_same(before, everything(model, opt))
    assert_results_equal(res, res_cli)
    assert res["batch_source"] == "given" and res["lr_source"] == "optimizer param_groups (in memory)"
    assert (res["task"], res["task_reward"]) == ("batches passed in", "the batches' own (their advantages)")
    for k in ("deltaH1", "SE_deltaH1", "deltaH_pred", "SE_deltaH_pred", "deltaH_true", "SE_deltaH_true"):
        assert math.isfinite(res[k]) and res[k] != 0, k

    # sampling itself from the same task and seeds: the same batches, the same numbers
    task = build_task(cfg.task.__dict__)
    res = entprobe.probe(model, opt, tok, task, batch={"B_E": 4, "B_U": 4, "G": 4}, **QUIET)
    assert_same(before, everything(model, opt))
    assert_results_equal(res, res_cli)
    assert res["batch_source"] == "sampled"
    assert (res["task"], res["task_reward"]) == ("entprobe.tasks.arithmetic.ArithmeticTask (passed in)",
                                            "entprobe.tasks.arithmetic.ArithmeticTask.reward")

    # the task by name: the command line's task=arithmetic, built from the same keys
    res = entprobe.probe(model, opt, tok, "arithmetic", batch={"B_E": 4, "B_U": 4, "G": 4}, **QUIET)
    assert_same(before, everything(model, opt))
    assert_results_equal(res, res_cli)
    assert (res["task"], res["task_reward"]) == (res_cli["task"], res_cli["task_reward"]) == ("arithmetic '{a}+{b}='", "numeric")


def test_a_task_by_name_takes_the_task_keys(cli, tmp_path):
    """task.* keys apply to a task named by a string (refused with a Task object); a jsonl task
    reads its path; unknown names and a second task choice are one-line ConfigErrors."""
    _, cfg, _ = cli
    model, opt, tok = loaded_like_the_cli(cfg)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(3) for b in range(3)))
    small = {"batch": {"B_E": 2, "B_U": 2, "G": 2}, "importance": {"enabled": False}, **QUIET}
    res = entprobe.probe(model, opt, tok, "jsonl", task={"path": str(data)}, run_dir=str(tmp_path / "run"), **small)
    assert math.isfinite(res["deltaH1"])
    assert (tmp_path / "run" / "results.json").is_file()
    with pytest.raises(ConfigError, match="task .nope.: not a built-in task; name one of arithmetic, arithmetic_question, jsonl"):
        entprobe.probe(model, opt, tok, "nope", **small)
    with pytest.raises(ConfigError, match="task: the task is 'arithmetic'"):
        entprobe.probe(model, opt, tok, "arithmetic", task="jsonl", **small)
    with pytest.raises(ConfigError, match="task.path"):
        entprobe.probe(model, opt, tok, "jsonl", **small)  # jsonl needs its file
    with pytest.raises(ConfigError, match="task.* builds a task"):  # a Task object: task keys do not apply
        entprobe.probe(model, opt, tok, build_task(cfg.task.__dict__), task={"num_prompts": 3}, **small)


def test_overrides_are_the_cli_keys_with_its_checks(cli, tmp_path):
    res_cli, cfg, batches = cli
    model, opt, tok = loaded_like_the_cli(cfg)
    E, U, _ = load_batches(batches, 60)
    before = everything(model, opt)
    cases = [({"batch.foo": 1}, "batch.foo=1: batch has no key foo"),
             ({"batch.BE": 8}, "batch.BE=8: batch has no key BE (did you mean batch.B_E?)"),
             ({"probe": {"mb_size_prompts": 0}}, "probe.mb_size_prompts: must be >= 1"),
             ({"objective": "nope"}, "objective=nope: objective has no option 'nope'; choose one of entprobe, trl, verl"),
             ({"model.path": "/ckpt"}, "model.* loads a model"),
             ({"optimizer.state_path": "/ckpt"}, "the geometry is the optimizer's own"),
             ({"batch.B_E": 8}, "the batches you pass are sampled already"),
             ({"sampling.temperature": 0.7}, "set sampling.temperature=1.0"),
             ({"logging.logger": "csv"}, "log them with your own logger")]
    for overrides, msg in cases:
        with pytest.raises(ConfigError, match=re.escape(msg)):
            entprobe.probe(model, opt, tok, (E, U), **overrides)
    with pytest.raises(ConfigError, match="pass \\(E, U\\)"):
        entprobe.probe(model, opt, tok, U)
    with pytest.raises(TypeError, match="task_or_batches is a int"):
        entprobe.probe(model, opt, tok, 3)
    # a prompt longer than the model's context: refused before any pass, naming the task and its length
    long_task = build_task(cfg.task.__dict__)
    long_task.prompts = [dataclasses.replace(long_task.prompts[0], text="1+" * 5000 + "1=")] + long_task.prompts[1:]
    with pytest.raises(ConfigError, match=r"the task \(ArithmeticTask\), prompt 0: the prompt is \d+ tokens "
                                          r".* > the model.s context"):
        entprobe.probe(model, opt, tok, long_task, **QUIET)
    # a parameter the optimizer does not train, and an optimizer that has not stepped
    other = torch.optim.AdamW(list(model.parameters())[1:])
    with pytest.raises(ConfigError, match="is not in the optimizer"):
        entprobe.probe(model, other, tok, (E, U))
    with pytest.raises(ConfigError, match="has not taken a step yet"):
        entprobe.probe(model, torch.optim.AdamW(model.parameters()), tok, (E, U))
    assert_same(before, everything(model, opt))

    # run_dir: the command line's outputs, an lr override applied for the probe only
    res = entprobe.probe(model, opt, tok, (E, U), run_dir=str(tmp_path), optimizer={"lr": 2e-3},
                         probe={"mode": "single_batch"}, **QUIET)
    assert res["lr"] == 2e-3 and res["mode"] == "single_batch"
    assert (tmp_path / "results.json").is_file() and (tmp_path / "ustat_units.csv").is_file()
    assert_same(before, everything(model, opt))


def test_an_optimizer_at_lr_0_is_refused_before_any_pass(cli, monkeypatch):
    """Param groups at lr 0 (what a linear schedule leaves in optimizer.pt) are refused as the
    command line refuses them, before anything runs, with the fix; an explicit lr probes that step."""
    import entprobe.pipeline.api
    from entprobe.checkpoints.optim_state import OptimizerStateError

    res_cli, cfg, batches = cli
    model, opt, tok = loaded_like_the_cli(cfg)
    E, U, _ = load_batches(batches, 60)
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = everything(model, opt)

    def no_pass(*args, **kwargs):
        raise AssertionError("the probe started")
    with monkeypatch.context() as m:
        m.setattr(entprobe.pipeline.api, "in_memory", no_pass)
        with pytest.raises(OptimizerStateError, match=r"the schedule has ended: the next step's lr is 0 .*"
                                                      r"entprobe\.probe\(\.\.\., optimizer=\{\"lr\": 1e-6\}\)$"):
            entprobe.probe(model, opt, tok, (E, U), **QUIET)
    assert_same(before, everything(model, opt))

    res = entprobe.probe(model, opt, tok, (E, U), optimizer={"lr": 2e-3}, probe={"mode": "single_batch"}, **QUIET)
    assert res["lr"] == 2e-3 and res["lr_source"] == "optimizer.lr (config)" and res["deltaH_pred"] != 0
    assert_same(before, everything(model, opt))  # the groups are back at lr 0


def test_config_composes_inside_a_hydra_app():
    """A Hydra app's global state is set aside and put back around the API's own composition."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from conftest import CONF_DIR
    from entprobe.pipeline.api import api_config

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        outer = GlobalHydra.instance().hydra
        cfg, _ = api_config({"objective": "trl", "objective.loss_type": "dr_grpo"}, False)
        assert GlobalHydra.instance().hydra is outer
    assert cfg.objective.loss_type == "dr_grpo" and cfg.batch.B_E == 8  # the YAML defaults
