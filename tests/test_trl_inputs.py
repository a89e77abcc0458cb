"""Probing a TRL run: prompts tokenized and rewards computed as TRL's GRPOTrainer itself does.

On the built-in tiny Llama and a tiny model with a chat template, the prompt ids entprobe samples
under ``task.tokenize=trl`` equal the ``prompt_ids`` of GRPOTrainer's own input preparation, for
text prompts (with a tokenizer that adds no special token, and one that adds BOS) and for message
lists. Reward functions written to a module in tmp_path and named by import path give, through
``task.reward_funcs`` / ``task.reward_weights``, the advantages GRPOTrainer computes from the same
functions on the same completions (weights, None rewards, unscorable rows, extra dataset columns).
"""
from __future__ import annotations

import json

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import processors  # noqa: E402

from entprobe.checkpoints.builtin import build_char_tokenizer, build_tiny_llama  # noqa: E402
from entprobe.config import SamplingConfig  # noqa: E402
from entprobe.rollouts.objectives import trl_advantages  # noqa: E402
from entprobe.tasks.prompt_ids import encode_prompts  # noqa: E402
from entprobe.rollouts.sampling import sample_batch  # noqa: E402
from entprobe.tasks import Prompt, build_task  # noqa: E402
from user_rewards import FUNCS, WEIGHTS, rewmod  # noqa: E402,F401  (rewmod: a fixture)

G, MAX_NEW = 4, 5
TEXTS = ["1+2=", "13+4=", "5+16=", "7*7="]
CHATS = [[{"role": "system", "content": "0"}, {"role": "user", "content": t}] for t in TEXTS]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}={% endif %}")

def records(chat: bool) -> list[dict]:
    return [{"prompt": c if chat else t, "answer": str(eval(t[:-1])), "level": i + 1}
            for i, (t, c) in enumerate(zip(TEXTS, CHATS))]


def bos_adding_tokenizer():
    """The built-in tokenizer with a post-processor that puts BOS before every text (as Llama's does)."""
    tok = build_char_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)])
    return tok


def make_trainer(tmp_path, tok, rows: list[dict], reward_funcs=None, reward_weights=None,
                 scale_rewards="group"):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows) * G,
                      num_generations=G, max_completion_length=MAX_NEW, use_cpu=True, report_to=[], bf16=False,
                      save_strategy="no", seed=0, reward_weights=reward_weights, scale_rewards=scale_rewards)
    funcs = reward_funcs or [lambda prompts, completions, **kw: [0.0] * len(completions)]
    return GRPOTrainer(model=build_tiny_llama(len(tok), seed=0), reward_funcs=funcs, args=args,
                       processing_class=tok, train_dataset=Dataset.from_list(rows))


def trl_prompt_ids(tr) -> tuple[list[dict], list[list[int]]]:
    """One generation batch through GRPOTrainer's own input preparation: each row's dataset record
    and its unpadded ``prompt_ids``."""
    batch = next(iter(tr.get_train_dataloader()))
    torch.manual_seed(0)
    out = tr._generate_and_score_completions(batch)
    ids = [row[mask.bool()].tolist() for row, mask in zip(out["prompt_ids"], out["prompt_mask"])]
    return batch, ids


@pytest.mark.parametrize("kind", ["text", "text_bos", "chat"])
def test_prompt_ids_are_grpo_trainers(tmp_path, kind):
    """entprobe's ids (``encode_prompts`` and the prompt block ``sample_batch`` writes) equal the
    prompt ids GRPOTrainer generates from; entprobe's own convention differs (the check can fail)."""
    tok = bos_adding_tokenizer() if kind == "text_bos" else build_char_tokenizer()
    if kind == "chat":
        tok.chat_template = TEMPLATE
    rows = records(kind == "chat")
    batch, theirs = trl_prompt_ids(make_trainer(tmp_path, tok, rows))
    ours = encode_prompts(tok, [r["prompt"] for r in batch], style="trl")
    assert ours == theirs
    if kind == "text":  # the example: TRL does not add the BOS entprobe's own convention adds
        assert theirs[0][0] != tok.bos_token_id
        assert encode_prompts(tok, [batch[0]["prompt"]], "never")[0] == [tok.bos_token_id] + theirs[0]
    if kind == "text_bos":  # the tokenizer's own BOS stays
        assert all(ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id for ids in theirs)
    if kind == "chat":  # the system message is the record's; entprobe would render the text otherwise
        assert encode_prompts(tok, [batch[0]["prompt"][-1]["content"]], "never")[0] != theirs[0]

    class Rows:  # a task whose prompts are the batch's records
        prompts = [Prompt(text=str(r["prompt"]), answer="0", messages=tuple(r["prompt"]) if kind == "chat" else None)
                   for r in batch[::G]]

        def reward(self, response, prompt):
            return 0.0

    b = sample_batch(build_tiny_llama(len(tok), seed=0), tok, Rows(), torch.arange(len(Rows.prompts)), 2,
                     SamplingConfig(max_new_tokens=2), 0, "dr_grpo", 1e-6, style="trl")
    prompt_mask = b.attention_mask * (1 - b.response_mask)
    for n in range(b.B):
        assert b.input_ids[n, 0][prompt_mask[n, 0].bool()].tolist() == theirs[n * G]


def test_verl_renders_every_prompt_through_the_template():
    """verl's RLHFDataset: apply_chat_template(tokenize=False), then add_special_tokens=False; a
    text is one user message."""
    tok = bos_adding_tokenizer()
    tok.chat_template = TEMPLATE
    rendered = tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                       tokenize=False)
    want = tok(rendered, add_special_tokens=False)["input_ids"]
    assert encode_prompts(tok, ["1+2="], style="verl") == [want]
    assert encode_prompts(tok, [[{"role": "user", "content": "1+2="}]], style="verl") == [want]
    assert want.count(tok.bos_token_id) == 1  # the template's BOS, not the post-processor's second one
    plain = build_char_tokenizer()
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(plain, ["1+2="], style="verl")


@pytest.mark.parametrize("kind", ["text", "chat"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch"])
def test_reward_funcs_give_grpo_trainers_advantages(tmp_path, rewmod, kind, scale_rewards):
    """The user's functions, named by import path in a jsonl task, score TRL's own completions: the
    advantages from our rewards equal GRPOTrainer's (weights, None values, unscorable rows), and
    the functions saw the same keyword columns."""
    tok = build_char_tokenizer()
    if kind == "chat":
        tok.chat_template = TEMPLATE
    rows = records(kind == "chat")
    tr = make_trainer(tmp_path, tok, rows, [rewmod.accuracy, rewmod.length_or_none, rewmod.digits_or_none],
                      WEIGHTS, scale_rewards)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = build_task({"_target_": "entprobe.tasks.jsonl.JsonlTask", "path": str(path), "reward_funcs": FUNCS,
                       "reward_weights": WEIGHTS})
    for seed in range(10):  # a generation batch with an unscorable row (every function returned None)
        batch = next(iter(tr.get_train_dataloader()))
        torch.manual_seed(seed)
        out = tr._generate_and_score_completions(batch)
        trl_columns = rewmod.SEEN[-1]
        ids = [row[mask.bool()].tolist() for row, mask in zip(out["completion_ids"], out["completion_mask"])]
        index = [[r["prompt"] for r in rows].index(b["prompt"]) for b in batch]
        texts = tok.batch_decode(ids, skip_special_tokens=True)
        rewards = task.score([task.prompts[i] for i in index], texts, ids)
        if rewards.isnan().any():
            break
    assert rewards.isnan().any(), "the check needs an unscorable row"
    # the same keywords (answer, level, completion_ids, trainer_state, log_extra, log_metric), and
    # message lists for the prompts and completions of a conversational dataset
    assert rewmod.SEEN[-1] == trl_columns
    assert trl_columns[1:] == (("list", "list") if kind == "chat" else ("str", "str"))
    assert (~rewards.isnan()).sum() > 1
    B = len(rows)
    A = trl_advantages(rewards.view(B, G), scale_rewards)
    torch.testing.assert_close(A.reshape(-1), out["advantages"], rtol=1e-6, atol=1e-6)
    assert A.abs().sum() > 0
    unweighted = build_task({"_target_": "entprobe.tasks.jsonl.JsonlTask", "path": str(path), "reward_funcs": FUNCS})
    r1 = unweighted.score([task.prompts[i] for i in index], texts, ids)
    assert not torch.allclose(trl_advantages(r1.view(B, G), scale_rewards), A)  # the weights matter


README_TRL_COMMAND = (
    "python -m entprobe.main model=hf model.path=outputs/grpo/checkpoint-500 task=jsonl "
    "task.path=data/train.jsonl 'task.reward_funcs=[my_rewards:accuracy,my_rewards:brevity]' batch.B_U=2")


def test_readme_probe_your_trl_run_commands_run_verbatim(tmp_path):
    """docs/trl.md "Probe your TRL run": its Python snippet trains one GRPOTrainer step of the built-in
    model (tests/trl_readme_run.py: my_rewards.py and the run as shown, on the CPU), then its
    command probes that checkpoint, verbatim, from the folder that holds my_rewards.py."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, str(here / "trl_readme_run.py"), str(here.parent / "docs" / "trl.md"),
                           str(ensure_default_checkpoint())], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = f"{sys.executable} {README_TRL_COMMAND[len('python '):]}"
    proc = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = Path(tmp_path).glob("outputs/20*/*")
    res = json.loads((run_dir / "results.json").read_text())
    assert res["objective"] == "trl/grpo" and res["SE_deltaH_pred"] > 0  # the run's settings: training_args.bin
    assert (res["G"], res["B_U"]) == (4, 2) and "task.reward_weights=[1.0,0.1] (reward_weights)" in proc.stdout
    r = res["batch_U/reward_mean"]  # accuracy (0 or 1) + 0.1 x brevity (-tokens/4): not a whole number
    assert abs(r - round(r)) > 1e-6 and -1 < r < 1
