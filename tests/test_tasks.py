"""Rewards, the JSONL task, user task classes through task._target_, and chat templates."""
from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_cfg
from entprobe.checkpoints.builtin import build_char_tokenizer, build_tiny_llama
from entprobe.config import SamplingConfig, TaskConfig
from entprobe.cli.probe_job import run
from entprobe.rollouts.sampling import encode_prompts, sample_batch
from entprobe.tasks import Prompt, boxed_reward, build_task, extract_boxed, numeric_reward
from entprobe.runtime.input_files import InputFileError
from entprobe.tasks.jsonl import JsonlTask


@pytest.mark.parametrize("response,answer,want", [
    ("7", "7", 1.0), (" 7 is it", "7", 1.0), ("07", "7", 1.0), ("7.0", "7", 1.0), ("+4", "4", 1.0),
    ("-3", "-3", 1.0), ("-3", "3", 0.0), ("12", "1", 0.0), ("1 2", "12", 0.0), ("3 then 7", "7", 0.0),
    ("", "7", 0.0), ("no number", "7", 0.0), (" yes ", "yes", 1.0),
])
def test_numeric_reward(response, answer, want):
    """The first number in the response, compared numerically; plain text answers by exact text."""
    assert numeric_reward(response, answer) == want


@pytest.mark.parametrize("response,answer,want", [
    (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),  # nested braces kept whole
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{3}", 0.0),
    (r"\boxed{3} no, \boxed{4}", "4", 1.0),  # the last box counts
    (r"\boxed{3} no, \boxed{4}", "3", 0.0),
    (r"\boxed{ 4.0 }", "4", 1.0),  # numeric when both parse
    (r"\boxed{x + 1}", "x+1", 1.0),  # spaces ignored for text answers
    (r"\boxed{4", "4", 0.0),  # unbalanced
    ("4", "4", 0.0),  # no box at all
])
def test_boxed_reward(response, answer, want):
    assert boxed_reward(response, answer) == want


def test_extract_boxed_balances_braces():
    assert extract_boxed(r"a \boxed{x^{2}+{y}} b") == "x^{2}+{y}"
    assert extract_boxed(r"\boxed{a}\boxed{b{c}}") == "b{c}"
    assert extract_boxed("nothing") is None


def test_jsonl_task(tmp_path):
    f = tmp_path / "t.jsonl"
    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": r"half?", "answer": r"\frac{1}{2}"},
            {"prompt": "2+2=", "answer": "4"}]
    f.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    task = build_task(OmegaConf.structured(TaskConfig(_target_="entprobe.tasks.jsonl.JsonlTask",
                                                      path=str(f), reward="boxed")))
    assert [p.text for p in task.prompts] == ["1+1=", "half?", "2+2="]  # the blank line is skipped
    assert task.prompts[0].answer == "2"  # numbers become strings
    assert task.reward(r"\boxed{\frac{1}{2}}", task.prompts[1]) == 1.0
    assert task.reward("2", task.prompts[0]) == 0.0  # boxed reward: a bare number does not count
    assert len(JsonlTask(str(f), num_prompts=2).prompts) == 2
    assert JsonlTask(str(f)).reward("2 apples", task.prompts[0]) == 1.0  # numeric by default


def test_jsonl_encodings(tmp_path):
    """A byte-order mark is dropped; UTF-16 and Latin-1 files are named with what to do (the Latin-1
    line and byte: test_bad_inputs.py's jsonl_latin1)."""
    from entprobe.runtime.input_files import InputFileError
    f = tmp_path / "t.jsonl"
    text = '{"prompt": "caf\u00e9 1+1=", "answer": 2}\n'
    f.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert JsonlTask(str(f)).prompts[0].text == "caf\u00e9 1+1="
    f.write_bytes(text.encode("utf-16"))
    with pytest.raises(InputFileError, match=r"t\.jsonl: is UTF-16 .*iconv -f UTF-16 -t UTF-8"):
        JsonlTask(str(f))
    f.write_bytes(('{"prompt": "2+2=", "answer": 4}\n' + text).encode("latin-1"))
    with pytest.raises(InputFileError, match=r"line 2 \(byte 47, 0xe9\) is not UTF-8.*iconv -f LATIN1"):
        JsonlTask(str(f))


def test_a_task_or_reward_module_that_calls_sys_exit_is_named(tmp_path, monkeypatch):
    """sys.exit while a user's module is imported, or in a task class's constructor, ended the run
    with its code and no message."""
    (tmp_path / "exiting_mod.py").write_text("import sys\nsys.exit(4)\n")
    (tmp_path / "exiting_task.py").write_text("import sys\nclass T:\n    def __init__(self):\n        sys.exit(5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from entprobe.config import ConfigError
    from entprobe.tasks.reward_funcs import load_reward_func
    with pytest.raises(ConfigError, match=r"module 'exiting_mod' cannot be imported \(it called sys\.exit\(4\)\)"):
        load_reward_func("exiting_mod:f")
    with pytest.raises(ValueError, match=r"task\._target_='exiting_mod\.T' cannot be imported: called sys\.exit\(4\)"):
        build_task({"_target_": "exiting_mod.T"})
    with pytest.raises(ValueError, match=r"task\._target_='exiting_task\.T' called sys\.exit\(5\) while building"):
        build_task({"_target_": "exiting_task.T"})


def test_jsonl_task_errors(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: each record needs 'prompt' and 'answer'"):
        JsonlTask(str(f))
    with pytest.raises(ValueError, match=r"task\.reward='exact'; choose one of \['boxed', 'last_number', 'numeric'\]"):
        JsonlTask(str(f), reward="exact")
    with pytest.raises(InputFileError, match="task.path"):  # a user error: one line on the command line
        JsonlTask(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="task.path must point"):
        JsonlTask(None)


class AlwaysRightTask:
    """A user task: every response earns 1, so every group's advantages are 0."""

    def __init__(self, num_prompts: int = 3):
        self.prompts = [Prompt(t, "0") for t in ("1+2=", "33-3=", "4*4=", "9=")[:num_prompts]]

    def reward(self, response: str, prompt: Prompt) -> float:
        return 1.0


class NoReward:
    prompts = [Prompt("1=", "1")]


def test_custom_task_class_through_target(tmp_path):
    """The run uses the class's prompts and reward: rewards all 1 -> A = 0 -> Ybar = 0 -> deltaH1 = 0
    exactly, and SE 0 (the arithmetic reward gives non-zero values: test_config, test_batch_io)."""
    res = run(compose_cfg(tmp_path, "task._target_=test_tasks.AlwaysRightTask", "task.num_prompts=4"))
    assert res["batch_E/reward_mean"] == 1.0 and res["batch_U/reward_mean"] == 1.0
    assert res["bars_dot"] == 0.0 and res["deltaH1"] == 0.0 and res["SE_deltaH1"] == 0.0
    assert len(build_task({"_target_": "test_tasks.AlwaysRightTask", "num_prompts": 2, "seed": 5}).prompts) == 2
    with pytest.raises(TypeError, match="must provide .prompts and .reward"):
        build_task({"_target_": "test_tasks.NoReward"})
    with pytest.raises(ValueError, match=r"task\._target_='test_tasks\.Nope' cannot be imported"):
        build_task({"_target_": "test_tasks.Nope"})


TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}={% endif %}")


def test_chat_template_applied_when_the_tokenizer_has_one():
    tok = build_char_tokenizer()
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    bos = tok.bos_token_id
    assert encode_prompts(tok, ["3+4"], "auto") == [[bos] + ids("3+4")]  # no template: BOS + text
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(tok, ["3+4"], "always")
    tok.chat_template = TEMPLATE
    assert encode_prompts(tok, ["3+4"], "auto") == [[bos] + ids("3+4 =")]
    assert encode_prompts(tok, ["3+4"], "always", system_prompt="9") == [[bos] + ids("9 3+4 =")]
    assert encode_prompts(tok, ["3+4"], "never", system_prompt="9") == [[bos] + ids("3+4")]

    model = build_tiny_llama(len(tok), seed=0)
    task = AlwaysRightTask()
    s = SamplingConfig(max_new_tokens=2)
    for mode, text in (("auto", "1+2= ="), ("never", "1+2=")):  # prompt "1+2=" in the template
        b = sample_batch(model, tok, task, torch.tensor([0]), 2, s, 0, "dr_grpo", 1e-6, chat_template=mode)
        P = int((b.attention_mask[0, 0] * (1 - b.response_mask[0, 0])).sum())
        assert b.input_ids[0, 0, :P].tolist() == [bos] + ids(text), mode


def test_model_context_comes_from_the_config_then_the_tokenizer_then_the_cap(tmp_path):
    from types import SimpleNamespace
    from entprobe.tasks.lengths import UNKNOWN_CONTEXT_CAP, config_context, model_context
    assert config_context({"max_position_embeddings": 4096}) == 4096
    assert config_context({"n_positions": 1024}) == 1024  # GPT-2
    assert config_context({"text_config": {"max_position_embeddings": 8192}}) == 8192  # multimodal
    assert config_context({"max_position_embeddings": True, "seq_length": 0}) is None
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # Qwen2.5's long context
    assert config_context({"max_position_embeddings": 32768, "rope_scaling": yarn}) == 131072
    llama31 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert config_context({"max_position_embeddings": 131072, "rope_scaling": llama31}) == 131072
    assert config_context({"max_position_embeddings": 2048, "rope_parameters": {"factor": 2.0}}) == 4096  # linear
    assert config_context({"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "default"}}) == 2048
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    tok = SimpleNamespace(model_max_length=512)
    assert model_context(tok, [None, tmp_path]) == (2048, str(tmp_path / "config.json"))
    assert model_context(tok, [tmp_path], {"max_position_embeddings": 128}) == (128, "the model's config")
    assert model_context(tok, [tmp_path / "none"]) == (512, "the tokenizer's model_max_length")
    no_limit = SimpleNamespace(model_max_length=int(1e30))  # transformers' VERY_LARGE_INTEGER
    assert model_context(no_limit, [])[0] == UNKNOWN_CONTEXT_CAP


def test_longest_prompt_is_counted_as_the_sampler_tokenizes_it():
    from entprobe.tasks.lengths import longest_prompt
    tok = build_char_tokenizer()
    prompts = [Prompt(t, "0") for t in ("1+2=", "33+3=", "4+4=")] * 100  # past one ENCODE_CHUNK
    prompts[290] = Prompt("123+456=", "579")
    assert longest_prompt(tok, prompts, chat_template="never") == (290, 9)  # BOS + 8 characters


def test_arithmetic_question_task_and_the_smollm2_preset(tmp_path):
    """task=arithmetic_question: the arithmetic pool asked as a question and scored on the last
    number (a chat model answers in a sentence); the default arithmetic task is unchanged; a bad
    template or reward is named; experiment=smollm2_smoke uses the question task."""
    from entprobe.pipeline.config_checks import to_typed

    plain = build_task(OmegaConf.structured(to_typed(compose_cfg(tmp_path)).task))
    q_cfg = to_typed(compose_cfg(tmp_path, "task=arithmetic_question")).task
    q = build_task(OmegaConf.structured(q_cfg))
    assert [p.answer for p in q.prompts] == [p.answer for p in plain.prompts]  # the same pool, other words
    a, b = plain.prompts[0].text[:-1].split("+")
    assert plain.prompts[0].text == f"{a}+{b}=" and int(a) + int(b) == int(plain.prompts[0].answer)
    assert q.prompts[0].text == f"What is {a} + {b}?"
    answer = q.prompts[0].answer
    assert q.reward(f"{a} + {b} = {answer}", q.prompts[0]) == 1.0  # the last number is the answer
    assert plain.reward(f"{a} + {b} = {answer}", plain.prompts[0]) == float(a == answer)  # first number
    assert q.reward(f"It is {int(answer) + 1}.", q.prompts[0]) == 0.0
    with pytest.raises(ValueError, match="task.template=.*must hold the operands as {a} and {b}"):
        build_task({"_target_": "entprobe.tasks.arithmetic.ArithmeticTask", "template": "What is it?"})
    with pytest.raises(ValueError, match="task.reward='exact'; choose one of"):
        build_task({"_target_": "entprobe.tasks.arithmetic.ArithmeticTask", "reward": "exact"})
    smoke = to_typed(compose_cfg(tmp_path, "experiment=smollm2_smoke"))
    assert smoke.task.template == q_cfg.template and smoke.task.reward == "last_number"
    assert smoke.model.source.value == "gguf" and smoke.optimizer.preconditioner.value == "identity"


def test_the_task_and_reward_are_described_as_the_results_name_them(tmp_path):
    """``describe_task`` (the results' ``task`` and ``reward``) from each built-in's config, a user
    class's, and reward functions with weights (shown unless all 1); ``describe_task_object`` for a
    task passed in (the Python API), with its reward functions when it has them."""
    from entprobe.tasks.build import describe_task, describe_task_object
    from entprobe.tasks.reward_funcs import WithRewardFuncs

    for choice, want in ((("task=arithmetic",), ("arithmetic '{a}+{b}='", "numeric")),
                         (("task=arithmetic_question",), ("arithmetic 'What is {a} + {b}?'", "last_number")),
                         (("task=jsonl", "task.path=data/p.jsonl", "task.reward=boxed"), ("jsonl data/p.jsonl", "boxed")),
                         (("task=jsonl", "task.path=p.jsonl", "task.reward_funcs=[math:fabs,math:floor]",
                           "task.reward_weights=[1,0.1]"), ("jsonl p.jsonl", "math:fabs, math:floor (weights 1, 0.1)")),
                         (("task.reward_funcs=[math:fabs]", "task.reward_weights=[1]"),
                          ("arithmetic '{a}+{b}='", "math:fabs")),
                         (("task._target_=my_pkg.MyTask",), ("my_pkg.MyTask", "my_pkg.MyTask.reward"))):
        cfg = compose_cfg(tmp_path, *choice).task
        assert (describe_task(cfg)["task"], describe_task(cfg)["task_reward"]) == want, choice
    assert describe_task(TaskConfig()) == {"task": "arithmetic '{a}+{b}='", "task_reward": "numeric"}  # the typed config
    task = build_task(OmegaConf.structured(TaskConfig()))
    assert describe_task_object(task) == {"task": "entprobe.tasks.arithmetic.ArithmeticTask (passed in)",
                                          "task_reward": "entprobe.tasks.arithmetic.ArithmeticTask.reward"}
    assert describe_task_object(WithRewardFuncs(task, ["math:fabs"], [0.5])) == {
        "task": "entprobe.tasks.arithmetic.ArithmeticTask (passed in)", "task_reward": "math:fabs (weights 0.5)"}
