"""PEFT / LoRA checkpoints: a frozen base model with an adapter whose parameters are the trainable ones.

A folder that holds ``adapter_config.json`` (what peft's ``save_pretrained`` and a TRL / HF Trainer
run with ``peft_config`` write: ``adapter_config.json``, ``adapter_model.safetensors``,
``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``) is loaded as

- the base model from its own ``save_pretrained`` folder: ``model.base_path``, else the
  ``base_model_name_or_path`` the adapter recorded -- a local folder, never downloaded;
- the adapter applied by peft (``PeftModel.from_pretrained(..., is_trainable=True)``): only the
  adapter's parameters have ``requires_grad``, so they are what the probe differentiates, what
  Adam's preconditioner P and the ground-truth step act on, and what the snapshot copies.

The optimizer state then covers exactly those parameters, in the order the Trainer built its param
groups from the same ``PeftModel`` (checkpoints/optim_state.py matches it by name and shape).
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from entprobe.runtime.input_files import check_safetensors, load_json_file, load_torch_file

ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the wrapped model's parameter names
# peft's per-adapter submodules (LoRA, DoRA's magnitude, IA3, fully trained copies); the adapter's
# name ("default") and ".weight" follow them in a parameter name
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                 "ia3_l", "modules_to_save")
_ADAPTER_NAME = re.compile(rf"^(?:{re.escape(PEFT_PREFIX)})?(.+?)\.(?:{'|'.join(ADAPTER_PARTS)})(?:\.|$)")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class AdapterError(ValueError):
    """A PEFT checkpoint that cannot be loaded as given; the message says which key or file to change."""


def is_adapter_dir(path: str | Path | None) -> bool:
    """True for a folder that holds a PEFT adapter (``adapter_config.json``)."""
    return bool(path) and (Path(path).expanduser() / ADAPTER_CONFIG).is_file()


def adapter_module(name: str) -> str | None:
    """The module an adapter parameter belongs to (``model.layers.0.self_attn.q_proj`` for
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``); None for a
    parameter that is not an adapter's."""
    m = _ADAPTER_NAME.match(name)
    return m.group(1) if m else None


def read_adapter_config(adapter_dir: Path) -> dict:
    return load_json_file(adapter_dir / ADAPTER_CONFIG, "the PEFT adapter config",
                          "copy the adapter checkpoint again (model.path)")


def resolve_base(adapter_dir: Path, base_path: str | None, adapter_cfg: dict) -> Path:
    """The base model's folder: ``model.base_path`` when set, else the adapter's recorded
    ``base_model_name_or_path``. Nothing is downloaded, so a hub id is refused with what to do."""
    if base_path:
        base = Path(base_path).expanduser()
        if not base.is_dir():
            raise AdapterError(f"model.base_path={base_path!r} is not a folder; give the base model's "
                               "save_pretrained folder (config.json + weights)")
    else:
        recorded = adapter_cfg.get("base_model_name_or_path")
        if not recorded:
            raise AdapterError(f"{adapter_dir / ADAPTER_CONFIG} records no base_model_name_or_path: set "
                               "model.base_path=<the base model's save_pretrained folder>")
        base = Path(recorded).expanduser()
        if not base.is_dir():
            if _HUB_ID.match(recorded) and not recorded.startswith((".", "~")):
                raise AdapterError(
                    f"the adapter's base model {recorded!r} (base_model_name_or_path in "
                    f"{adapter_dir / ADAPTER_CONFIG}) is no folder here but a Hugging Face Hub id, and "
                    "entprobe downloads nothing: fetch it where you have access (e.g. `hf download "
                    f"{recorded} --local-dir /models/base`) and set model.base_path=/models/base")
            raise AdapterError(f"the adapter's base model folder {recorded!r} (base_model_name_or_path in "
                               f"{adapter_dir / ADAPTER_CONFIG}) does not exist here: set "
                               "model.base_path=<the base model's save_pretrained folder>")
    if not (base / "config.json").is_file():
        raise AdapterError(f"base model folder {str(base)!r} has no config.json: model.base_path must be a "
                           "save_pretrained folder of the model the adapter was trained on")
    return base


def check_adapter_files(adapter_dir: Path, acfg: dict) -> None:
    """Before anything loads: ``peft_type`` is one peft knows, the weights file reads (safetensors,
    or ``adapter_model.bin`` weights-only: a file holding code is refused, never unpickled) and every
    LoRA matrix has the rank ``r`` (or ``rank_pattern``'s) the config records."""
    from peft.utils import PeftType


    cfg_file = adapter_dir / ADAPTER_CONFIG
    known = [t.value for t in PeftType]
    if acfg.get("peft_type") not in known:
        raise AdapterError(f"{cfg_file}: peft_type {acfg.get('peft_type')!r} is not one this peft "
                           f"knows ({', '.join(known[:6])}, ...); fix it or update peft")
    todo = "copy the adapter checkpoint again (model.path)"
    st, bin_file = adapter_dir / "adapter_model.safetensors", adapter_dir / "adapter_model.bin"
    if st.is_file() or not bin_file.is_file():
        check_safetensors(st, todo)
        from safetensors import safe_open

        with safe_open(str(st), "pt") as f:
            shapes, weights = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, st
    else:
        sd = load_torch_file(bin_file, "the PEFT adapter weights", f"{todo}, or save it as "
                             "adapter_model.safetensors (peft's default) where you trust it")
        if not isinstance(sd, dict) or not all(hasattr(v, "shape") for v in sd.values()):
            raise AdapterError(f"{bin_file}: not a state_dict of tensors; {todo}")
        shapes, weights = {k: tuple(v.shape) for k, v in sd.items()}, bin_file
    if acfg.get("peft_type") != "LORA" or not isinstance(acfg.get("r"), int):
        return
    patterns = acfg.get("rank_pattern") or {}
    for key, shape in shapes.items():
        part = "lora_A" if ".lora_A." in key else "lora_B" if ".lora_B." in key else None
        if part is None or len(shape) != 2:
            continue
        r = next((v for p, v in patterns.items() if re.search(p, key)), acfg["r"])
        got = shape[0] if part == "lora_A" else shape[1]
        if got != r:
            raise AdapterError(f"{weights}: {key} has rank {got} {shape}, but {cfg_file} says r={r}: the weights "
                               "and the config are of different adapters; copy both files of one save")


@dataclass
class Adapter:
    """A PEFT checkpoint resolved on disk, before anything loads."""
    adapter_dir: Path  # adapter_config.json, adapter_model.safetensors (and optimizer.pt, ...)
    base_dir: Path  # the base model's save_pretrained folder
    tokenizer_dir: Path  # the adapter folder when it holds a tokenizer (TRL saves one), else the base
    config: dict  # adapter_config.json


def resolve_adapter(adapter_dir: str | Path, base_path: str | None) -> Adapter:
    """Where the adapter's base and tokenizer are (``resolve_base``), its own files checked
    (``check_adapter_files``); fails early without peft."""
    if importlib.util.find_spec("peft") is None:
        raise ImportError("model.path holds a PEFT adapter (adapter_config.json) and peft is not installed: "
                          "pip install 'entprobe[peft]' (or pip install peft)")
    adapter_dir = Path(adapter_dir).expanduser()
    acfg = read_adapter_config(adapter_dir)
    check_adapter_files(adapter_dir, acfg)
    base_dir = resolve_base(adapter_dir, base_path, acfg)
    tok_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir
    return Adapter(adapter_dir, base_dir, tok_dir, acfg)


def apply_adapter(base: torch.nn.Module, adapter: Adapter) -> tuple[torch.nn.Module, dict]:
    """(the base with the adapter applied by peft, only the adapter trainable; result metadata)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, str(adapter.adapter_dir), is_trainable=True)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    foreign = [n for n, _ in trainable if adapter_module(n) is None]
    acfg = adapter.config
    if not trainable or foreign:
        raise AdapterError(f"{adapter.adapter_dir}: a {acfg.get('peft_type', '?')} adapter whose trainable "
                           f"parameters are {foreign[:3] or 'none'}; entprobe probes LoRA (DoRA), IA3 and "
                           f"modules_to_save adapters, whose parameters are peft's {', '.join(ADAPTER_PARTS)}")
    meta = {"adapter_path": str(adapter.adapter_dir), "adapter_base_path": str(adapter.base_dir),
            "adapter_type": str(acfg.get("peft_type", "")),
            **({"adapter_r": int(acfg["r"])} if isinstance(acfg.get("r"), int) else {}),
            "adapter_trainable_params": sum(p.numel() for _, p in trainable),
            "adapter_frozen_params": sum(p.numel() for p in model.parameters() if not p.requires_grad)}
    return model, meta
