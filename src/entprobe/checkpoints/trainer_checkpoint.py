"""Write a training step as an HF Trainer checkpoint folder, ``OUT/checkpoint-<step>/``:

    model.safetensors, config.json, generation_config.json   (model.save_pretrained)
    tokenizer files                                          (tokenizer.save_pretrained)
    optimizer.pt     optimizer.state_dict(): HF Trainer's decay / no-decay groups, in that order
    scheduler.pt     scheduler.state_dict()
    trainer_state.json   transformers' TrainerState (global_step, log_history, ...)
    rng_state.pth    python / numpy / torch CPU (and CUDA) RNG states, as the Trainer saves them
    entprobe_train_args.json   the trainer's options that shape its steps (``--resume`` compares them)

the layout ``entprobe.main model=hf model.path=F optimizer.state_path=F`` (and HF Trainer's
``resume_from_checkpoint``) reads; ``read_trainer_checkpoint`` resumes a run from it. The folder is built aside and renamed into place whole
(``atomic_io.staging_dir``): a reader never sees half a checkpoint.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import torch

from entprobe.runtime.atomic_io import staging_dir
from entprobe.runtime.input_files import InputFileError, check_safetensors, load_json_file, load_torch_file

CHECKPOINT_RE = re.compile(r"^checkpoint-\d+$")
RUN_ARGS_FILE = "entprobe_train_args.json"  # the trainer's options that shape the run's steps
# options a resumed run must share with the checkpoint's (else its steps are another run's)
RUN_KEYS = ("task", "reward", "lr", "lr_scheduler", "warmup_steps", "weight_decay", "max_grad_norm", "B", "G",
            "max_new_tokens", "loss", "seed")
RESUME_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", "trainer_state.json", "optimizer.pt",
                "scheduler.pt")


def checkpoint_step(folder: Path) -> int:
    """N of a ``checkpoint-<N>`` folder."""
    return int(folder.name.rsplit("-", 1)[1])


def existing_checkpoints(out_dir: str | Path) -> list[Path]:
    """The ``checkpoint-<N>`` folders already in ``out_dir``, by N (none when it does not exist)."""
    out = Path(out_dir)
    found = [p for p in out.iterdir() if CHECKPOINT_RE.match(p.name)] if out.is_dir() else []
    return sorted(found, key=checkpoint_step)


def rng_state() -> dict:
    """The RNG states HF Trainer writes to ``rng_state.pth`` (one process)."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def trainer_state(step: int, max_steps: int, save_steps: int, train_batch_size: int, log_history: list[dict]):
    """transformers' ``TrainerState`` of a run at ``step`` that logs every step."""
    from transformers import TrainerState

    return TrainerState(global_step=step, max_steps=max_steps, logging_steps=1, save_steps=save_steps,
                        train_batch_size=train_batch_size, log_history=[dict(e) for e in log_history])


def write_trainer_checkpoint(out_dir: str | Path, step: int, model, tokenizer, optimizer, scheduler,
                             state, run_args: dict | None = None) -> Path:
    """``out_dir/checkpoint-<step>/`` in HF Trainer layout (module docstring); ``state`` is a
    ``TrainerState``; ``run_args`` (the trainer's options) go to ``entprobe_train_args.json``, which
    ``--resume`` compares. Refuses to replace a checkpoint that exists."""
    target = Path(out_dir) / f"checkpoint-{step}"
    if target.exists():
        raise FileExistsError(f"{target} exists: write the run to a new --out folder")
    with staging_dir(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        state.save_to_json(str(tmp / "trainer_state.json"))
        torch.save(rng_state(), tmp / "rng_state.pth")
        if run_args is not None:
            (tmp / RUN_ARGS_FILE).write_text(json.dumps({k: run_args[k] for k in RUN_KEYS if k in run_args}, indent=1))
    return target


def changed_run_args(folder: Path, args: dict) -> tuple[list[tuple[str, object, object]], Path | None]:
    """([(option, the checkpoint's value, ``args``' value)] for every run option that differs, the
    file that recorded them); ([], None) for a checkpoint that records none."""
    f = Path(folder) / RUN_ARGS_FILE
    if not f.is_file():
        return [], None
    saved = load_json_file(f, "the run's trainer options", "copy the checkpoint again")
    if not isinstance(saved, dict):
        raise InputFileError(f"{f}: not the trainer options entprobe.train writes (a JSON object)")
    return [(k, saved[k], args[k]) for k in RUN_KEYS if k in saved and k in args and saved[k] != args[k]], f


def check_resume_files(folder: str | Path) -> None:
    """Every file ``--resume`` reads is there and readable, and the weights have the shapes their
    config.json gives (before the model loads; an error names the file and what to do)."""
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerState

    folder = Path(folder)
    todo = "resume from another checkpoint of the run (or copy this one again)"
    missing = [f for f in RESUME_FILES if not (folder / f).is_file()]
    if missing:
        raise InputFileError(f"{folder}: not a complete checkpoint of entprobe.train (no {', '.join(missing)}); {todo}")
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            load_json_file(folder / name, f"the checkpoint's {name}", todo)
    state = load_json_file(folder / "trainer_state.json", "the Trainer state", todo)
    try:
        TrainerState(**state)
    except TypeError:
        raise InputFileError(f"{folder / 'trainer_state.json'}: not a transformers TrainerState; {todo}") from None
    check_safetensors(folder / "model.safetensors", todo)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise InputFileError(f"{folder / 'config.json'}: not a model config transformers builds "
                             f"({type(exc).__name__}); {todo}") from None
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for key in f.keys():
            got = tuple(f.get_slice(key).get_shape())
            if key in want and got != want[key]:
                raise InputFileError(f"{folder / 'model.safetensors'}: {key} is {got}, config.json makes it "
                                     f"{want[key]}: the weights and config are of different models; {todo}")
    load_torch_file(folder / "optimizer.pt", "the checkpoint's optimizer.pt", todo)
    check_scheduler_state(folder / "scheduler.pt", load_torch_file(folder / "scheduler.pt",
                                                                   "the checkpoint's scheduler.pt", todo), todo)


SCHEDULER_KEYS = ("base_lrs", "last_epoch", "lr_lambdas")  # what an lr scheduler's state_dict() holds


def check_scheduler_state(path: Path, state, todo: str) -> None:
    """``scheduler.pt`` holds an lr scheduler's ``state_dict()`` (``SCHEDULER_KEYS``: the base lrs, the
    epoch, one lambda entry per group); an InputFileError naming the file otherwise."""
    missing = [k for k in SCHEDULER_KEYS if k not in state] if isinstance(state, dict) else list(SCHEDULER_KEYS)
    lrs = state.get("base_lrs") if isinstance(state, dict) else None
    if missing or not isinstance(lrs, list) or not isinstance(state["last_epoch"], int) or \
            not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lrs):
        what = f"no {', '.join(missing)}" if missing else "base_lrs / last_epoch of the wrong type"
        raise InputFileError(f"{path}: not an lr scheduler's state_dict() ({what}); {todo}")


def read_trainer_checkpoint(folder: str | Path, optimizer, scheduler, train_batch_size: int) -> tuple[int, list[dict]]:
    """Load ``optimizer.pt`` and ``scheduler.pt`` of a checkpoint this layout wrote into ``optimizer``
    and ``scheduler`` (built as the run built them), and return its ``global_step`` and
    ``log_history`` (``trainer_state.json``). Refuses a checkpoint of a different batch size. The
    tensors are read with ``weights_only=True``; ``rng_state.pth`` is not needed (each step's
    sampling is seeded by its step number)."""
    from transformers import TrainerState

    folder = Path(folder)
    missing = [f for f in ("trainer_state.json", "optimizer.pt", "scheduler.pt") if not (folder / f).is_file()]
    if missing:
        raise InputFileError(f"{folder}: not a checkpoint of this trainer (no {', '.join(missing)})")
    state = TrainerState(**load_json_file(folder / "trainer_state.json", "the Trainer state", "resume from "
                                          "another checkpoint"))
    if state.train_batch_size != train_batch_size:
        raise InputFileError(f"{folder}: written with {state.train_batch_size} responses a step, this run takes "
                         f"{train_batch_size} (--B x --G): resume with the run's own --B and --G")
    step = checkpoint_step(folder) if CHECKPOINT_RE.match(folder.name) else None
    if step is not None and int(state.global_step) != step:
        raise InputFileError(f"{folder / 'trainer_state.json'}: global_step {state.global_step} in the folder of step "
                         f"{step}: the files are not one checkpoint; resume from a checkpoint written whole")
    opt_state = load_torch_file(folder / "optimizer.pt", "the AdamW state", "resume from another checkpoint")
    _check_optimizer_shapes(folder / "optimizer.pt", opt_state, optimizer)
    bad = [k for st in opt_state.get("state", {}).values() for k, v in st.items()
           if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise InputFileError(f"{folder / 'optimizer.pt'}: NaN/Inf in the AdamW state ({sorted(set(bad))}): a step from "
                         "it would make every weight NaN; resume from an earlier checkpoint")
    run_lrs = list(getattr(scheduler, "base_lrs", []))
    todo = "resume from another checkpoint"
    sched_state = load_torch_file(folder / "scheduler.pt", "the lr scheduler state", todo)
    check_scheduler_state(folder / "scheduler.pt", sched_state, todo)
    optimizer.load_state_dict(opt_state)
    try:
        scheduler.load_state_dict(sched_state)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # another scheduler's state
        raise InputFileError(f"{folder / 'scheduler.pt'}: not a state of this run's lr scheduler "
                             f"({type(exc).__name__}: {exc}); {todo}") from None
    saved_lrs = list(getattr(scheduler, "base_lrs", []))
    if run_lrs and saved_lrs and any(abs(a - b) > 1e-12 * max(abs(a), abs(b)) for a, b in zip(run_lrs, saved_lrs)):
        raise InputFileError(f"{folder / 'scheduler.pt'}: the run was trained at lr {saved_lrs[0]:g}, this command says "
                         f"--lr {run_lrs[0]:g}: give the run's own --lr {saved_lrs[0]:g} to resume it (a new lr "
                         "is a new run: train into a new --out from --model)")
    return int(state.global_step), [dict(e) for e in state.log_history]


def _check_optimizer_shapes(path: Path, saved: dict, optimizer) -> None:
    """optimizer.pt has the run's param groups, each state the shape of its parameter."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
        raise InputFileError(f"{path}: not an optimizer state_dict ('state' / 'param_groups'); resume from "
                             "another checkpoint")
    sizes = [len(g.get("params", [])) for g in groups]
    want = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != want:
        raise InputFileError(f"{path}: param groups of {sizes} parameters, this run's AdamW has {want}: the state is "
                         "of another model; resume from a checkpoint of this run")
    for g, live in zip(groups, optimizer.param_groups):
        for idx, p in zip(g["params"], live["params"]):
            st = saved["state"].get(idx, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st and tuple(st[k].shape) != tuple(p.shape):
                    raise InputFileError(f"{path}: {k} of parameter {idx} is {tuple(st[k].shape)}, the parameter "
                                     f"{tuple(p.shape)}: the state is of another model; resume from a checkpoint "
                                     "of this run")
