"""A TRL checkpoint probed by its path and a task: the run's settings from its ``training_args.bin``
(checkpoints/trainer_args.py), written as TRL's Trainer writes it (``torch.save(self.args, ...)`` of a
real ``GRPOConfig``); keys the user sets win; ``model.trainer_args=ignore`` turns it off; a pickle
that would run code is refused without running it; without a task it is refused (the run's task is
not in the file), ``task=arithmetic`` given explicitly probes the built-in one."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
import sys
from pathlib import Path

import pytest
import torch

from conftest import DATA, compose_cfg
from entprobe.checkpoints.trainer_args import FILE, Setting, choose, explicit_keys, read_args, settings
from entprobe.checkpoints.trainer_task import TaskNotGiven
from entprobe.config import ObjectivePreset
from entprobe.pipeline.config_checks import to_typed
from entprobe.runtime.input_files import InputFileError

trl = pytest.importorskip("trl")

RUN = dict(loss_type="dr_grpo", scale_rewards="batch", num_generations=3, per_device_train_batch_size=3,
           max_completion_length=5, temperature=0.7, top_k=7, top_p=0.9, reward_weights=[1.0, 0.5],
           adam_beta2=0.98, adam_epsilon=1e-7, weight_decay=0.01, max_grad_norm=0.5,
           chat_template_kwargs={"enable_thinking": False})


def grpo_config(tmp: Path, **kw):
    return trl.GRPOConfig(output_dir=str(tmp / "out"), use_cpu=True, bf16=False, report_to=[], **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """The committed default checkpoint with the training_args.bin of a GRPO run (``RUN``)."""
    folder = tmp_path_factory.mktemp("trl") / "checkpoint-6"
    shutil.copytree(DATA / "default_model", folder)
    torch.save(grpo_config(folder.parent, **RUN), folder / FILE)  # as Trainer._save does
    return folder


def typed(tmp_path, ck: Path, *overrides: str):
    ov = ["model=hf", f"model.path='{ck}'", *overrides]
    return to_typed(compose_cfg(tmp_path, *ov), explicit=ov)


ARITHMETIC = "task=arithmetic"  # the built-in task, chosen explicitly: the file's settings apply around it


def test_path_alone_is_refused_naming_what_to_pass(ckpt, tmp_path, capsys):
    """No task chosen (task.path alone does not choose one): refused before anything is applied or
    printed, naming the task keys to give, the run's number of reward functions and task=arithmetic."""
    for extra in ((), ("task.reward=last_number",), ("task.path=data.jsonl",)):
        with pytest.raises(TaskNotGiven) as info:
            typed(tmp_path, ckpt, *extra)
        msg = str(info.value)
        assert msg.startswith("task: not given, and ") and str(ckpt / FILE) in msg and "\n" not in msg
        assert "TRL GRPOTrainer run" in msg and "reward_weights=[1.0, 0.5] weigh 2 reward function(s)" in msg
        assert "task=jsonl task.path=" in msg and "'task.reward_funcs=[<module>:<function>,<module>:<function>]'" in msg
        assert "or task=arithmetic to probe the built-in arithmetic task" in msg
    assert "entprobe: from" not in capsys.readouterr().out
    # a plain Trainer's arguments: refused too (the run's data is not in the file)
    from transformers import TrainingArguments

    plain = tmp_path / "plain"
    shutil.copytree(DATA / "default_model", plain)
    torch.save(TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[]), plain / FILE)
    with pytest.raises(TaskNotGiven, match=r"HF Trainer run \(TrainingArguments\).*task.reward=numeric"):
        typed(tmp_path, plain)
    assert typed(tmp_path, plain, "task._target_=entprobe.tasks.arithmetic.ArithmeticTask").batch.G == 4


def test_path_with_a_task_gives_the_runs_settings_and_prints_each(ckpt, tmp_path, capsys):
    cfg = typed(tmp_path, ckpt, ARITHMETIC)
    o, s = cfg.objective, cfg.sampling
    assert o.preset == ObjectivePreset.trl and (o.loss_type, o.scale_rewards) == ("dr_grpo", "batch")
    assert (o.beta, o.num_iterations, o.epsilon, o.max_completion_length) == (0.0, 1, 0.2, 5)
    assert (cfg.batch.G, s.max_new_tokens, s.temperature, s.top_k, s.top_p) == (3, 5, 0.7, 7, 0.9)
    assert (cfg.optimizer.betas, cfg.optimizer.eps, cfg.optimizer.weight_decay) == ([0.9, 0.98], 1e-7, 0.01)
    assert cfg.importance.max_grad_norm == 0.5 and cfg.optimizer.lr is None  # the step's lr: the checkpoint's
    assert cfg.task.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.task.reward_weights is None  # no task.reward_funcs: the weights have nothing to weigh
    out = capsys.readouterr().out
    head = f"entprobe: from {ckpt / FILE}: "
    for line in ("batch.G=3 (num_generations)", "objective.preset=trl (GRPOConfig)",
                 "sampling.max_new_tokens=5 (max_completion_length)",
                 "optimizer.betas=[0.9,0.98] (adam_beta1, adam_beta2)",
                 "importance.max_grad_norm=0.5 (max_grad_norm)", "reward_weights=[1.0, 0.5] not taken"):
        assert head + line in out, line
    assert "learning_rate" not in out


def test_keys_the_user_sets_win(ckpt, tmp_path, capsys):
    cfg = typed(tmp_path, ckpt, ARITHMETIC, "batch.G=2", "sampling.temperature=1.0", "objective.loss_type=grpo",
                "+task.chat_template_kwargs.x=1")
    assert (cfg.batch.G, cfg.sampling.temperature, cfg.objective.loss_type) == (2, 1.0, "grpo")
    # the rest: the file's
    assert cfg.objective.preset == ObjectivePreset.trl and cfg.objective.scale_rewards == "batch"
    assert cfg.task.chat_template_kwargs == {"x": 1}
    out = capsys.readouterr().out
    assert "batch.G as given (the file has 3, num_generations)" in out and "batch.G=3" not in out
    # another objective chosen: its keys stay, the file's sampling still applies
    cfg = typed(tmp_path, ckpt, ARITHMETIC, "objective=entprobe")
    assert cfg.objective.preset == ObjectivePreset.entprobe and cfg.objective.loss_type is None
    assert cfg.batch.G == 3


def test_reward_weights_taken_with_as_many_reward_funcs(ckpt, tmp_path):
    cfg = typed(tmp_path, ckpt, "task=jsonl", f"task.path='{DATA / 'default_model' / 'config.json'}'",
                "task.reward_funcs=[math:fabs,math:fabs]")
    assert cfg.task.reward_weights == [1.0, 0.5]


def test_ignore_switch_and_no_explicit_list_leave_the_file_unread(ckpt, tmp_path, capsys):
    cfg = typed(tmp_path, ckpt, "model.trainer_args=ignore")
    assert cfg.objective.preset == ObjectivePreset.entprobe and cfg.batch.G == 4
    ov = ["model=hf", f"model.path='{ckpt}'"]
    assert to_typed(compose_cfg(tmp_path, *ov)).batch.G == 4  # a config without its overrides: not read
    assert "entprobe: from" not in capsys.readouterr().out


class _Payload:
    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def test_a_pickle_that_runs_code_is_refused_unrun(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    sentinel = tmp_path / "pwned"
    torch.save(_Payload(sentinel), ck / FILE)
    with pytest.raises(InputFileError) as info:
        typed(tmp_path, ck)
    msg = str(info.value)
    assert str(ck / FILE) in msg and "system" in msg and "model.trainer_args=ignore" in msg
    assert "weights_only" not in msg and "\n" not in msg
    assert not sentinel.exists()
    assert typed(tmp_path, ck, "model.trainer_args=ignore").batch.G == 4  # the switch gets past it (no task asked)
    for bad in (b"", b"not a zip", (ck / FILE).read_bytes()[:200]):  # empty, not torch.save, truncated
        (ck / FILE).write_bytes(bad)
        with pytest.raises(InputFileError, match="training_args.bin: not a file torch.save wrote"):
            read_args(ck / FILE)
    with zipfile.ZipFile(ck / FILE, "w") as z:  # a zip whose pickle is cut short / garbage: not "refused"
        z.writestr("training_args/data.pkl", pickle.dumps({"a": [1, 2]})[:-3])
    with pytest.raises(InputFileError, match="cannot be read .* while unpickling"):
        read_args(ck / FILE)


def test_other_trl_versions_read_by_field_name(tmp_path):
    args = grpo_config(tmp_path, num_generations=2, per_device_train_batch_size=2)
    args.a_field_of_a_later_trl = {"x": 1}  # unknown fields are ignored
    for gone in ("epsilon_high", "loss_type", "scale_rewards"):  # fields an older TRL did not have
        delattr(args, gone)
    torch.save(args, tmp_path / FILE)
    kind, fields = read_args(tmp_path / FILE)
    assert kind == "GRPOConfig" and fields["a_field_of_a_later_trl"] == {"x": 1}
    found = {s.key: s for s in settings(kind, fields, tmp_path / FILE, 0)[0]}
    assert found["objective.loss_type"].value == "grpo" and found["objective.scale_rewards"].value == "group"
    assert "objective.epsilon_high" not in found and found["batch.G"].value == 2


def test_plain_trainer_args_give_adamw_settings_only(tmp_path):
    from transformers import TrainingArguments

    torch.save(TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], adam_beta1=0.8,
                                 max_grad_norm=0.0), tmp_path / FILE)
    kind, fields = read_args(tmp_path / FILE)
    found = {s.key: s.value for s in settings(kind, fields, tmp_path / FILE, 0)[0]}
    assert kind == "TrainingArguments" and not any(k.startswith(("objective.", "batch.")) for k in found)
    assert found["optimizer.betas"] == [0.8, 0.999] and found["importance.max_grad_norm"] is None


def test_not_modelled_settings_are_noted(tmp_path):
    fields = {"mask_truncated_completions": True, "top_entropy_quantile": 1.0, "loss_type": "grpo"}
    notes = settings("GRPOConfig", fields, tmp_path, 0)[1]
    assert notes == ["mask_truncated_completions=True is not modelled (docs/objectives.md): the probed step "
                     "is not the run's"]


def test_explicit_keys_and_choose():
    assert explicit_keys(["+batch.G=2", "~batch.save", "objective=verl", "++a.b.c=1"]) == \
        {"batch.G", "batch.save", "objective.preset", "a.b.c"}
    found = [Setting("objective.loss_type", "grpo", "loss_type"), Setting("batch.G", 3, "num_generations"),
             Setting("sampling.top_k", 0, "top_k")]
    chosen, kept = choose(found, {"objective.preset", "sampling"}, "verl")  # a group choice is no key
    assert [s.key for s in chosen] == ["batch.G", "sampling.top_k"] and "objective=verl" in kept[0]



def run_hydra_main() -> None:
    """``entprobe.main``'s Hydra entry on ``sys.argv``, in this process, with Hydra's global state
    cleared before and after (each test composes its own config)."""
    from hydra.core.global_hydra import GlobalHydra
    from entprobe.main import main

    GlobalHydra.instance().clear()
    try:
        main()
    finally:
        GlobalHydra.instance().clear()

def test_cli_probes_a_trl_checkpoint_by_its_path(ckpt, tmp_path, monkeypatch, capsys):
    """``python -m entprobe.main model=hf model.path=<checkpoint>`` end to end (Hydra's entry point, in
    this process): the run's G in the results, the command line's keys win over the file's."""
    import entprobe.cli.probe_job as job

    logged = {}
    make_logger = job.make_logger
    monkeypatch.setattr(job, "make_logger", lambda *a: logged.setdefault("config", a[2]) and make_logger(*a))

    argv = ["entprobe", "model=hf", f"model.path={ckpt}", "batch.B_E=2", "batch.B_U=2", "sampling.max_new_tokens=2",
            "importance.enabled=false", "logging.logger=none", "logging.progress=false", "logging.report=false",
            "model.device=cpu", f"hydra.run.dir={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", argv)  # no task: one line, exit 2, nothing probed
    with pytest.raises(SystemExit) as info:
        run_hydra_main()
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.count("\n") == 0 and err.startswith("entprobe: error: task: not given")
    assert "config" not in logged and not (tmp_path / "run" / "results.json").exists()
    monkeypatch.setattr(sys, "argv", [*argv, ARITHMETIC])
    run_hydra_main()
    out = capsys.readouterr().out
    assert f"entprobe: from {ckpt / FILE}: batch.G=3 (num_generations)" in out
    assert "sampling.max_new_tokens as given (the file has 5" in out
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (res["B_E"], res["B_U"], res["G"]) == (2, 2, 3)
    # what was probed, named in the results and on the verdict's first line
    assert (res["task"], res["task_reward"], res["objective"]) == ("arithmetic '{a}+{b}='", "numeric", "trl/dr_grpo")
    assert res["entropy_functional"] == "token_mean (sum H_t / sum L over all tokens: TRL's entropy)"
    assert ("task arithmetic '{a}+{b}=' · reward numeric · objective trl/dr_grpo · entropy functional token_mean "
            "(sum H_t / sum L over all tokens: TRL's entropy)") in out
    c = logged["config"]  # the logger's (wandb's) config is what ran, the file's settings included
    assert (c["objective"]["preset"], c["objective"]["loss_type"], c["batch"]["G"]) == ("trl", "dr_grpo", 3)


def test_keys_an_experiment_preset_or_local_config_sets_win(ckpt, tmp_path, monkeypatch, capsys):
    """An experiment preset and a local config of the user's (in their config folder,
    ``hydra.searchpath``) count as given, also where they write the default value: their batch.G,
    sampling.temperature and sampling.top_p stay, the file fills the rest (the job up to the probe);
    the task its defaults list chooses (``override /task: arithmetic``) is a task given."""
    import entprobe.cli.probe_job as job

    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - override /task: arithmetic\nbatch:\n  G: 2\n"
                                    "sampling:\n  temperature: 1.0\n")
    (conf.parent / "local").mkdir()
    (conf.parent / "local" / "default.yaml").write_text("# @package _global_\nsampling:\n  top_p: 1.0\n")
    seen = {}
    monkeypatch.setattr(job, "run", lambda typed, **kw: seen.setdefault("cfg", typed) and {})
    monkeypatch.setattr(sys, "argv", ["entprobe", "model=hf", f"model.path={ckpt}", "experiment=mine",
                                      f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "logging.logger=none",
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    run_hydra_main()
    cfg = seen["cfg"]
    assert (cfg.batch.G, cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k) == (2, 1.0, 1.0, 7)
    assert cfg.objective.loss_type == "dr_grpo"
    assert "batch.G as given (the file has 3" in capsys.readouterr().out
