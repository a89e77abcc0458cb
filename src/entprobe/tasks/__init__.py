"""Tasks: prompts with reference answers and a verifiable reward.

A task is any object with ``prompts: list[Prompt]`` and ``reward(response_text, prompt) -> float``
(the ``Task`` protocol). Built-ins are chosen by ``task._target_``; your own class works the same way.
"""
from entprobe.tasks.base import Prompt, Task, build_task
from entprobe.tasks.rewards import boxed_reward, extract_boxed, numeric_reward

__all__ = ["Prompt", "Task", "build_task", "numeric_reward", "boxed_reward", "extract_boxed"]
