"""Checks that need no model, run before it loads (seconds instead of minutes to a bad-input error):
the task's reward functions import, the model's files are there and intact, the optimizer state
exists when the geometry needs one and is readable, finite and has a next-step lr, and batches to
load fit the config.

    inputs = check_inputs(cfg)      # then load_model, build_geometry(..., inputs.optimizer_state), ...
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from entprobe.rollouts.saved_batches import check_saved, load_batches, model_identity
from entprobe.config import ConfigError, EntprobeConfig, check_offline
from entprobe.runtime.input_files import InputFileError, check_gguf, check_safetensors, load_json_file, load_torch_file
from entprobe.checkpoints.optim_state import StoredOptimizerState, match_by_position, read_optimizer_state
from entprobe.checkpoints.peft import is_adapter_dir, resolve_adapter
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.tasks.reward_funcs import load_reward_func
from entprobe.checkpoints.trainer_states import weights_hint
from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint
from entprobe.checkpoints.models import locate_gguf


@dataclass
class CheckedInputs:
    model_dir: Path | None  # the folder the weights come from (None for a GGUF file)
    gguf: Path | None
    identity: dict  # {"model", "tokenizer"} file digests (saved batches' fingerprint)
    optimizer_state: StoredOptimizerState | None  # None: plain SGD geometry, no state
    loaded: tuple[RolloutBatch, RolloutBatch, dict | None] | None  # batch.load's (E, U, fingerprint)


def _check_hf_folder(folder: Path, key: str) -> None:
    """config.json parses; the weights are there and (safetensors) complete. A sharded trainer's
    folder without HF weights is named with how to get them (``trainer_states.weights_hint``)."""
    todo = f"point {key} at a save_pretrained folder (config.json + weights)"
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        hint = weights_hint(folder)
        if hint:
            raise ConfigError(f"{key}={folder}: no HF weights there; {hint}")
    load_json_file(folder / "config.json", "the model config", todo)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(load_json_file(index, "the weights index", todo).get("weight_map", {}).values()))
        weights = [folder / s for s in shards]
    else:
        weights = sorted(folder.glob("*.safetensors"))
    for w in weights:
        check_safetensors(w, f"copy the checkpoint again ({key})")
    if not weights:
        for b in sorted(folder.glob("pytorch_model*.bin")):
            check_torch_weights(b, key)
    if not weights and not any(folder.glob("pytorch_model*.bin")):
        raise ConfigError(f"{key}={folder}: no weights (model.safetensors or pytorch_model.bin); {todo}")


def check_torch_weights(path: Path, key: str) -> None:
    """A ``pytorch_model*.bin`` reads weights-only (memory-mapped: nothing is copied in); one that
    holds code is refused, and never unpickled."""
    import torch

    todo = f"copy the checkpoint again ({key})"
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return
    except Exception as exc:
        if "weights only" not in str(exc).lower():
            load_torch_file(path, "the model weights", todo)  # a legacy (non-zip) file, or a damaged one
            return
    raise InputFileError(f"{path}: holds pickled Python code or objects besides tensors, which entprobe never "
                         "unpickles (nothing from a checkpoint is executed); if you trust its source, convert it to "
                         f"model.safetensors (load it and save_pretrained(..., safe_serialization=True)) and set "
                         f"{key} to that folder")


def model_files(cfg: EntprobeConfig) -> tuple[Path | None, Path | None]:
    """(weights folder, GGUF file) of ``cfg.model``, checked; builds the built-in default on first use."""
    m = cfg.model
    source = m.source.value
    if m.tokenizer_path and not Path(m.tokenizer_path).expanduser().exists():
        raise ConfigError(f"model.tokenizer_path={m.tokenizer_path!r} does not exist")
    if source == "builtin":
        return ensure_default_checkpoint(m.cache_dir, seed=m.builtin_seed), None
    if source == "hf":
        folder = Path(m.path).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"model.path={m.path!r} must be a save_pretrained folder (config.json + weights) "
                              "or a PEFT adapter folder (adapter_config.json); nothing is downloaded")
        if is_adapter_dir(folder):  # a PEFT adapter: its weights here, the base's in their own folder
            adapter = resolve_adapter(folder, m.base_path)  # its files checked too
            _check_hf_folder(adapter.base_dir, "model.base_path")
        else:
            _check_hf_folder(folder, "model.path")
        return folder, None
    try:
        folder, name = locate_gguf(m.gguf_file, m.gguf_package)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    gguf = Path(folder) / name
    check_gguf(gguf, "give an intact GGUF file (model.gguf_file) or reinstall its package (model.gguf_package)")
    return None, gguf


def optimizer_state_path(cfg: EntprobeConfig, model_dir: Path | None) -> str | None:
    """``optimizer.state_path``, else the model's own folder when it holds an optimizer.pt."""
    if cfg.optimizer.state_path:
        return cfg.optimizer.state_path
    if model_dir is not None and (model_dir / "optimizer.pt").is_file():
        return str(model_dir)
    return None


def check_state_fits_config(state: StoredOptimizerState, model_dir: Path | None, trust_remote_code: bool) -> None:
    """optimizer.pt against the model its ``config.json`` describes, before any weight loads: the model
    is built on the meta device (shapes, no memory, no weights read: well under a second for a 7B
    config) and matched exactly as after loading (``optim_state.match_by_position``: HF Trainer's
    decay / no-decay groups, every size and shape), so a state from another model is refused in
    seconds, naming its first bad parameter, instead of after the model has loaded. Left to the
    load: a sharded trainer's state (matched by name), a PEFT adapter (its trainable parameters are
    the adapter's), a GGUF file (no config.json), and a config transformers cannot build (the load
    says what is wrong with it)."""
    if state.named is not None or model_dir is None or is_adapter_dir(model_dir):
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            shapes = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - the real load reports a config it cannot build
        return
    match_by_position(shapes, state)


def check_inputs(cfg: EntprobeConfig) -> CheckedInputs:
    """Every check that needs no model, in the order a user fixes them."""
    check_offline(cfg)
    o = cfg.optimizer
    for path in cfg.task.reward_funcs:  # they import and are callable
        load_reward_func(path)
    model_dir, gguf = model_files(cfg)
    path = optimizer_state_path(cfg, model_dir)
    state = None
    if path is None:
        if o.preconditioner.value == "adam":
            where = "the GGUF file holds weights only" if gguf is not None else f"{model_dir} has no optimizer.pt"
            raise ConfigError(
                f"no optimizer state ({where}): set optimizer.state_path=<optimizer.pt or a Trainer checkpoint "
                "folder> for Adam geometry, or optimizer.preconditioner=identity optimizer.lr=<lr> "
                "to probe in plain SGD geometry")
        if o.lr is None:
            raise ConfigError("optimizer.lr is required with optimizer.preconditioner=identity and no state "
                              "(there is no schedule to read it from)")
    else:
        state = read_optimizer_state(path, o.lr)
        check_state_fits_config(state, model_dir, bool(cfg.model.trust_remote_code))
    tok_dir = Path(cfg.model.tokenizer_path).expanduser() if cfg.model.tokenizer_path else None
    if model_dir is not None and is_adapter_dir(model_dir):  # the policy is the base and the adapter
        adapter = resolve_adapter(model_dir, cfg.model.base_path)
        identity = model_identity(adapter.base_dir, None, tok_dir or adapter.tokenizer_dir, adapter_dir=model_dir)
    else:
        identity = model_identity(model_dir, gguf, tok_dir)
    loaded = None
    if cfg.batch.load:
        loaded = load_batches(cfg.batch.load, cfg.batch.lock_timeout_s)
        check_saved(Path(cfg.batch.load), *loaded, cfg, identity)
    return CheckedInputs(model_dir, gguf, identity, state, loaded)
