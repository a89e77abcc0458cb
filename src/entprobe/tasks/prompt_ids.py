"""How prompts become token ids, as the trainer that made the checkpoint did it (``task.tokenize``).

A prompt is a text or, conversational, a list of ``{"role", "content"}`` messages (TRL's and verl's
``prompt`` column). The conventions:

- ``entprobe`` (the built-in trainer's): a text goes through the tokenizer's chat template when
  ``task.chat_template`` asks for it (``auto``: when the tokenizer has one; ``always``; ``never``),
  as one user message after ``task.system_prompt``; otherwise it is BOS + the text (the tokenizer's
  other special tokens are not added). A message list goes through the template.
- ``trl`` (TRL ``GRPOTrainer._tokenize_prompts``): a message list goes through
  ``apply_chat_template(add_generation_prompt=True, tokenize=True, **chat_template_kwargs)``; a text
  is ``tokenizer(text)``, never templated, with the special tokens the tokenizer itself adds (none
  for the built-in or Qwen tokenizers, BOS for Llama ones).
- ``verl`` (verl's ``RLHFDataset``): the message list is rendered by
  ``apply_chat_template(add_generation_prompt=True, tokenize=False, **chat_template_kwargs)`` and
  tokenized with ``add_special_tokens=False``; a text is taken as one user message (the form verl's
  data-preprocessing scripts write). verl needs a chat template.

``auto`` follows the objective: ``objective=trl`` tokenizes as TRL, ``objective=verl`` as verl,
``objective=entprobe`` as entprobe; the built-in model (``model=tiny``, which entprobe's own trainer
made) always as entprobe.
"""
from __future__ import annotations

from typing import Any

from entprobe.config import ConfigError

STYLES = ("entprobe", "trl", "verl")


def is_conversational(prompt: Any) -> bool:
    """Whether ``prompt`` is a message list (TRL's ``is_conversational`` on a ``prompt`` value)."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict) \
        and "role" in prompt[0] and "content" in prompt[0]


def _value(x: Any) -> str:
    return str(getattr(x, "value", x))


def resolve_style(tokenize: Any, preset: Any, model_source: Any = "hf") -> str:
    """The convention ``task.tokenize`` names, ``auto`` resolved by the objective's preset (the
    built-in model, trained by entprobe: always entprobe)."""
    t = _value(tokenize)
    if t != "auto":
        return t
    p = _value(preset)
    return p if p in STYLES and _value(model_source) != "builtin" else "entprobe"


def style_of(cfg: Any, loaded: str | None = None) -> str:
    """The prompt convention of a root config (``resolve_style`` of its keys). ``loaded``: the
    ``LoadedModel.source`` of the model being probed, when known (a model passed in memory is not
    the built-in checkpoint, whatever ``model`` says)."""
    source = _value(cfg.model.source) if loaded is None else loaded.split(":", 1)[0]
    return resolve_style(cfg.task.tokenize, cfg.objective.preset, source)


def prompt_kwargs(cfg: Any, loaded: str | None = None) -> dict:
    """``sample_batch``'s prompt keywords of a root config: the convention (``style_of``) and its keys."""
    t = cfg.task
    return {"chat_template": _value(t.chat_template),
            "system_prompt": t.system_prompt, "style": style_of(cfg, loaded),
            "template_kwargs": dict(t.chat_template_kwargs or {})}


def style_errors(cfg: Any) -> list[tuple[str, str]]:
    """``(key, message)`` for the task keys of a root config that its prompt convention ignores."""
    task_cfg, style = cfg.task, style_of(cfg)
    if style == "entprobe":
        return []
    errs = []
    chat, named = _value(task_cfg.chat_template), _value(task_cfg.tokenize)
    why = f"tokenizes prompts as {style} does (task.tokenize={named}" + \
        (f" with objective={_value(cfg.objective.preset)})" if named == "auto" else ")")
    if chat != "auto":
        errs.append(("task.chat_template", f"is {chat}, but the probe {why}, which decides the template itself "
                     "(message lists are templated, texts are not): drop the key, or set task.tokenize=entprobe"))
    if task_cfg.system_prompt is not None:
        errs.append(("task.system_prompt", f"is set, but the probe {why}, which uses each prompt as the dataset "
                     "holds it: put the system message in the prompt's message list, or set task.tokenize=entprobe"))
    return errs


def check_template(tokenizer, prompts: list, style: str, where: str) -> None:
    """Refuse, before the weights load, prompts the convention renders through a chat template the
    tokenizer lacks (verl's every prompt; any convention's message lists)."""
    if getattr(tokenizer, "chat_template", None) is not None or not prompts:
        return
    if style == "verl" or is_conversational(prompts[0]):
        what = "every prompt" if style == "verl" else "the prompts (message lists)"
        raise ConfigError(f"{where}: prompts tokenized as {style} does (task.tokenize; auto follows the objective) "
                         f"go through the tokenizer's chat template ({what}), and this tokenizer has none: give "
                         "the trained model's tokenizer (model.tokenizer_path)"
                         + (", or set task.tokenize=entprobe or trl" if style == "verl" else ", or text prompts"))


def _template(tokenizer, messages: list[dict], style: str, template_kwargs: dict) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"task.tokenize={style} renders " + ("every prompt" if style == "verl" else "message lists")
                         + " through the chat template, and the tokenizer has no chat template: give the trained "
                         "model's tokenizer (model.tokenizer_path)" + ("" if style == "verl" else ", or text prompts"))
    if style == "verl":
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    out = tokenizer.apply_chat_template(conversation=[messages], add_generation_prompt=True, tokenize=True,
                                        return_dict=True, **template_kwargs)
    return list(out["input_ids"][0])


def encode_prompts(tokenizer, prompts: list, chat_template: str = "auto", system_prompt: str | None = None,
                   style: str = "entprobe", template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of each prompt (a text or a message list) under the convention ``style`` (module
    docstring); ``chat_template`` and ``system_prompt`` apply to ``entprobe``'s texts only."""
    kw = dict(template_kwargs or {})
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if style not in STYLES:
        raise ValueError(f"task.tokenize={style!r}; one of auto, {', '.join(STYLES)}")
    if style == "entprobe" and chat_template == "always" and not has_template:
        raise ValueError("task.chat_template=always but the tokenizer has no chat template")
    out = []
    for prompt in prompts:
        if is_conversational(prompt):
            msgs = [dict(m) for m in prompt]
            if style == "entprobe" and chat_template == "never":
                raise ValueError("task.chat_template=never, but the prompts are message lists, which only a chat "
                                 "template turns into text: drop task.chat_template or give text prompts")
            if style == "entprobe" and system_prompt and msgs[0]["role"] != "system":
                msgs = [{"role": "system", "content": system_prompt}] + msgs
            out.append(_template(tokenizer, msgs, style, kw))
        elif style == "trl":
            out.append(list(tokenizer(prompt)["input_ids"]))
        elif style == "verl":
            out.append(_template(tokenizer, [{"role": "user", "content": prompt}], style, kw))
        elif chat_template == "always" or (chat_template == "auto" and has_template):
            msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                   [{"role": "user", "content": prompt}]
            out.append(_template(tokenizer, msgs, style, kw))
        else:
            bos = tokenizer.bos_token_id
            out.append(([bos] if bos is not None else []) + list(tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    return out
