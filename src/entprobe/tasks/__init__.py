"""Tasks: prompts with reference answers and a verifiable reward.

A task is any object with ``prompts: list[Prompt]`` and ``reward(response_text, prompt) -> float``
(the ``Task`` protocol). Built-ins are chosen by ``task._target_``; your own class works the same way.
Also how prompts become token ids (tasks/prompt_ids.py) and reward functions by import path
(reward_funcs.py). Imports config and runtime only.
"""
from entprobe.tasks.base import Prompt, Task
from entprobe.tasks.build import build_task
from entprobe.tasks.rewards import boxed_reward, extract_boxed, numeric_reward

__all__ = ["Prompt", "Task", "build_task", "numeric_reward", "boxed_reward", "extract_boxed"]
