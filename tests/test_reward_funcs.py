"""``task.reward_funcs`` (your TRL reward functions, by import path), ``task.tokenize`` and the
``last_number`` reward through the config and a run; against GRPOTrainer itself: test_trl_inputs.py."""
from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import compose_cfg
from entprobe.config import ConfigError
from entprobe.cli.probe_job import run, to_typed
from entprobe.tasks.prompt_ids import prompt_kwargs, resolve_style
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.tasks import build_task
from entprobe.tasks.rewards import last_number_reward, numeric_reward
from entprobe.tasks.reward_funcs import WithRewardFuncs, load_reward_func
from user_rewards import rewmod  # noqa: F401  (a fixture)


def test_last_number_reads_the_final_answer():
    chatty = "First, 3 plus 4 makes 7. So the answer is 1,007."
    assert numeric_reward(chatty, "1007") == 0.0 and last_number_reward(chatty, "1007") == 1.0
    assert last_number_reward("7", "7") == 1.0 and last_number_reward("7 then 8", "7") == 0.0
    assert last_number_reward("-2.50", "-2.5") == 1.0
    assert last_number_reward("no number", "no number") == 1.0  # no number: exact text match
    assert last_number_reward("", "3") == 0.0


@pytest.mark.parametrize("tokenize,preset,source,style", [
    ("auto", "trl", "hf", "trl"), ("auto", "verl", "gguf", "verl"), ("auto", "entprobe", "hf", "entprobe"),
    ("auto", "trl", "builtin", "entprobe"),  # the built-in model was trained by entprobe's own trainer
    ("trl", "entprobe", "builtin", "trl"), ("entprobe", "trl", "hf", "entprobe")])
def test_tokenize_auto_follows_the_objective(tokenize, preset, source, style):
    assert resolve_style(tokenize, preset, source) == style


@pytest.mark.parametrize("overrides,key", [
    (("objective=trl", "task.tokenize=trl", "task.chat_template=never"), "task.chat_template"),
    (("task.tokenize=verl", "task.system_prompt=be brief"), "task.system_prompt"),
    (("task.reward_weights=[1.0]",), "task.reward_weights"),
    (("task.reward_funcs=[a:b]", "task.reward_weights=[1.0,2.0]"), "task.reward_weights"),
])
def test_config_refusals(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        to_typed(compose_cfg(tmp_path, *overrides))


def test_reward_func_errors(rewmod):
    """Bad functions fail early (at the import path) or at their first call, naming the function."""
    for path, msg in (("nosuchmod:f", "module 'nosuchmod' cannot be imported"),
                      ("rewmod:nope", "module 'rewmod' has no 'nope'"),
                      ("rewmod:NOT_CALLABLE", "is a int, not a callable"), ("accuracy", "not an import path")):
        with pytest.raises(ConfigError, match=msg):
            load_reward_func(path)
    task = build_task({"_target_": "entprobe.tasks.arithmetic.ArithmeticTask", "num_prompts": 4})
    rows = task.prompts[:2]
    with pytest.raises(ValueError, match="rewmod:wrong_length returned 1 rewards for 2 completions"):
        WithRewardFuncs(task, ["rewmod:wrong_length"]).score(rows, ["1", "2"], [[4], [5]])
    with pytest.raises(ValueError, match=r"rewmod:words returned 'good' \(str\) for row 0"):
        WithRewardFuncs(task, ["rewmod:words"]).score(rows, ["1", "2"], [[4], [5]])
    with pytest.raises(ConfigError, match="2 values for 1 task.reward_funcs"):
        WithRewardFuncs(task, ["rewmod:accuracy"], [1.0, 2.0])
    # an arithmetic prompt's keyword column is its answer
    got = WithRewardFuncs(task, ["rewmod:accuracy"]).score(rows, [rows[0].answer, "x"], [[4], [5]])
    assert got.tolist() == [1.0, 0.0]


def test_a_bad_reward_path_fails_before_the_model_loads(tmp_path, monkeypatch):
    import entprobe.cli.probe_job as main

    monkeypatch.setattr(main, "load_probe", lambda cfg: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match="task.reward_funcs: 'nosuchmod:f'"):
        run(compose_cfg(tmp_path, "task.reward_funcs=[nosuchmod:f]"))


def test_run_with_reward_funcs_on_jsonl_columns_tokenized_as_trl(tmp_path, rewmod):
    """A run scores with the user's functions (the jsonl's extra column reaches them), samples
    prompts as TRL tokenizes them (no BOS on the built-in tokenizer), and refuses to load these
    batches under another tokenization."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": 2 * a, "level": a}) + "\n"
                            for a in range(1, 9)))
    args = ("task=jsonl", f"task.path={data}", "task.reward_funcs=[rewmod:length_or_none,rewmod:accuracy]",
            "task.reward_weights=[0.1,1.0]", "task.tokenize=trl", "importance.enabled=false")
    res = run(compose_cfg(tmp_path / "a", *args, f"batch.save={tmp_path / 'b'}"))
    assert rewmod.SEEN and sorted(rewmod.SEEN[-1][0]) == ["answer", "completion_ids", "level", "log_extra",
                                                          "log_metric", "trainer_state"]
    U = RolloutBatch.load(tmp_path / "b" / "U.pt")
    prompt = U.input_ids[0, 0][(U.attention_mask * (1 - U.response_mask))[0, 0].bool()]
    bos = 1
    assert prompt[0] != bos and len(prompt) == 4  # "a+a=": four characters, nothing added
    assert prompt_kwargs(to_typed(compose_cfg(tmp_path, *args)))["style"] == "trl"
    assert res["batch_U/reward_mean"] == pytest.approx(float(U.rewards.nanmean()))
    assert not torch.equal(U.rewards, torch.zeros_like(U.rewards))
    with pytest.raises(ConfigError, match="sampled with task="):
        run(compose_cfg(tmp_path / "c", *args[:-2], "importance.enabled=false", f"batch.load={tmp_path / 'b'}"))


def test_jsonl_message_list_prompts(tmp_path):
    """Conversational records keep their messages and fields; both kinds in one file, or a bad
    message, are refused naming the line."""
    from entprobe.tasks.jsonl import JsonlTask

    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"prompt": chat, "answer": 2, "id": 7}) + "\n" + json.dumps({"prompt": chat}) + "\n")
    p = JsonlTask(str(f), reward_funcs=["m:f"]).prompts  # with reward functions the answer is optional
    assert p[0].source == chat and p[0].fields == {"answer": 2, "id": 7} and p[1].fields == {"answer": None, "id": None}
    with pytest.raises(ValueError, match="chat.jsonl:2: each record needs 'prompt' and 'answer'"):
        JsonlTask(str(f))
    f.write_text(json.dumps({"prompt": chat, "answer": 2}) + "\n" + json.dumps({"prompt": "1+1=", "answer": 2}) + "\n")
    with pytest.raises(ValueError, match="prompts of both kinds"):
        JsonlTask(str(f))
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": 3}], "answer": 2}) + "\n")
    with pytest.raises(ValueError, match="chat.jsonl:1: message .* string 'content'"):
        JsonlTask(str(f))


def test_template_needed_before_the_weights_load():
    from entprobe.checkpoints.builtin import build_char_tokenizer
    from entprobe.tasks.prompt_ids import check_template

    tok = build_char_tokenizer()
    chat = [{"role": "user", "content": "1+1="}]
    check_template(tok, ["1+1="], "trl", "t")  # TRL tokenizes a text without a template
    for prompts, style in ((["1+1="], "verl"), ([chat], "trl"), ([chat], "entprobe")):
        with pytest.raises(ValueError, match="tokenizer has none"):
            check_template(tok, prompts, style, "t")


def test_batches_saved_before_the_task_keys_existed_still_load(tmp_path):
    """A fingerprint without tokenize / reward_funcs reads as what was done then (entprobe's
    tokenization, the built-in reward); under TRL's tokenization those batches are refused."""
    from entprobe.rollouts.saved_batches import check_saved, task_fingerprint

    cfg = to_typed(compose_cfg(tmp_path))
    old = {k: v for k, v in task_fingerprint(cfg).items()
           if k not in ("tokenize", "chat_template_kwargs", "reward_funcs", "reward_weights")}
    B = RolloutBatch(*(torch.zeros(4, 4, 3, dtype=torch.long) for _ in range(3)), torch.zeros(4, 4, 3),
                     torch.zeros(4, 4), torch.zeros(4, 4), torch.arange(4))
    check_saved(tmp_path, B, B, {"task": old}, cfg)
    with pytest.raises(ConfigError, match="task"):
        check_saved(tmp_path, B, B, {"task": old}, to_typed(compose_cfg(tmp_path, "task.tokenize=trl")))


def test_a_model_in_memory_is_not_the_built_in_checkpoint(tmp_path):
    """``entprobe.probe`` / the online probe pass the model in memory: ``auto`` follows the objective
    there although the config's model group is the built-in one."""
    from entprobe.tasks.prompt_ids import style_of

    cfg = to_typed(compose_cfg(tmp_path, "objective=trl"))
    assert style_of(cfg) == "entprobe" and style_of(cfg, "builtin:/cache/default") == "entprobe"
    assert style_of(cfg, "memory:LlamaForCausalLM") == "trl"
    assert prompt_kwargs(cfg, "memory:LlamaForCausalLM")["style"] == "trl"


def test_a_reward_function_that_exits_raises_or_returns_nan_is_named_with_the_row(monkeypatch):
    """sys.exit inside a user's function ended the run with its code and no message; NaN was read
    as None (and all-None rewards reported as 'equal rewards'). Now each names the function."""
    import math
    from entprobe.reporting.verdict import flags
    from entprobe.tasks.base import RewardFunctionError, score_rows
    import user_rewards
    task = build_task({"_target_": "entprobe.tasks.arithmetic.ArithmeticTask", "num_prompts": 2})
    rows, texts = task.prompts[:2], ["7", "8"]
    for name, says in (("exits_3", "user_rewards:exits_3 called sys.exit(3) while scoring the 2 completions"),
                       ("raises_key_error", "raised KeyError: 'no_such_column'"),
                       ("nan_for_second", f"returned nan for row 1 (prompt {rows[1].text!r}, response '8')"),
                       ("inf_reward", "returned inf for row 0")):
        with pytest.raises(RewardFunctionError, match=re.escape(says)):
            WithRewardFuncs(task, [f"user_rewards:{name}"]).score(rows, texts, [[4], [5]])
    assert WithRewardFuncs(task, ["user_rewards:always_none"]).score(rows, texts, [[4], [5]]).isnan().all()
    nan_task = user_rewards.NanRewardTask(2)
    with pytest.raises(RewardFunctionError, match=r"NanRewardTask: its reward\(response, prompt\) returned nan for row 0"):
        score_rows(nan_task, nan_task.prompts, texts, [[4], [5]])
    monkeypatch.setattr(nan_task, "reward", lambda r, p: "1")  # a string is not a reward either
    with pytest.raises(RewardFunctionError, match=r"returned '1' \(str\) for row 0"):
        score_rows(nan_task, nan_task.prompts, texts, [[4], [5]])
    (flag,) = flags({"batch_U/frac_zero_var_groups": 1.0, "batch_U/reward_mean": math.nan})
    assert flag[0] == "empty_gradient" and "no U response has a reward" in flag[1]
