"""Prompts too long for the model: refused before the weights load (a 200k-character prompt would
otherwise reach the sampler and ask for tens of GB for its attention).

The model's context is, in order: ``max_position_embeddings`` (or ``n_positions``,
``max_sequence_length``, ``seq_length``; a multimodal config's ``text_config``; extended by its
RoPE scaling) of the ``config.json`` beside the weights; else the tokenizer's ``model_max_length``
when it is a real length (not transformers' 1e30 "no limit"); else ``UNKNOWN_CONTEXT_CAP`` tokens.
A prompt's token count (as the sampler tokenizes it, ``prompt_ids.encode_prompts``: every prompt
of the task, about 0.1 ms each on a CPU core) plus ``sampling.max_new_tokens`` must fit in it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from entprobe.config import ConfigError
from entprobe.runtime.input_files import InputFileError
from entprobe.tasks.prompt_ids import encode_prompts, prompt_kwargs

UNKNOWN_CONTEXT_CAP = 32768  # tokens, when neither the model's config nor its tokenizer states a context
SANE_TOKENIZER_MAX = 10_000_000  # a tokenizer's model_max_length above this is transformers' "no limit"
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
ENCODE_CHUNK = 256  # prompts tokenized per call


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def rope_scaled(config: dict, n: int) -> int:
    """``n`` positions extended by the config's RoPE scaling (``rope_scaling``, or transformers 5's
    ``rope_parameters``): ``original_max_position_embeddings * factor`` when it names the original
    length (YaRN, Llama 3.1: the larger of that and ``n``), else ``n * factor`` (linear, dynamic)."""
    rs = config.get("rope_scaling") or config.get("rope_parameters")
    factor = rs.get("factor") if isinstance(rs, dict) else None
    if not _positive(factor) or factor <= 1:
        return n
    orig = rs.get("original_max_position_embeddings")
    return max(n, int(orig * factor)) if _positive(orig) else int(n * factor)


def config_context(config: dict) -> int | None:
    """The context length a model's ``config.json`` states (``CONTEXT_KEYS``; RoPE scaling
    included, ``rope_scaled``), or None."""
    for c in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            v = c.get(key) if isinstance(c, dict) else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return rope_scaled(c, v)
    return None


def model_context(tokenizer: Any, folders: list, config: dict | None = None) -> tuple[int, str]:
    """``(tokens, where the number comes from)``: the model's ``config`` (a loaded model's
    ``config.to_dict()``) or the first ``config.json`` in ``folders`` that states a context, else
    the tokenizer's sane ``model_max_length``, else ``UNKNOWN_CONTEXT_CAP``."""
    n = config_context(config) if config else None
    if n is not None:
        return n, "the model's config"
    for folder in folders:
        f = Path(str(folder)).expanduser() / "config.json" if folder else None
        if f is None or not f.is_file():
            continue
        try:
            n = config_context(json.loads(f.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue  # a broken config.json is the model loader's to report, naming it
        if n is not None:
            return n, f"{f}"
    n = getattr(tokenizer, "model_max_length", None)
    if isinstance(n, int) and 0 < n <= SANE_TOKENIZER_MAX:
        return n, "the tokenizer's model_max_length"
    return UNKNOWN_CONTEXT_CAP, f"entprobe's cap for a model that states no context ({UNKNOWN_CONTEXT_CAP})"


def longest_prompt(tokenizer, prompts: list, **encode_kwargs) -> tuple[int, int]:
    """``(index, token count)`` of the longest prompt, tokenized as the sampler does."""
    best_i, best_n = 0, -1
    for s in range(0, len(prompts), ENCODE_CHUNK):
        ids = encode_prompts(tokenizer, [p.source for p in prompts[s:s + ENCODE_CHUNK]], **encode_kwargs)
        for j, x in enumerate(ids):
            if len(x) > best_n:
                best_i, best_n = s + j, len(x)
    return best_i, best_n


def check_prompt_lengths(task, tokenizer, cfg, where: str, loaded: str | None = None,
                         config: dict | None = None) -> None:
    """Refuse, before the weights load, a task whose longest prompt plus ``sampling.max_new_tokens``
    exceeds the model's context (``model_context``: ``config``, a model's in memory, else the
    config.json of model.path, model.base_path or the tokenizer's folder), naming the prompt
    (file:line, or the task and its index) and its length."""
    context = model_context(tokenizer, [cfg.model.path, cfg.model.base_path, getattr(
        tokenizer, "name_or_path", None)], config)
    refuse_long_prompts(task, tokenizer, context, int(cfg.sampling.max_new_tokens), where,
                        **prompt_kwargs(cfg, loaded))


def refuse_long_prompts(task, tokenizer, context: tuple[int, str], max_new_tokens: int, where: str,
                        new_key: str = "sampling.max_new_tokens", **encode_kwargs) -> None:
    """The check of ``check_prompt_lengths`` for a known ``context`` (``model_context``'s (tokens,
    source)): the longest prompt (tokenized with ``encode_kwargs``) plus ``max_new_tokens`` (the
    option ``new_key``) must fit in it; else an InputFileError for a file's prompt (file:line), a
    ConfigError for the task's."""
    (n_ctx, source), new = context, int(max_new_tokens)
    i, n = longest_prompt(tokenizer, task.prompts, **encode_kwargs)
    if n + new <= n_ctx:
        return
    p = task.prompts[i]
    at = p.origin or f"{where}, prompt {i}"
    cls = InputFileError if p.origin else ConfigError  # a file's prompt, or the task's config
    raise cls(f"{at}: the prompt is {n} tokens ({len(p.text)} characters), and with {new_key}="
              f"{new} needs {n + new} > the model's context of {n_ctx} tokens ({source}): shorten or drop "
              f"the prompt, or lower {new_key}")
