"""A table of bad inputs and faults, each run through ``run(cfg)`` as the CLI would: every one fails
with its own error class and a message that names the config key or the file (and for files,
what to do), never with torch's advice to set ``weights_only=False``; those marked early fail
before the model loads (loading it is a test failure there).

Each defect is applied to a copy (in tmp_path) of the built-in checkpoint or of one saved pair of
batches, so the table costs a config composition and a preflight per row, not a probe.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import entprobe.cli.probe_job as main_mod
from conftest import compose_cfg
from entprobe.config import ConfigError
from entprobe.runtime.input_files import InputFileError
from entprobe.cli.probe_job import run
from entprobe.checkpoints.optim_state import OptimizerStateError
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint
from entprobe.tasks.jsonl import TaskFileError
from bad_inputs_table import (BATCH_CASES, CHECKPOINT_CASES, JSONL_HEAD, RUN_CASES, TASK_CASES, Env, batch_file,
                               cfg_case, ck_file, edit_optimizer, empty, end_of_schedule, hf_after, opt_file,
                               other_tokenizer, perturb_weights, pickled_code, random_bytes, saved_with,
                               set_moment, truncate)



CASES = [
    # id, make(env) -> (overrides, substrings the message must contain), error class, fails before the model
    ("betas_1", cfg_case("optimizer.betas=[1.0,0.999]", "optimizer.betas"), ConfigError, True),
    ("betas_negative", cfg_case("optimizer.betas=[0.9,-0.1]", "optimizer.betas"), ConfigError, True),
    ("betas_one_value", cfg_case("optimizer.betas=[0.9]", "optimizer.betas"), ConfigError, True),
    ("eps_negative", cfg_case("optimizer.eps=-1", "optimizer.eps"), ConfigError, True),
    ("eps_zero", cfg_case("optimizer.eps=0", "optimizer.eps"), ConfigError, True),
    ("step_zero", cfg_case("optimizer.step=0", "optimizer.step"), ConfigError, True),
    ("weight_decay_negative", cfg_case("optimizer.weight_decay=-0.1", "optimizer.weight_decay"), ConfigError, True),
    ("lr_zero", cfg_case("optimizer.lr=0", "optimizer.lr"), ConfigError, True),
    ("lr_nan", cfg_case("optimizer.lr=nan", "optimizer.lr"), ConfigError, True),
    ("lr_inf", cfg_case("optimizer.lr=inf", "optimizer.lr"), ConfigError, True),
    ("G_one", cfg_case("batch.G=1", "batch.G"), ConfigError, True),
    ("B_E_one", cfg_case("batch.B_E=1", "batch.B_E"), ConfigError, True),
    ("adv_eps_zero", cfg_case("batch.adv_eps=0", "batch.adv_eps"), ConfigError, True),
    ("lock_timeout_negative", cfg_case("batch.lock_timeout_s=-1", "batch.lock_timeout_s"), ConfigError, True),
    ("seed_negative", cfg_case("batch.seed_U=-3", "batch.seed_U"), ConfigError, True),
    ("temperature_zero", cfg_case("sampling.temperature=0", "sampling.temperature"), ConfigError, True),
    ("top_p_above_1", cfg_case("sampling.top_p=1.5", "sampling.top_p"), ConfigError, True),
    ("top_k_negative", cfg_case("sampling.top_k=-1", "sampling.top_k"), ConfigError, True),
    ("max_new_tokens_zero", cfg_case("sampling.max_new_tokens=0", "sampling.max_new_tokens"), ConfigError, True),
    ("mb_size_zero", cfg_case("probe.mb_size_prompts=0", "probe.mb_size_prompts"), ConfigError, True),
    ("clip_c_zero", cfg_case("importance.clip_c=0", "importance.clip_c"), ConfigError, True),
    ("ess_threshold_2", cfg_case("importance.ess_threshold=2", "importance.ess_threshold"), ConfigError, True),
    ("max_grad_norm_zero", cfg_case("importance.max_grad_norm=0", "importance.max_grad_norm"), ConfigError, True),
    ("rl_grad_accum_zero", cfg_case("importance.rl_grad_accum=0", "importance.rl_grad_accum"), ConfigError, True),
    ("ddp_timeout_zero", cfg_case("ddp.timeout_s=0", "ddp.timeout_s"), ConfigError, True),
    ("model_device_bad", cfg_case("model.device=gpu7", "model.device"), ConfigError, True),
    ("wandb_mode_bad", cfg_case("logging.wandb.mode=cloud", "logging.wandb.mode"), ConfigError, True),
    ("cross_fit_dr_grpo", cfg_case("probe.cross_fit=true", "probe.cross_fit"), ConfigError, True),
    # the optimizer state
    ("optimizer_truncated", opt_file(truncate), InputFileError, True),
    ("optimizer_empty", opt_file(empty), InputFileError, True),
    ("optimizer_random", opt_file(random_bytes), InputFileError, True),
    ("optimizer_pickled_code", opt_file(pickled_code), InputFileError, True),
    ("optimizer_not_a_state_dict",
     opt_file(lambda p: (torch.save({"w": torch.ones(2)}, p), p)[1]), OptimizerStateError, True),
    ("optimizer_nan_exp_avg_sq",
     opt_file(lambda p: edit_optimizer(p, set_moment("exp_avg_sq", float("nan")))), OptimizerStateError, True),
    ("optimizer_negative_exp_avg_sq",
     opt_file(lambda p: edit_optimizer(p, set_moment("exp_avg_sq", -1.0))), OptimizerStateError, True),
    ("optimizer_inf_exp_avg",
     opt_file(lambda p: edit_optimizer(p, set_moment("exp_avg", float("inf")))), OptimizerStateError, True),
    ("state_path_missing", lambda e: ([f"optimizer.state_path='{e.tmp / 'nope.pt'}'"], ["optimizer.state_path"]),
     OptimizerStateError, True),
    ("state_path_folder_without_optimizer",
     lambda e: ([f"optimizer.state_path='{e.tmp}'"], [str(e.tmp), "optimizer.state_path"]), OptimizerStateError, True),
    ("scheduler_truncated", ck_file("scheduler.pt", truncate), InputFileError, True),
    ("scheduler_random", ck_file("scheduler.pt", random_bytes), InputFileError, True),
    ("schedule_ended", hf_after(end_of_schedule, says=("schedule has ended", "scheduler.pt", "optimizer.lr"))
     , OptimizerStateError, True),
    ("trainer_state_truncated", ck_file("trainer_state.json", truncate), InputFileError, True),
    ("trainer_state_empty", ck_file("trainer_state.json", empty), InputFileError, True),
    # the model's files
    ("weights_truncated", ck_file("model.safetensors", truncate), InputFileError, True),
    ("weights_empty", ck_file("model.safetensors", empty), InputFileError, True),
    ("config_json_broken", ck_file("config.json", truncate), InputFileError, True),
    ("tokenizer_json_broken", lambda e: (ck_file("tokenizer.json", truncate)(e)[0], ["cannot load the tokenizer",
                                                                                   str(e.ck()), "model.path"]),
     InputFileError, False),
    ("model_path_missing", lambda e: (["model=hf", f"model.path='{e.tmp / 'nope'}'"], ["model.path"]),
     ConfigError, True),
    ("gguf_zero_bytes", lambda e: (["model=smollm2", f"model.gguf_file='{e.fake_gguf(b'')}'",
                                    "optimizer.preconditioner=identity", "optimizer.lr=1e-5"],
                                   [str(e.tmp / "model.gguf")]), InputFileError, True),
    ("gguf_random", lambda e: (["model=smollm2", f"model.gguf_file='{e.fake_gguf(os.urandom(512))}'",
                                "optimizer.preconditioner=identity", "optimizer.lr=1e-5"],
                               [str(e.tmp / "model.gguf")]), InputFileError, True),
    ("gguf_without_optimizer_state",
     lambda e: (["model=smollm2", f"model.gguf_file='{e.fake_gguf(b'GGUF' + (3).to_bytes(4, 'little') + bytes(64))}'"],
                ["no optimizer state", "optimizer.state_path", "optimizer.preconditioner=identity"]), ConfigError, True),
    ("identity_without_lr",
     lambda e: (["model=smollm2", f"model.gguf_file='{e.fake_gguf(b'GGUF' + (3).to_bytes(4, 'little') + bytes(64))}'",
                 "optimizer.preconditioner=identity"], ["optimizer.lr"]), ConfigError, True),
    # saved batches
    ("saved_E_truncated", batch_file("E.pt", truncate), InputFileError, True),
    ("saved_E_empty", batch_file("E.pt", empty), InputFileError, True),
    ("saved_U_random", batch_file("U.pt", random_bytes), InputFileError, True),
    ("saved_E_not_a_batch", batch_file("E.pt", lambda p: (torch.save({"x": torch.ones(1)}, p), p)[1]),
     InputFileError, True),
    ("saved_U_missing", batch_file("U.pt", lambda p: (p.unlink(), p)[1]), InputFileError, True),
    ("saved_fingerprint_broken", batch_file("batches.json", truncate), InputFileError, True),
    ("batch_load_missing_folder", lambda e: ([f"batch.load='{e.tmp / 'nope'}'"], ["batch.load", str(e.tmp / "nope")]),
     ConfigError, True),
    ("saved_G_mismatch", saved_with("batch.G=3", says="the saved E has G=4 responses per prompt, the config batch.G=3"),
     ConfigError, True),
    ("saved_B_E_mismatch", saved_with("batch.B_E=6", says="the saved E has 4 prompts, the config batch.B_E=6"),
     ConfigError, True),
    ("saved_B_U_mismatch", saved_with("batch.B_U=3", says="the saved U has 4 prompts, the config batch.B_U=3"),
     ConfigError, True),
    ("saved_temperature_mismatch", saved_with("sampling.temperature=0.5", says="sampling.temperature=0.5"),
     ConfigError, True),
    ("saved_top_k_mismatch", saved_with("sampling.top_k=5", says="sampling.top_k=5"), ConfigError, True),
    ("saved_top_p_mismatch", saved_with("sampling.top_p=0.9", says="sampling.top_p=0.9"), ConfigError, True),
    ("saved_task_mismatch", saved_with("task.max_operand=5", says="task="), ConfigError, True),
    ("saved_max_new_tokens_mismatch", saved_with("sampling.max_new_tokens=2", says="sampling.max_new_tokens=2"),
     ConfigError, True),
    ("saved_advantage_mismatch", saved_with("batch.advantage=grpo", says="batch.advantage=grpo"), ConfigError, True),
    ("saved_other_model_weights", lambda e: hf_after(perturb_weights, f"batch.load='{e.saved()}'",
                                                     says=("batch.load", "other model weights"))(e), ConfigError, True),
    ("saved_other_tokenizer", lambda e: hf_after(other_tokenizer, f"batch.load='{e.saved()}'",
                                                 says=("batch.load", "other tokenizer"))(e), ConfigError, True),
    # tasks
    ("jsonl_null_answer", lambda e: (e.jsonl(JSONL_HEAD + '{"prompt": "1+1=", "answer": null}\n'),
                                     ["data.jsonl:3:", "'answer' is None"]), TaskFileError, True),
    ("jsonl_bool_answer", lambda e: (e.jsonl(JSONL_HEAD + '{"prompt": "1+1=", "answer": false}\n'),
                                     ["data.jsonl:3:", "'answer' is False"]), TaskFileError, True),
    ("jsonl_empty_answer", lambda e: (e.jsonl(JSONL_HEAD + '{"prompt": "1+1=", "answer": " "}\n'),
                                      ["data.jsonl:3:"]), TaskFileError, True),
    ("jsonl_broken_line_after_u2028",  # U+2028 inside a string is not a line end in JSONL
     lambda e: (e.jsonl('{"prompt": "a\u2028b=", "answer": 1}\n{"prompt": "2+2=", "answer": 4}\n{"prompt": 1+\n'),
                ["data.jsonl:3:", "not a JSON record"]), TaskFileError, True),
    ("jsonl_not_a_record", lambda e: (e.jsonl(JSONL_HEAD + "[1, 2]\n"), ["data.jsonl:3:"]), TaskFileError, True),
    ("jsonl_missing_file", lambda e: (["task=jsonl", f"task.path='{e.tmp / 'none.jsonl'}'"], ["task.path"]),
     InputFileError, True),
    ("prompts_mostly_unknown_tokens",
     lambda e: (e.jsonl('{"prompt": "What is two plus two?", "answer": 4}\n'),
                ["data.jsonl:1:", "'W' (U+0057)", "unknown token"]), InputFileError, False),
]


CASES += BATCH_CASES + CHECKPOINT_CASES + RUN_CASES + TASK_CASES


@pytest.fixture(scope="module")
def saved_src(tmp_path_factory) -> Path:
    """One real (small) run's batches: B_E = B_U = G = 4 at temperature 1."""
    folder = tmp_path_factory.mktemp("saved_src")
    run(compose_cfg(folder / "run", f"batch.save='{folder / 'b'}'", "importance.enabled=false"))
    return folder / "b"


@pytest.mark.parametrize("make, cls, early", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_with_its_class_and_names_the_key_or_file(tmp_path, monkeypatch, saved_src, make, cls, early):
    env = Env(tmp_path, ensure_default_checkpoint(), saved_src)
    overrides, names = make(env)
    if early:
        def refuse(*a, **k):
            raise AssertionError("the model was loaded before the bad input was refused")
        monkeypatch.setattr(main_mod, "load_model", refuse)
    with pytest.raises(Exception) as info:
        run(compose_cfg(tmp_path / "run", *overrides))
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    for name in names:
        assert name in msg, f"{name!r} not in: {msg}"
    assert "weights_only" not in msg  # torch's advice to unpickle code never reaches the user
    assert not (tmp_path / "run" / "results.json").exists()
    assert (tmp_path / "run" / "FAILED").is_file()  # the failed run is marked


def test_the_table_is_long_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


def test_saved_batches_are_untouched_by_refused_loads(saved_src):
    assert RolloutBatch.load(saved_src / "E.pt").B == 4
    meta = json.loads((saved_src / "batches.json").read_text())
    assert (meta["G"], meta["B_E"], meta["B_U"], meta["temperature"]) == (4, 4, 4, 1.0)
