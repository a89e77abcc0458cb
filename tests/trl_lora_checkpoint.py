"""Write a LoRA checkpoint the way a TRL user does: GRPOTrainer with a peft ``LoraConfig`` on the
built-in model and the arithmetic task, 3 optimizer steps on the CPU, ``checkpoint-3/`` saved by
the Trainer (adapter_config.json, adapter_model.safetensors, optimizer.pt, scheduler.pt,
trainer_state.json, tokenizer). Beside it, ``param_order.json``: the parameter names of the
Trainer's optimizer groups in their stored order, read from the live optimizer (what a test can
match optimizer.pt's positions against independently of entprobe).

    python tests/trl_lora_checkpoint.py BASE_DIR OUT_DIR

Run in its own process: TRL and accelerate set process-wide state (seeds, accelerator state).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

STEPS, LR, WEIGHT_DECAY, RANK = 3, 1e-3, 0.01, 4
TARGETS = ["q_proj", "v_proj", "up_proj"]


def build(base_dir: str, out_dir: str) -> Path:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from entprobe.tasks.arithmetic import ArithmeticTask

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    task = ArithmeticTask(num_prompts=32, max_operand=9, seed=0)
    data = Dataset.from_list([{"prompt": p.text, "answer": p.answer} for p in task.prompts])

    def correct(completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, max_steps=STEPS, save_steps=STEPS, learning_rate=LR,
                      lr_scheduler_type="constant", weight_decay=WEIGHT_DECAY, beta=0.0, loss_type="dr_grpo",
                      use_cpu=True, report_to=[], seed=0, logging_steps=1, disable_tqdm=True,
                      dataloader_num_workers=0)
    lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=TARGETS)
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=args, train_dataset=data,
                          processing_class=tok, peft_config=lora)
    trainer.train()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    order = [[names[id(p)] for p in g["params"]] for g in trainer.optimizer.param_groups]
    (Path(out_dir) / "param_order.json").write_text(json.dumps(order))
    return Path(out_dir) / f"checkpoint-{STEPS}"


if __name__ == "__main__":
    print(build(sys.argv[1], sys.argv[2]))
