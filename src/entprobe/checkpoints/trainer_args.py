"""The run's own settings from a TRL checkpoint's ``training_args.bin`` (``model.trainer_args``).

HF's ``Trainer`` saves its arguments beside every checkpoint (``torch.save(self.args,
"training_args.bin")``): for TRL's ``GRPOTrainer`` a pickled ``GRPOConfig``. ``model=hf
model.path=<checkpoint-N>`` then needs nothing else: the objective (``objective=trl``,
``loss_type``, ``scale_rewards``, ...), the sampling (``num_generations``, ``max_completion_length``,
``temperature``, ``top_k``, ``top_p``), the reward weights and AdamW's settings are read from the
file, and each key taken is printed (``entprobe: from .../training_args.bin: batch.G=8
(num_generations)``). A key set on the command line, or in the chosen experiment preset or local
config (``set_in_config_files``), wins over the file; ``model.trainer_args=ignore`` does not read it.

Nothing is executed: the pickle is read by ``SafeArgsUnpickler``, whose ``find_class`` gives an
inert record (``_Record``: constructor arguments and state, no code) for GRPOConfig /
TrainingArguments and for the classes of transformers, accelerate and TRL they hold (enums,
AcceleratorConfig, PartialState, torch.device); any other global (``os.system``, a user's class)
stops the read with an ``InputFileError`` naming it. Fields are read by name, so files of other TRL
versions (fields added or gone) read too; a field an older TRL lacks takes that version's behaviour
(``TRL_BEFORE_FIELDS``).

The task is never taken by default for such a checkpoint: the run trained on its own prompts and
rewards, which the file does not hold, so a config that does not choose a task (``task=...`` or
``task._target_`` on the command line, or in the experiment preset / local config) is refused
(``TaskNotGiven``, checkpoints/trainer_task.py) with what to pass; ``task=arithmetic`` given
explicitly still probes on the built-in task.

Not in the file: the reward functions (``reward_funcs`` are Python callables the Trainer does not
save; name them with ``task.reward_funcs``), the lr of the next step (``learning_rate`` is the
schedule's peak; the step's lr comes from the checkpoint's optimizer/scheduler state) and the
prompts per step (``per_device_train_batch_size`` x processes x ``gradient_accumulation_steps``:
the number of processes is not saved; set ``batch.B_U``). verl checkpoints hold no trainer config
(``global_step_N/actor/`` has the rank files, ``fsdp_config.json`` and ``huggingface/``; verl's
Hydra config is in the run's output folder), so they are not read.
"""
from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from entprobe.checkpoints.trainer_task import task_chosen, task_not_given
from entprobe.runtime.input_files import InputFileError

FILE = "training_args.bin"
TOP_CLASSES = {"trl.trainer.grpo_config.GRPOConfig": "GRPOConfig",
               "transformers.training_args.TrainingArguments": "TrainingArguments"}
# what a TrainingArguments / GRPOConfig holds besides plain values: enums (SchedulerType,
# IntervalStrategy, OptimizerNames, DistributedType, ...), AcceleratorConfig, PartialState
INNER_MODULES = ("transformers.", "accelerate.", "trl.")
INNER_GLOBALS = {"torch.device"}
MAX_BYTES = 16 << 20  # a GRPOConfig pickles to ~10 KB
IGNORE = "set model.trainer_args=ignore (and give the run's settings as overrides)"
# a field an older TRL did not have, and what that version did (TRL < 0.16: only the grpo loss, group std)
TRL_BEFORE_FIELDS = {"loss_type": "grpo", "scale_rewards": "group", "num_iterations": 1, "epsilon": 0.2}
# fields whose other values change the step in ways the probe does not model (noted, not refused)
NOT_MODELLED = {"mask_truncated_completions": False, "top_entropy_quantile": 1.0, "min_p": None,
                "repetition_penalty": 1.0, "delta": None, "entropy_coef": 0.0}


class _Record:
    """An inert stand-in for an allowlisted class: keeps what the pickle passes (``args``, the
    ``state`` dict) and runs nothing else."""
    qualname = ""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state = args, {}
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots dict)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = dict(state) if isinstance(state, dict) else {}


_STANDINS: dict[str, type] = {}


def _standin(full_name: str) -> type:
    """The record class that stands for ``full_name`` (one per name, so a record knows what it was)."""
    if full_name not in _STANDINS:
        _STANDINS[full_name] = type(full_name.rsplit(".", 1)[-1], (_Record,), {"qualname": full_name})
    return _STANDINS[full_name]


class _Refused(pickle.UnpicklingError):
    """The pickle asks for something outside the allowlist (its message says what)."""


class SafeArgsUnpickler(pickle.Unpickler):
    """Unpickles a TrainingArguments / GRPOConfig into records: only those two and the classes of
    transformers, accelerate and TRL inside them become (inert) records; any other global raises."""

    def find_class(self, module: str, name: str):
        full = f"{module}.{name}"
        if full in TOP_CLASSES or full in INNER_GLOBALS or module.startswith(INNER_MODULES):
            return _standin(full)
        raise _Refused(f"global {full}")

    def persistent_load(self, pid):
        raise _Refused("a tensor")


def read_args(path: str | Path) -> tuple[str, dict[str, Any]]:
    """(``GRPOConfig`` or ``TrainingArguments``, its fields by name) of a ``training_args.bin``,
    read without executing anything; an ``InputFileError`` naming the file otherwise."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise InputFileError(f"{path}: {size} bytes, not the trainer's arguments (a few KB); {IGNORE}")
    try:
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            data = z.read(name) if name and z.getinfo(name).file_size <= MAX_BYTES else None
    except zipfile.BadZipFile:
        data = None
    if data is None:
        raise InputFileError(f"{path}: not a file torch.save wrote (no zip archive with data.pkl); {IGNORE}")
    try:
        top = SafeArgsUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise InputFileError(f"{path}: refused: it holds {exc}, which is not part of TRL's GRPOConfig or "
                             "transformers' TrainingArguments (nothing from a checkpoint is executed); "
                             f"{IGNORE}") from None
    except Exception as exc:  # truncated or corrupt pickles: UnpicklingError, EOFError, ValueError, ...
        raise InputFileError(f"{path}: cannot be read ({type(exc).__name__} while unpickling; a truncated "
                             f"copy?); {IGNORE}") from None
    kind = TOP_CLASSES.get(getattr(top, "qualname", ""))
    if kind is None:
        what = getattr(top, "qualname", "") or type(top).__name__
        raise InputFileError(f"{path}: holds {what}, not TRL's GRPOConfig or transformers' TrainingArguments; "
                             f"{IGNORE}")
    return kind, dict(top.state)


def _value(v):
    """A field's plain value: an enum's record -> its value."""
    if isinstance(v, _Record):
        return v.args[0] if len(v.args) == 1 else None
    return v


@dataclass(frozen=True)
class Setting:
    key: str  # entprobe's dotted config key
    value: Any
    source: str  # the GRPOConfig / TrainingArguments field(s), as printed


def _number(fields: dict, name: str, kind: type, path: Path):
    v = _value(fields[name])
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputFileError(f"{path}: field {name} is {v!r}, not a number; {IGNORE}")
    return kind(v)


def _objective(fields: dict, path: Path) -> list[Setting]:
    """``objective=trl`` and its keys from a GRPOConfig's fields (older TRL: ``TRL_BEFORE_FIELDS``)."""
    out = [Setting("objective.preset", "trl", "GRPOConfig")]
    for name in ("loss_type", "scale_rewards"):
        if name in fields:
            v = _value(fields[name])
            out.append(Setting(f"objective.{name}", {True: "group", False: "none"}[v] if isinstance(v, bool)
                               else str(v), name))
        else:
            out.append(Setting(f"objective.{name}", TRL_BEFORE_FIELDS[name], f"no {name}: TRL < 0.16"))
    for name, typ in (("beta", float), ("num_iterations", int), ("epsilon", float), ("epsilon_high", float)):
        if name in fields:
            out.append(Setting(f"objective.{name}", _number(fields, name, typ, path), name))
        elif name in TRL_BEFORE_FIELDS:
            out.append(Setting(f"objective.{name}", TRL_BEFORE_FIELDS[name], f"no {name}: an older TRL"))
    return out


def _sampling(fields: dict, path: Path) -> list[Setting]:
    """The group size and generation settings: ``max_completion_length`` is both the sampling cap
    and dr_grpo's constant normaliser."""
    out = []
    length = _number(fields, "max_completion_length", int, path) if "max_completion_length" in fields else None
    if length is not None:
        out += [Setting("objective.max_completion_length", length, "max_completion_length"),
                Setting("sampling.max_new_tokens", length, "max_completion_length")]
    for name, key, typ, if_none in (("num_generations", "batch.G", int, None),
                                    ("temperature", "sampling.temperature", float, None),
                                    ("top_k", "sampling.top_k", int, 0), ("top_p", "sampling.top_p", float, None)):
        v = _number(fields, name, typ, path) if name in fields else None
        if v is not None or (name in fields and if_none is not None):
            out.append(Setting(key, if_none if v is None else v, name))
    return out


def _task(fields: dict, reward_funcs: int) -> tuple[list[Setting], list[str]]:
    """``reward_weights`` (when ``reward_funcs`` functions are named, as many) and the template kwargs."""
    out, notes = [], []
    weights = _value(fields.get("reward_weights"))
    if weights is not None and reward_funcs == len(weights):
        out.append(Setting("task.reward_weights", [float(w) for w in weights], "reward_weights"))
    elif weights is not None:
        notes.append(f"reward_weights={list(weights)} not taken: the reward functions are not in the file; "
                     "name them with task.reward_funcs (one per weight) to use the weights")
    kwargs = _value(fields.get("chat_template_kwargs"))
    if isinstance(kwargs, dict) and kwargs:
        out.append(Setting("task.chat_template_kwargs", dict(kwargs), "chat_template_kwargs"))
    return out, notes


def _not_modelled(fields: dict) -> list[str]:
    """A note for each field set away from its default in a way the probe does not model."""
    get = fields.get
    odd = [(n, _value(get(n))) for n, d in NOT_MODELLED.items() if _value(get(n)) not in (d, None)]
    if _value(get("use_vllm")) and _value(get("vllm_importance_sampling_correction")):
        odd.append(("vllm_importance_sampling_correction", True))
    if _value(get("multi_objective_aggregation")) not in (None, "sum_then_normalize"):
        odd.append(("multi_objective_aggregation", _value(get("multi_objective_aggregation"))))
    return [f"{n}={v!r} is not modelled (docs/objectives.md): the probed step is not the run's" for n, v in odd]


def _optimizer(fields: dict, path: Path) -> list[Setting]:
    """AdamW's betas, eps and weight decay (an ``adamw*`` ``optim`` only) and the clipping norm."""
    out = []
    if str(_value(fields.get("optim", "adamw"))).startswith("adamw"):
        if "adam_beta1" in fields and "adam_beta2" in fields:
            out.append(Setting("optimizer.betas", [_number(fields, "adam_beta1", float, path),
                                                   _number(fields, "adam_beta2", float, path)],
                               "adam_beta1, adam_beta2"))
        for name, key in (("adam_epsilon", "optimizer.eps"), ("weight_decay", "optimizer.weight_decay")):
            if name in fields:
                out.append(Setting(key, _number(fields, name, float, path), name))
    if "max_grad_norm" in fields:
        norm = _number(fields, "max_grad_norm", float, path)
        out.append(Setting("importance.max_grad_norm", norm if norm else None, "max_grad_norm"))
    return out


def settings(kind: str, fields: dict[str, Any], path: Path, reward_funcs: int) -> tuple[list[Setting], list[str]]:
    """The entprobe settings a GRPOConfig / TrainingArguments' ``fields`` give (pure), and notes:
    what the file says that entprobe does not model or cannot take. ``reward_funcs``: how many
    ``task.reward_funcs`` the config names (``reward_weights`` needs as many)."""
    if kind != "GRPOConfig":
        return _optimizer(fields, path), []
    task, notes = _task(fields, reward_funcs)
    return (_objective(fields, path) + _sampling(fields, path) + task + _optimizer(fields, path),
            notes + _not_modelled(fields))


def explicit_keys(overrides: Iterable[str]) -> set[str]:
    """The dotted keys a list of Hydra overrides sets (``+``/``++``/``~`` prefixes dropped); a
    group choice ``objective=X`` sets ``objective.preset``."""
    keys = set()
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0].strip()
        keys.add("objective.preset" if key == "objective" else key)
    return keys


def _is_explicit(key: str, explicit: set[str]) -> bool:
    """``key``, a parent below its group (``task.chat_template_kwargs``) or a child of it was set."""
    parts = key.split(".")
    parents = {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
    return bool(parents & explicit) or any(e.startswith(key + ".") for e in explicit)


def choose(found: list[Setting], explicit: set[str], preset: str) -> tuple[list[Setting], list[str]]:
    """The settings to apply (pure): every one whose key (or a parent key below the group) the user
    did not set, none of ``objective.*`` when the user chose another objective than trl; and notes
    for what was kept."""
    kept: list[str] = []
    chosen = []
    other_objective = "objective.preset" in explicit and preset != "trl"
    for s in found:
        if s.key.startswith("objective.") and other_objective:
            continue
        if _is_explicit(s.key, explicit):
            kept.append(f"{s.key} as given (the file has {s.value!r}, {s.source})")
            continue
        chosen.append(s)
    if other_objective:
        kept.append(f"objective={preset} as given: the run's GRPO loss settings are not used")
    return chosen, kept


def checkpoint_settings(cfg, explicit: Iterable[str]) -> tuple[Path, list[Setting], list[str]] | None:
    """(file, settings to apply, lines about what was kept or not modelled) for a config whose
    ``model=hf`` checkpoint holds a training_args.bin and ``model.trainer_args=auto``; None otherwise.
    A config whose keys choose no task is refused (``TaskNotGiven``): the run's task is not in the file."""
    m = cfg.model
    source, mode = str(getattr(m.source, "value", m.source)), str(getattr(m.trainer_args, "value", m.trainer_args))
    if source != "hf" or mode != "auto" or not m.path or m.path == "???":
        return None
    path = Path(str(m.path)).expanduser() / FILE
    if not path.is_file():
        return None
    kind, fields = read_args(path)
    explicit = explicit_keys(explicit)
    if not task_chosen(explicit):
        raise task_not_given(path, kind, _value(fields.get("reward_weights")))
    found, notes = settings(kind, fields, path, len(cfg.task.reward_funcs or []))
    chosen, kept = choose(found, explicit, str(getattr(cfg.objective.preset, "value", cfg.objective.preset)))
    return path, chosen, kept + notes


def with_trainer_args(cfg, explicit: Iterable[str], show: bool = True):
    """``cfg`` (a composed DictConfig) with the checkpoint's training_args.bin settings applied
    (``checkpoint_settings``); one line per key taken, kept or not modelled, printed when ``show``."""
    from omegaconf import OmegaConf

    found = checkpoint_settings(cfg, explicit)
    if found is None:
        return cfg
    path, chosen, lines = found
    cfg = cfg.copy()
    for s in chosen:
        OmegaConf.update(cfg, s.key, s.value, merge=False)
    if show:
        for s in chosen:
            print(f"entprobe: from {path}: {s.key}={_shown(s.value)} ({s.source})", flush=True)
        for line in lines:
            print(f"entprobe: from {path}: {line}", flush=True)
    return cfg


def _shown(v) -> str:
    """A value as on the command line (``[0.9,0.999]``, ``null``)."""
    if v is None:
        return "null"
    if isinstance(v, list):
        return "[" + ",".join(_shown(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_shown(x)}" for k, x in v.items()) + "}"
    return str(v)


def set_in_config_files(runtime) -> list[str]:
    """The dotted keys the chosen experiment preset and ``local`` config file write (they win over
    training_args.bin, as the command line's keys do), and the config groups their defaults list
    chooses (``override /task: jsonl`` -> ``task``, as ``task=jsonl`` on the command line), read
    from the files themselves: the first of Hydra's ``runtime.config_sources`` (file:// and pkg://,
    the user's search path included) that has ``<group>/<choice>.yaml``; [] when neither is chosen."""
    import re
    from importlib import resources

    from omegaconf import OmegaConf

    choices = dict(runtime.choices or {})
    keys: list[str] = []
    for group in ("experiment", "local"):
        if choices.get(group) is None:
            continue
        for src in runtime.config_sources:
            root = {"file": Path, "pkg": resources.files}.get(src.schema)
            f = root(src.path) / group / f"{choices[group]}.yaml" if root else None
            if f is None or not f.is_file():
                continue
            text = f.read_text()
            package = (re.search(r"^#\s*@package\s+(\S+)", text, re.M) or [None, group])[1]
            tree = OmegaConf.to_container(OmegaConf.create(text)) or {}
            keys += _chosen_groups(tree.pop("defaults", None) or [])
            keys += _leaf_keys(tree, "" if package == "_global_" else package + ".")
            break
    return keys


def _chosen_groups(defaults: list) -> list[str]:
    """The config groups a defaults list chooses an option of (``override /task: jsonl``,
    ``/objective: trl``) by their root names; ``_self_`` and plain config names are none."""
    out = []
    for entry in defaults:
        if isinstance(entry, dict):
            for k in entry:
                group = str(k).removeprefix("override ").strip().lstrip("/").split("@", 1)[0]
                if group and group != "_self_":
                    out.append(group.replace("/", "."))
    return out


def _leaf_keys(tree: dict, prefix: str) -> list[str]:
    out = []
    for k, v in tree.items():
        out += _leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out
