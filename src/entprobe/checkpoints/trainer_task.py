"""The task of a trainer checkpoint: never a silent default.

A checkpoint folder with the Trainer's ``training_args.bin`` (checkpoints/trainer_args.py) is a run
that trained on its own prompts and rewards, which that file does not hold (TRL's ``reward_funcs``
are callables the Trainer does not save; the dataset neither). Probed without a task, the built-in
arithmetic task with its ``numeric`` reward would stand in for them unannounced, so a config whose
keys choose no task (``TASK_CHOICE_KEYS``) is refused with ``task_not_given``'s message, naming
what to pass; ``task=arithmetic`` given explicitly probes on the built-in task.
"""
from __future__ import annotations

from pathlib import Path

from entprobe.config import ConfigError

# the keys that choose the task: its config group (task=jsonl) or its class; the other task.* keys
# only set options of the task chosen (task.path=... alone leaves the default arithmetic task)
TASK_CHOICE_KEYS = ("task", "task._target_")


class TaskNotGiven(ConfigError):
    """A trainer checkpoint probed without a task: the built-in default would be another task than
    the run's (the message says what to pass)."""


def task_chosen(explicit: set[str]) -> bool:
    """Whether the user's keys (``trainer_args.explicit_keys``) choose the task (``TASK_CHOICE_KEYS``)."""
    return bool(explicit & set(TASK_CHOICE_KEYS))


def task_not_given(path: Path, kind: str, reward_weights=None) -> TaskNotGiven:
    """The refusal of a trainer checkpoint probed without a task (pure): ``kind`` of its
    training_args.bin at ``path`` (``GRPOConfig`` or ``TrainingArguments``) and, for a GRPOConfig,
    its ``reward_weights`` (how many reward functions the run had); the command-line keys that
    give the task."""
    if kind == "GRPOConfig":
        n = len(reward_weights) if isinstance(reward_weights, (list, tuple)) else None
        funcs = ",".join(["<module>:<function>"] * (n or 1))
        how_many = (f"its reward_weights={list(reward_weights)} weigh {n} reward function(s), which the file "
                    "does not name" if n else "the file does not name its reward functions")
        run, give = (f"a TRL GRPOTrainer run (GRPOConfig) that trained on its own prompts and reward functions "
                     f"({how_many})",
                     f"task=jsonl task.path=<the run's prompts .jsonl> 'task.reward_funcs=[{funcs}]' (the run's "
                     "reward functions by import path)")
    else:
        run, give = (f"an HF Trainer run ({kind}) that trained on its own data, which the file does not hold",
                     "task=jsonl task.path=<prompts .jsonl> task.reward=numeric|last_number|boxed (or "
                     "'task.reward_funcs=[<module>:<function>]')")
    return TaskNotGiven(f"task: not given, and {path} shows {run}: the built-in arithmetic task would be probed "
                        f"instead. Give the run's task, e.g. {give}; or task=arithmetic to probe the built-in "
                        "arithmetic task (numeric reward) explicitly")
