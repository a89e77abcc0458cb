"""Run docs/trl.md's "Probe your TRL run" Python snippet on the built-in model: ``my_rewards.py``
written from it into the working folder, the GRPOTrainer run executed as shown for one optimizer
step, its checkpoint saved where that page's probe command reads it. (The file's name is from when
the section was in README.md.)

    python tests/trl_readme_run.py docs/trl.md BUILTIN_CHECKPOINT   (in the folder the command runs in)

Run in its own process: TRL and accelerate set process-wide state.
"""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

CHECKPOINT = "outputs/grpo/checkpoint-500"  # the folder the doc's command names


def snippet(doc: Path) -> tuple[str, str]:
    """(reward module, run) of the section's Python block."""
    section = doc.read_text().split("## Probe your TRL run", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    rewards, run = block.split("# the run:", 1)
    return rewards, run


def on_cpu_one_step(config_cls):
    """The snippet's GRPOConfig on the CPU (fp32), for one optimizer step saved as a checkpoint (a
    constant schedule: the next step's lr is not 0, as it is not at step 500 of a longer run)."""
    def make(**kwargs):
        return config_cls(**kwargs, use_cpu=True, bf16=False, report_to=[], max_steps=1, save_steps=1, seed=0,
                          lr_scheduler_type="constant", disable_tqdm=True, dataloader_num_workers=0)
    return make


def main(doc: str, builtin: str) -> None:
    import json

    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from entprobe.tasks.arithmetic import ArithmeticTask

    rewards, run = snippet(Path(doc))
    Path("my_rewards.py").write_text(rewards)
    Path("data").mkdir(exist_ok=True)
    Path("data/train.jsonl").write_text("".join(json.dumps({"prompt": p.text, "answer": p.answer}) + "\n"
                                                for p in ArithmeticTask(num_prompts=32).prompts))
    sys.path.insert(0, ".")
    import my_rewards

    ns = {"model": AutoModelForCausalLM.from_pretrained(builtin, attn_implementation="eager"),
          "tokenizer": AutoTokenizer.from_pretrained(builtin), "GRPOTrainer": GRPOTrainer,
          "GRPOConfig": on_cpu_one_step(GRPOConfig), "load_dataset": load_dataset, **vars(my_rewards)}
    exec("# the run:" + run, ns)
    ns["trainer"].train()
    shutil.move("outputs/grpo/checkpoint-1", CHECKPOINT)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
