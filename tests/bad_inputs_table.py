"""The defects of test_bad_inputs.py's table: ``Env`` (fresh copies of the built-in checkpoint and of
one saved pair of batches to damage), the ways a file is damaged, and the table's rows of round two
(issue 24), each group in its own list (``BATCH_CASES``, ``CHECKPOINT_CASES``, ``RUN_CASES``,
``TASK_CASES``). A row is ``(id, make, error class, early)``: ``make(env)`` returns the overrides and
the names the error message must contain.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from entprobe.config import ConfigError
from entprobe.runtime.input_files import InputFileError
from entprobe.checkpoints.peft import AdapterError
from entprobe.tasks.base import RewardFunctionError


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
