"""The Python API: probe a model and optimizer that are already in memory.

    import entprobe
    results = entprobe.probe(model, optimizer, tokenizer, task)                 # samples E and U
    results = entprobe.probe(model, optimizer, tokenizer, "arithmetic")         # a built-in task by name
    results = entprobe.probe(model, optimizer, tokenizer, "jsonl", task={"path": "prompts.jsonl"})
    results = entprobe.probe(model, optimizer, tokenizer, (E, U), batch={"B_E": 8})  # (see below)
    results = entprobe.probe(model, optimizer, tokenizer, task, objective="trl",
                             **{"objective.loss_type": "dr_grpo", "probe.mode": "single_batch"})

The same stages, restore and results as the command line (pipeline/in_memory.py after cli/probe_job.py's loading).
Overrides are the command line's config keys, composed onto the same YAML defaults and typed
schema (same validation, same errors): dotted keys (``**{"batch.B_E": 8}``), nested dicts
(``batch={"B_E": 8}``), and a string for a config group picks its option (``objective="trl"``).
Keys that describe what is loaded from disk (``model.*``, ``optimizer.state_path``, ``batch.load``,
...) are refused: the model, optimizer and task or batches are the ones passed. A task named by a
string is the command line's ``task=<name>`` (its options: ``task_names()``), built from the same
``task.*`` keys, which then apply (``task={"path": ...}``). ``run_dir=DIR``
writes the command line's outputs there (results.json, report.md, per_unit.json, ...); without
it they go to a temporary folder that is removed.

No checkpoint folder is read, so nothing of a trainer's own settings is taken: the command line
reads a TRL checkpoint's ``training_args.bin`` (the loss, the sampling, ``max_grad_norm``); here
they are yours to pass. HF Trainer and TRL clip the gradient at ``max_grad_norm`` (1.0 by default)
before every step; without ``importance={"max_grad_norm": 1.0}`` the probe predicts and takes the
unclipped step, another step wherever the clipping binds (``pred/grad_clip_factor`` in the results
says how much of the gradient a clipped step keeps)::

    results = entprobe.probe(model, optimizer, tokenizer, task, objective="trl",
                             **{"objective.loss_type": "grpo", "importance.max_grad_norm": 1.0})

What is left as it was, bit for bit: the parameters, the optimizer's state and param groups, the
parameters' ``.grad``, torch's RNG (CPU and the model's CUDA device) and each module's train/eval
mode. The probe runs with the model in eval mode (dropout off: gradients of the deterministic
policy, as the command line's dropout-free model). One process: under ``torch.distributed`` use
the command line (launchers/torchrun.sh), whose ranks share the work.
"""
from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from entprobe.runtime import distributed as D
from entprobe.pipeline.run_batches import sample_global
from entprobe.config import ConfigError, EntprobeConfig, register_configs
from entprobe.pipeline.config_checks import to_typed
from entprobe.pipeline.config_errors import composition_error, schema_error
from entprobe.pipeline.in_memory import InMemory, finish, probe_batches, probe_context
from entprobe.pipeline.geometry import live_geometry, live_lr, unwrap_optimizer
from entprobe.rollouts.logprobs import autocast_dtype
from entprobe.checkpoints.models import LoadedModel
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.runtime.rundir import marks_failure, set_aside_earlier_run
from entprobe.tasks import Task
from entprobe.tasks.base import check_encodable
from entprobe.tasks.build import build_task, describe_task_object
from entprobe.tasks.lengths import check_prompt_lengths

GROUPS = ("batch", "sampling", "objective", "probe", "importance", "optimizer", "ddp", "model", "task",
          "logging", "experiment")
_YOURS = "the API probes the model, optimizer and task or batches you pass"
# keys (or prefixes) that describe what the command line loads; the API refuses them, with why
REFUSED = {
    "model": f"{_YOURS}: model.* loads a model (only model.autocast and model.autocast_bf16 apply)",
    "optimizer.state_path": f"{_YOURS}: the geometry is the optimizer's own state, lr and param groups",
    "optimizer.betas": "the geometry is the optimizer's own: its betas are in its param groups",
    "optimizer.eps": "the geometry is the optimizer's own: its eps is in its param groups",
    "optimizer.weight_decay": "the geometry is the optimizer's own: its weight decay is in its param groups",
    "optimizer.step": "the geometry is the optimizer's own: its step count is in its state",
    "batch.load": "pass the batches as task_or_batches ((E, U); RolloutBatch.load reads a saved one)",
    "batch.save": "the API does not write batches: sample them with entprobe.rollouts.sampling.sample_batch and "
                  "RolloutBatch.save them, then pass them as task_or_batches",
    "batch.lock_timeout_s": "the API reads and writes no batch folder",
    "ddp": "the API runs in this process (use the command line, launchers/torchrun.sh, for several)",
    "task": f"{_YOURS}: task.* builds a task (only task.tokenize, task.chat_template, task.chat_template_kwargs "
            "and task.system_prompt apply)",
    "experiment": f"{_YOURS}: an experiment preset chooses a model",
    "logging.logger": "the API returns the results: log them with your own logger",
    "logging.wandb": "the API returns the results: log them with your own logger",
}
ALLOWED = ("model.autocast", "model.autocast_bf16", "task.chat_template", "task.system_prompt", "task.tokenize",
           "task.chat_template_kwargs")
API_LR_FIX = 'pass the lr of the step to probe, e.g. entprobe.probe(..., optimizer={"lr": 1e-6})'
SAMPLING_KEYS = ("batch.B_E", "batch.B_U", "batch.G", "batch.seed_E", "batch.seed_U", "batch.advantage",
                 "batch.adv_eps")  # describe sampling: refused when the batches are given


def flatten_overrides(overrides: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """(group choices as ``group=option``, ``{dotted key: value}``) from ``probe``'s keyword
    arguments: a string for a config group chooses its option, a dict nests keys."""
    choices, values = [], {}

    def walk(key: str, v):
        if isinstance(v, Mapping):
            for k, x in v.items():
                walk(f"{key}.{k}", x)
        else:
            values[key] = v

    for key, v in overrides.items():
        key = "probe" + key[len("probe_rework"):] if key.split(".")[0] == "probe_rework" else key
        if key in GROUPS and isinstance(v, str):
            choices.append(f"{key}={v}")
        else:
            walk(key, v)
    return choices, values


def _refusal(key: str) -> str | None:
    if key in ALLOWED:
        return None
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        why = REFUSED.get(".".join(parts[:i]))
        if why:
            return why
    return None


def compose_config(choices: list[str], return_hydra_config: bool = False):
    """The command line's root config (the package's conf/, its defaults and typed schema) with
    ``choices`` (and Hydra's own node, ``return_hydra_config``); Hydra's global state is set aside
    and put back, so a Hydra app may call it. A choice Hydra cannot compose is a one-line ConfigError
    naming it and what to write (``config_errors.composition_error``: the nearest key, the group's
    options, the type wanted)."""
    return compose_configs([choices], return_hydra_config)[0]


def compose_configs(jobs: list[list[str]], return_hydra_config: bool = False) -> list:
    """``compose_config`` of each list of choices in ``jobs`` (the jobs of a sweep), Hydra initialised
    once for all of them."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobRuntime

    register_configs()
    saved = dict(Singleton._instances)
    for cls in (GlobalHydra, JobRuntime):
        Singleton._instances.pop(cls, None)
    choices: list[str] = []
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(resources.files("entprobe") / "conf")):
            out = []
            for choices in jobs:
                out.append(compose(config_name="config", overrides=choices, return_hydra_config=return_hydra_config))
            return out
    except Exception as exc:  # hydra's missing option / unknown key / wrong type / parse errors: one line
        raise composition_error(exc, choices) from exc
    finally:
        Singleton._instances.clear()
        Singleton._instances.update(saved)


def task_names() -> list[str]:
    """The built-in tasks a string may name: the options of the config group ``task`` (conf/task/)."""
    return sorted(f.name[:-5] for f in (resources.files("entprobe") / "conf" / "task").iterdir()
                  if f.name.endswith(".yaml"))


def api_config(overrides: Mapping[str, Any], batches_given: bool,
               task_name: str | None = None) -> tuple[EntprobeConfig, bool]:
    """The typed, validated config of ``probe``'s keyword arguments and whether ``run_dir`` was given;
    ``task_name``: a built-in task chosen by name (``task=<name>``; the ``task.*`` keys then apply)."""

    choices, values = flatten_overrides(overrides)
    if task_name is not None:
        if task_name not in task_names():
            raise ConfigError(f"task {task_name!r}: not a built-in task; name one of {', '.join(task_names())} "
                              "or pass a Task (prompts and a reward)")
        if any(c.split("=")[0] == "task" for c in choices):
            raise ConfigError(f"task: the task is {task_name!r} (the positional argument); drop task=... from the "
                              "keywords, or pass the name there only")
        choices = [*choices, f"task={task_name}"]
    for key in [c.split("=")[0] for c in choices] + list(values):
        if task_name is not None and (key == "task" or key.startswith("task.")):
            continue
        why = _refusal(key)
        if why:
            raise ConfigError(f"{key}: {why}")
        if batches_given and key in SAMPLING_KEYS:
            raise ConfigError(f"{key}: describes how batches are sampled; the batches you pass are sampled "
                              "already (pass a Task to have the API sample them)")
    cfg = compose_config(choices)
    for key, v in values.items():
        try:
            OmegaConf.update(cfg, key, v, merge=True)
        except OmegaConfBaseException as exc:  # an unknown key (with the nearest), a wrong type (with the type wanted)
            raise schema_error(exc, [f"{key}={v!r}"]) from None
    return to_typed(cfg), "run_dir" in values


@contextlib.contextmanager
def left_as_it_was(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float | None):
    """Run the block with the model in eval mode, no ``.grad`` on its parameters and (``lr`` set)
    every param group at ``lr``; afterwards the ``.grad`` tensors, the modules' modes, the groups'
    lr, the flag an lr scheduler sets on ``optimizer.step`` and torch's RNG are what they were.
    (The parameters and the optimizer's state are restored bit-exactly by the ground-truth stage.)
    Yields a function that puts the caller's modes back inside the block (to sample as it does)."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    modes = [(m, m.training) for m in model.modules()]
    lrs = [g["lr"] for g in optimizer.param_groups]
    missing = object()
    called = optimizer.__dict__.get("_opt_called", missing)
    cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})

    def callers_modes() -> None:
        for m, training in modes:
            m.training = training

    try:
        with torch.random.fork_rng(devices=cuda):
            for p in params:
                p.grad = None
            model.eval()
            if lr is not None:
                for g in optimizer.param_groups:
                    g["lr"] = lr
            yield callers_modes
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        callers_modes()
        for g, v in zip(optimizer.param_groups, lrs):
            g["lr"] = v
        if called is missing:
            optimizer.__dict__.pop("_opt_called", None)
        else:
            optimizer._opt_called = called


def _is_batches(x) -> bool:
    """True for a RolloutBatch or an (E, U) pair of them, False for a Task; anything else: TypeError."""
    if isinstance(x, RolloutBatch) or (isinstance(x, (tuple, list)) and len(x) == 2
                                       and all(isinstance(b, RolloutBatch) for b in x)):
        return True
    if isinstance(x, (Task, str)):
        return False
    raise TypeError(f"task_or_batches is a {type(x).__name__}: pass a Task (prompts and a reward), the name of a "
                    f"built-in task ({', '.join(task_names())}), an (E, U) "
                    "pair of RolloutBatch, or one RolloutBatch (probe.mode=single_batch without importance)")


def _given_batches(x, cfg: EntprobeConfig) -> tuple[RolloutBatch, RolloutBatch]:
    """(E, U) from the caller's batches, checked against the config."""
    if isinstance(x, RolloutBatch):
        if cfg.probe.mode.value == "two_batch" or cfg.importance.enabled:
            raise ConfigError("one RolloutBatch is U alone: pass (E, U), or set probe.mode=single_batch and "
                              "importance.enabled=false")
        E = U = x
    else:
        E, U = x
    for label, b in (("E", E), ("U", U)):
        if b.temperature != cfg.sampling.temperature:
            raise ConfigError(f"sampling.temperature: is {cfg.sampling.temperature}, but {label} was sampled at "
                              f"temperature {b.temperature}; set sampling.temperature={b.temperature}")
    return E, U


def probe(model: torch.nn.Module, optimizer, tokenizer, task_or_batches, /, **overrides) -> dict:
    """Predict and measure the entropy change of ``optimizer``'s next step on ``model`` (the module
    docstring has the arguments; a trainer's settings, gradient clipping included, are overrides:
    ``importance={"max_grad_norm": ...}``, none is read from a checkpoint). Returns the flat results
    dict the command line writes to results.json. Raises ``ConfigError`` (a key and what to change) on bad overrides, and the
    command line's ``OptimizerStateError`` when the param groups are at lr 0 (a schedule's end) and
    no ``optimizer={"lr": ...}`` says which step to probe."""
    batches = _is_batches(task_or_batches)
    task_name = task_or_batches if isinstance(task_or_batches, str) else None
    cfg, has_run_dir = api_config(overrides, batches, task_name)
    if task_name is not None:
        try:
            task_or_batches = build_task(OmegaConf.structured(cfg.task))
        except ValueError as exc:  # a task.* key that builds no task (task.path missing, no prompts): its message
            raise ConfigError(str(exc)) from None
    given = _given_batches(task_or_batches, cfg) if batches else None
    if D.world() > 1:
        raise RuntimeError("entprobe.probe runs in one process; under torch.distributed use the command line "
                           "(launchers/torchrun.sh), whose ranks share the work")
    opt = unwrap_optimizer(optimizer)
    live_lr(cfg, opt, fix=API_LR_FIX)  # before any pass: a step at lr 0 would probe nothing
    run_dir = Path(cfg.run_dir) if has_run_dir else None
    with contextlib.ExitStack() as stack:
        if run_dir is None:
            out_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="entprobe-")))
        else:
            out_dir = run_dir
            out_dir.mkdir(parents=True, exist_ok=True)
            set_aside_earlier_run(out_dir, str(cfg.logging.results_file))
            stack.enter_context(marks_failure(out_dir))
        stack.enter_context(left_as_it_was(model, opt, cfg.optimizer.lr))
        t0 = time.perf_counter()
        torch.manual_seed(cfg.seed)
        held = in_memory(cfg, model, opt, tokenizer, None if given else task_or_batches)
        if given is not None:  # what the results name as the task and reward (a name's: cfg.task's)
            held.task_meta = {"task": "batches passed in", "task_reward": "the batches' own (their advantages)"}
        elif task_name is None:
            held.task_meta = describe_task_object(task_or_batches)
        if given is None:
            E_all, U_all = sample_global(cfg, held.lm, held.task, held.ctx)
        else:
            E_all, U_all = given
        results = probe_batches(cfg, held, E_all, U_all, "sampled" if given is None else "given", out_dir)
        results["time/total_s"] = time.perf_counter() - t0
        finish(cfg, results, run_dir)
    return results


def in_memory(cfg: EntprobeConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokenizer,
              task: Task | None) -> InMemory:
    """The probe's view of the caller's objects: the model and tokenizer as a ``LoadedModel`` (on the
    parameters' device; autocast as ``model.autocast`` says: ``autocast_dtype``), the task checked against
    the tokenizer, the context and the optimizer's geometry (``geometry.live_geometry``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters (requires_grad=True): nothing to probe")
    device = params[0].device
    autocast = autocast_dtype(cfg.model, device)
    lm = LoadedModel(model, tokenizer, device, autocast, f"memory:{type(model).__name__}", None)
    if task is not None:
        where = f"the task ({type(task).__name__})"
        check_encodable(task, tokenizer, where)
        config = getattr(model, "config", None)  # its context: max_position_embeddings (with RoPE scaling)
        check_prompt_lengths(task, tokenizer, cfg, where, lm.source,
                             config=config.to_dict() if hasattr(config, "to_dict") else None)
    ctx = probe_context(cfg, model, device, autocast)
    geo, meta = live_geometry(cfg, optimizer, ctx.names, ctx.params, ctx.buffers_device, model)
    return InMemory(lm, task, ctx, geo, meta)
