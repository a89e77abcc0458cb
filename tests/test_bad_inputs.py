"""A table of bad inputs and faults, each run through ``run(cfg)`` as the CLI would: every one fails
with its own error class and a message that names the config key or the file (and for files,
what to do), never with torch's advice to set ``weights_only=False``; those marked early fail
before the model loads (loading it is a test failure there).

Each defect is applied to a copy (in tmp_path) of the built-in checkpoint or of one saved pair of
batches, so the table costs a config composition and a preflight per row, not a probe.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import entprobe.cli.probe_job as main_mod
from conftest import compose_cfg
from entprobe.config import ConfigError
from entprobe.runtime.input_files import InputFileError
from entprobe.cli.probe_job import run
from entprobe.checkpoints.optim_state import OptimizerStateError
from entprobe.checkpoints.peft import AdapterError
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint
from entprobe.tasks.base import RewardFunctionError
from entprobe.tasks.jsonl import TaskFileError


@dataclass
class Env:
    tmp: Path
    builtin: Path  # the cached built-in checkpoint (never modified)
    saved_src: Path  # one saved pair of batches (never modified)

    def ck(self) -> Path:
        """A fresh copy of the built-in checkpoint to damage."""
        dst = self.tmp / "ck"
        if not dst.exists():
            shutil.copytree(self.builtin, dst)
        return dst

    def saved(self) -> Path:
        """A fresh copy of the saved batches to damage."""
        dst = self.tmp / "saved"
        if not dst.exists():
            shutil.copytree(self.saved_src, dst)
        return dst

    def hf(self, *more: str) -> list[str]:
        ck = self.ck()
        return ["model=hf", f"model.path='{ck}'", f"optimizer.state_path='{ck}'", *more]

    def jsonl(self, text: str) -> list[str]:
        f = self.tmp / "data.jsonl"
        f.write_text(text, encoding="utf-8")
        return ["task=jsonl", f"task.path='{f}'"]

    def fake_gguf(self, data: bytes) -> Path:
        f = self.tmp / "model.gguf"
        f.write_bytes(data)
        return f


# ----------------------------------------------------------------------------- defects of a file
def truncate(p: Path) -> Path:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return p


def empty(p: Path) -> Path:
    p.write_bytes(b"")
    return p


def random_bytes(p: Path) -> Path:
    p.write_bytes(os.urandom(4096))
    return p


def pickled_code(p: Path) -> Path:
    """A torch file holding a function reference: refused by weights_only (nothing is executed)."""
    torch.save({"state": {}, "param_groups": [], "hook": os.getcwd}, p)
    return p


def edit_optimizer(p: Path, fn: Callable[[dict], None]) -> Path:
    sd = torch.load(p, weights_only=True)
    fn(sd)
    torch.save(sd, p)
    return p


def set_moment(key: str, value: float) -> Callable[[dict], None]:
    def fn(sd):
        sd["state"][3][key].view(-1)[0] = value
    return fn


def perturb_weights(ck: Path) -> Path:
    w = load_file(str(ck / "model.safetensors"))
    name = sorted(w)[0]
    w[name] = w[name] + 1e-3
    save_file(w, str(ck / "model.safetensors"), metadata={"format": "pt"})
    return ck


def end_of_schedule(ck: Path) -> Path:
    """The scheduler's next lr is 0, as a linear decay leaves it after its last step."""
    st = torch.load(ck / "scheduler.pt", weights_only=True)
    st["_last_lr"] = [0.0 for _ in st["_last_lr"]]
    torch.save(st, ck / "scheduler.pt")
    return ck


def other_tokenizer(ck: Path) -> Path:
    """The same vocabulary with one setting changed: another tokenizer file, another fingerprint."""
    f = ck / "tokenizer_config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "model_max_length": 7}))
    return ck


# ----------------------------------------------------------------------------- the table
def cfg_case(override: str, key: str):
    return (lambda e: ([override], [key]))


def opt_file(defect):
    return lambda e: (e.hf(), [str(defect(e.ck() / "optimizer.pt"))])


def ck_file(name: str, defect):
    return lambda e: (e.hf(), [str(defect(e.ck() / name))])


def batch_file(name: str, defect, *more: str):
    return lambda e: ([f"batch.load='{e.saved()}'", *more], [str(defect(e.saved() / name))])


def hf_after(defect, *more: str, says: tuple[str, ...]):
    """Run on the built-in checkpoint's copy as model=hf after ``defect(copy)``."""
    return lambda e: ((defect(e.ck()), e.hf(*more))[1], list(says))


def saved_with(*more: str, says: str):
    return lambda e: ([f"batch.load='{e.saved()}'", *more], [says])


JSONL_HEAD = '{"prompt": "2+2=", "answer": 4}\n\n'

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

# Round two (issue 24): each group of rows in its own list, joined into CASES below.
# saved batches and their fingerprint
def edit_meta(**keys):
    """The saved copy's batches.json with ``keys`` set (the files' sha256 still theirs)."""
    def make(e):
        f = e.saved() / "batches.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), **keys}))
        return e.saved()
    return make


def edit_batch(name: str, fn: Callable[[dict], None]):
    """``fn`` applied to the saved copy's ``name`` tensors, its sha256 in batches.json updated: a
    file that is what the fingerprint records, with bad contents."""
    def make(p: Path) -> Path:
        data = torch.load(p, weights_only=True)
        fn(data)
        torch.save(data, p)
        meta = json.loads((p.parent / "batches.json").read_text())
        meta["sha256"][name] = hashlib.sha256(p.read_bytes()).hexdigest()
        (p.parent / "batches.json").write_text(json.dumps(meta))
        return p
    return batch_file(name, make)


def also(make, *says: str):
    """``make`` whose message must also contain ``says`` (the reason, beside the file)."""
    return lambda e: (lambda r: (r[0], [*r[1], *says]))(make(e))


def set_first(field: str, value: float) -> Callable[[dict], None]:
    return lambda d: d[field].view(-1).__setitem__(0, value)


BATCH_CASES: list = [
    ("saved_E_of_another_pair",  # another run's E.pt copied beside this pair's batches.json
     also(batch_file("E.pt", lambda p: (shutil.copy(p.parent / "U.pt", p), p)[1]), "sha256"),
     InputFileError, True),
    ("saved_seed_E_mismatch", saved_with("batch.seed_E=5", says="batch.seed_E=5"), ConfigError, True),
    ("saved_adv_eps_mismatch", lambda e: (edit_meta(advantage="grpo", adv_eps=1e-3)(e) and
                                          [f"batch.load='{e.saved()}'", "batch.advantage=grpo"],
                                          ["batch.adv_eps=0.001", "batch.adv_eps=1e-06"]), ConfigError, True),
    ("saved_E_is_U", lambda e: (edit_meta(E_drawn=False)(e) and [f"batch.load='{e.saved()}'"],
                                ["the saved E is U", "probe.mode=two_batch"]), ConfigError, True),
    ("saved_E_token_beyond_vocab", also(edit_batch("E.pt", set_first("input_ids", 10**6)), "vocabulary"),
     InputFileError, False),
    ("saved_U_negative_token", also(edit_batch("U.pt", set_first("input_ids", -5)), "negative token id"),
     InputFileError, True),
    ("saved_U_advantages_shape", also(edit_batch("U.pt", lambda d: d.update(advantages=d["advantages"][:, :2])),
                                      "advantages has shape"), InputFileError, True),
    ("saved_E_no_response_tokens", also(edit_batch("E.pt", lambda d: d["response_mask"].zero_()), "no response tokens"),
     InputFileError, True),
    ("saved_U_advantage_nan", also(edit_batch("U.pt", set_first("advantages", float("nan"))), "non-finite"),
     InputFileError, True),
    ("saved_U_advantage_absurd", also(edit_batch("U.pt", set_first("advantages", 1e9)), "beyond"),
     InputFileError, True),
    ("saved_E_reward_inf", also(edit_batch("E.pt", set_first("rewards", float("inf"))), "rewards hold infinite"),
     InputFileError, True),
    ("saved_U_logprob_positive", also(edit_batch("U.pt", lambda d: d["sampler_logprobs"].masked_fill_(
        d["response_mask"].bool(), 0.5)), "positive log-probabilities"), InputFileError, True),
]

# checkpoints, sharded optimizer states, adapters, GGUF, entprobe.train --resume
def lora(e: Env, defect: Callable[[Path], object]) -> list[str]:
    """A rank-2 LoRA adapter over the built-in checkpoint (peft's save_pretrained), after ``defect(folder)``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = e.tmp / "lora"
    base = AutoModelForCausalLM.from_pretrained(e.builtin)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(folder)
    defect(folder)
    return ["model=hf", f"model.path='{folder}'", f"model.base_path='{e.builtin}'",
            "optimizer.preconditioner=identity", "optimizer.lr=1e-5"]


def edit_json(f: Path, **changes) -> Path:
    f.write_text(json.dumps({**json.loads(f.read_text()), **changes}))
    return f


def pickled_bin(folder: Path, weights: str, bin_name: str) -> Path:
    """The ``weights`` safetensors file replaced by a ``bin_name`` torch file that holds code."""
    (folder / weights).unlink()
    return pickled_code(folder / bin_name)


CHECKPOINT_CASES: list = [
    ("lora_rank_mismatch", lambda e: (lora(e, lambda f: edit_json(f / "adapter_config.json", r=4)),
                                      [str(e.tmp / "lora" / "adapter_model.safetensors"), "r=4", "rank 2"]),
     AdapterError, True),
    ("lora_unknown_peft_type", lambda e: (lora(e, lambda f: edit_json(f / "adapter_config.json", peft_type="LORAX")),
                                          [str(e.tmp / "lora" / "adapter_config.json"), "'LORAX'"]),
     AdapterError, True),
    ("lora_bin_pickled_code",
     lambda e: (lora(e, lambda f: pickled_bin(f, "adapter_model.safetensors", "adapter_model.bin")),
                [str(e.tmp / "lora" / "adapter_model.bin"), "never unpickles"]),
     InputFileError, True),
    ("hf_bin_pickled_code",
     lambda e: ((pickled_bin(e.ck(), "model.safetensors", "pytorch_model.bin"), e.hf())[1],
                [str(e.tmp / "ck" / "pytorch_model.bin"), "never unpickles", "safetensors"]),
     InputFileError, True),
    ("gguf_path_missing", lambda e: (["model=smollm2", f"model.gguf_file='{e.tmp / 'nope.gguf'}'"],
                                     ["model.gguf_file", str(e.tmp / "nope.gguf"), "does not exist"]),
     ConfigError, True),
]

# run dirs, signals, disk and file-size limits
RUN_CASES: list = [
    ("what_if_lr_factors_repeated",  # both would be results key lr_x2: one was dropped silently
     lambda e: (["probe.what_if.lr_factors=[2,2.0000001]"],
                ["probe.what_if.lr_factors", "and 2.0000001, the same setting", "give each value once"]), ConfigError, True),
    ("what_if_lr_factors_nan",
     lambda e: (["probe.what_if.lr_factors=[nan]"], ["probe.what_if.lr_factors", "finite number > 0"]),
     ConfigError, True),
    ("verl_prompts_without_chat_template",  # was a ValueError with Hydra's traceback, not the one-line error
     lambda e: (["model=hf", f"model.path='{Path(__file__).parent / 'data' / 'default_model'}'", "objective=verl",
                 "optimizer.preconditioner=identity", "optimizer.lr=1e-5"], ["prompts tokenized as verl does", "this tokenizer has none",
                                          "model.tokenizer_path", "task.tokenize=entprobe"]), ConfigError, False),
    ("seed_past_2_32",  # torch.Generator overflowed on it after the model had loaded
     lambda e: (["batch.seed_E=100000000000000000000000"], ["batch.seed_E", "seeds must be in [0, 2^32)"]),
     ConfigError, True),
]

# tasks, prompts, reward functions, the planner
def latin1_jsonl(e: Env):
    """A JSONL exported as Latin-1: its second line's 'é' is the byte 0xe9, not UTF-8."""
    f = e.tmp / "latin1.jsonl"
    f.write_bytes('{"prompt": "2+2=", "answer": 4}\n{"prompt": "café: 1+1=", "answer": 2}\n'.encode("latin-1"))
    return ["task=jsonl", f"task.path='{f}'"], [str(f), "line 2", "not UTF-8", "re-encode"]


def reward_func(name: str, *says: str):
    return lambda e: ([f"task.reward_funcs=[user_rewards:{name}]"], [f"task.reward_funcs: user_rewards:{name}", *says])


TASK_CASES: list = [
    ("jsonl_prompt_longer_than_the_context",  # the built-in model's context is 64 positions
     lambda e: (e.jsonl(JSONL_HEAD + json.dumps({"prompt": "1+" * 100 + "1=", "answer": 101}) + "\n"),
                ["data.jsonl:3:", "203 tokens (202 characters)", "sampling.max_new_tokens=4", "context of 64 tokens"]),
     InputFileError, False),
    ("task_prompt_longer_than_the_context",
     lambda e: (["task._target_=user_rewards.NanRewardTask", "task.num_prompts=4", "sampling.max_new_tokens=60"],
                ["task._target_=user_rewards.NanRewardTask, prompt 0", "5 tokens", "needs 65 > the model's context of 64"]),
     ConfigError, False),
    ("jsonl_latin1", latin1_jsonl, InputFileError, True),
    ("reward_func_sys_exit", reward_func("exits_3", "called sys.exit(3)"), RewardFunctionError, False),
    ("reward_func_raises", reward_func("raises_key_error", "raised KeyError: 'no_such_column'"),
     RewardFunctionError, False),
    ("reward_func_nan", reward_func("nan_for_second", "returned nan for row 1 (prompt", "finite"),
     RewardFunctionError, False),
    ("reward_func_inf", reward_func("inf_reward", "returned inf for row 0"), RewardFunctionError, False),
    ("task_reward_nan", lambda e: (["task._target_=user_rewards.NanRewardTask"],
                                   ["user_rewards.NanRewardTask: its reward(response, prompt) returned nan for row 0"]),
     RewardFunctionError, False),
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
