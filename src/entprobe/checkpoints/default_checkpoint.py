"""The built-in default checkpoint: a tiny Llama, SFT warm-up, then real DR-GRPO steps.

The result is an HF Trainer-layout folder (``model.safetensors``, ``config.json``, tokenizer files,
``optimizer.pt`` with the Trainer's decay / no-decay groups, ``scheduler.pt``,
``trainer_state.json``), so the default run exercises the same loading path as a user checkpoint.
Reproducible from a seed:

    python -m entprobe.train --build-default --out /tmp/ckpt --seed 0      # or: entprobe-build-default

The same command without ``--build-default`` is a small DR-GRPO / GRPO trainer (``grpo_trainer``;
``python -m entprobe.train --help``; cli/train.py).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from entprobe.runtime.atomic_io import staging_dir
from entprobe.runtime.locks import file_lock
from entprobe.checkpoints.builtin import build_char_tokenizer, build_tiny_llama
from entprobe.config import SamplingConfig
from entprobe.math.estimators import y_loss
from entprobe.rollouts.logprobs import token_logprobs
from entprobe.checkpoints.optim_state import trainer_groups
from entprobe.rollouts.objectives import unit_weights
from entprobe.rollouts.sampling import RolloutBatch, draw_prompt_indices, encode_prompts, sample_batch
from entprobe.tasks.arithmetic import ArithmeticTask

# 2: rollouts drawn by the keyed sampler (rollout.generate), one stream per response
RECIPE_VERSION = 2
RECIPE = dict(num_prompts=512, max_operand=9, sft_steps=120, sft_batch=64, sft_lr=3e-3,
              rl_steps=24, rl_batch=16, G=4, rl_lr=1e-3, weight_decay=0.01, max_new_tokens=4)
LOSSES = ("dr_grpo", "grpo")


def default_cache_dir() -> Path:
    return Path(os.environ.get("ENTPROBE_CACHE", Path.home() / ".cache" / "entprobe"))


def trainer_adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over HF Trainer's decay / no-decay param groups (``optim_state.trainer_groups``), with
    the Trainer's default betas and eps: its ``optimizer.pt`` loads as a Trainer's does."""
    groups = trainer_groups(model, weight_decay)
    return torch.optim.AdamW([{k: g[k] for k in ("params", "weight_decay")} for g in groups],
                             lr=lr, betas=(0.9, 0.999), eps=1e-8)


def policy_loss(model, batch: RolloutBatch, loss: str) -> torch.Tensor:
    """The policy-gradient loss of one sampled batch (ratio 1, no KL term), mean over prompts.

    ``dr_grpo``: ``-(1/B) sum_n sum_g A[n,g] S[n,g] / (G Lmax[n])`` (``estimators.y_loss``: the
    objective entprobe probes by default). ``grpo``: ``-(1/B) sum_n sum_g A[n,g] S[n,g] / (G L[n,g])``,
    each response's token mean (TRL's ``loss_type=grpo``; ``objectives.unit_weights``). A is the
    batch's advantage (group-centred for dr_grpo, also divided by the group std for grpo)."""
    ids, att, resp = batch.flat(next(model.parameters()).device)
    S = token_logprobs(model, ids, att, resp).logp.sum(-1).view(batch.B, batch.G)
    if loss == "dr_grpo":
        return -y_loss(S, batch.advantages.to(S.device), batch.Lmax.to(S.device)) / batch.B
    if loss == "grpo":
        w = unit_weights("seq_token_mean", batch.advantages, batch.gen_lengths, batch.Lmax)
        return -(w.to(S.device, S.dtype) * S).sum() / batch.B
    raise ValueError(f"--loss {loss!r}: one of {LOSSES}")


def _sft(model, tok, task, steps: int, batch: int, lr: float, gen: torch.Generator) -> None:
    """Teacher-forced cross-entropy on ``prompt answer EOS`` so that some samples are right."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(len(task.prompts), (batch,), generator=gen).tolist()
        prompts = encode_prompts(tok, [task.prompts[i].text for i in idx], "never")
        answers = [tok(task.prompts[i].answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                   for i in idx]
        rows = [p + a for p, a in zip(prompts, answers)]
        T = max(map(len, rows))
        ids = torch.zeros((batch, T), dtype=torch.long)
        att = torch.zeros_like(ids)
        resp = torch.zeros_like(ids)
        for i, (p, r) in enumerate(zip(prompts, rows)):
            ids[i, T - len(r):] = torch.tensor(r)
            att[i, T - len(r):] = 1
            resp[i, T - len(r) + len(p):] = 1
        loss = -token_logprobs(model, ids, att, resp).logp.sum() / resp.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def build_default_checkpoint(out_dir: str | Path, seed: int = 0, log=print) -> Path:
    """Train the default model and write the Trainer-layout folder to ``out_dir``."""
    t0 = time.perf_counter()
    r = RECIPE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    model = build_tiny_llama(len(tok), seed=seed)
    task = ArithmeticTask(r["num_prompts"], r["max_operand"], seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _sft(model, tok, task, r["sft_steps"], r["sft_batch"], r["sft_lr"], gen)
        opt = trainer_adamw(model, r["rl_lr"], r["weight_decay"])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        sampling = SamplingConfig(max_new_tokens=r["max_new_tokens"])
        history = []
        for step in range(1, r["rl_steps"] + 1):
            idx = draw_prompt_indices(len(task.prompts), r["rl_batch"], seed * 100003 + step)
            batch = sample_batch(model, tok, task, idx, r["G"], sampling, seed * 100003 + step,
                                 "dr_grpo", 1e-6)
            loss = policy_loss(model, batch, "dr_grpo")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            history.append({"step": step, "loss": loss.item(), "learning_rate": sched.get_last_lr()[0],
                            "reward": float(batch.rewards.mean()),
                            "entropy_seq": float(-batch.S_sampler.mean())})
    model.save_pretrained(out)
    tok.save_pretrained(out)
    torch.save(opt.state_dict(), out / "optimizer.pt")
    torch.save(sched.state_dict(), out / "scheduler.pt")
    (out / "trainer_state.json").write_text(json.dumps(
        {"global_step": r["rl_steps"], "log_history": history}, indent=1))
    (out / "entprobe_recipe.json").write_text(json.dumps(
        {"version": RECIPE_VERSION, "seed": seed, **r}, indent=1))
    log(f"[entprobe] built default checkpoint in {time.perf_counter() - t0:.1f}s: reward "
        f"{history[0]['reward']:.2f} -> {history[-1]['reward']:.2f} over {r['rl_steps']} DR-GRPO steps")
    return out


def ensure_default_checkpoint(cache_dir: str | None = None, seed: int = 0) -> Path:
    """The cached default checkpoint, built on first use (atomic: build aside, then rename).

    Processes that need it at once (the ranks of a torchrun job, parallel sweep jobs) take turns
    on ``<target>.lock``: one builds, the others wait and use what it published."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = root / f"default-v{RECIPE_VERSION}-seed{seed}"
    if (target / "optimizer.pt").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    timeout_s = float(os.environ.get("ENTPROBE_DEFAULT_BUILD_TIMEOUT_S", 3600))  # a build takes minutes
    with file_lock(root / f"{target.name}.lock", timeout_s, f"building the default checkpoint {target}",
                   key="ENTPROBE_DEFAULT_BUILD_TIMEOUT_S"):
        if not (target / "optimizer.pt").is_file():
            with staging_dir(target) as tmp:
                build_default_checkpoint(tmp, seed=seed)
    return target
