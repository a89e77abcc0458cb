"""Write a training step as an HF Trainer checkpoint folder, ``OUT/checkpoint-<step>/``:

    model.safetensors, config.json, generation_config.json   (model.save_pretrained)
    tokenizer files                                          (tokenizer.save_pretrained)
    optimizer.pt     optimizer.state_dict(): HF Trainer's decay / no-decay groups, in that order
    scheduler.pt     scheduler.state_dict()
    trainer_state.json   transformers' TrainerState (global_step, log_history, ...)
    rng_state.pth    python / numpy / torch CPU (and CUDA) RNG states, as the Trainer saves them

the layout ``entprobe.main model=hf model.path=F optimizer.state_path=F`` (and HF Trainer's
``resume_from_checkpoint``) reads; ``read_trainer_checkpoint`` resumes a run from it. The folder is built aside and renamed into place whole
(``atomic_io.staging_dir``): a reader never sees half a checkpoint.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import torch

from entprobe.runtime.atomic_io import staging_dir

CHECKPOINT_RE = re.compile(r"^checkpoint-\d+$")


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
                             state) -> Path:
    """``out_dir/checkpoint-<step>/`` in HF Trainer layout (module docstring); ``state`` is a
    ``TrainerState``. Refuses to replace a checkpoint that exists."""
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
    return target


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
        raise FileNotFoundError(f"{folder}: not a checkpoint of this trainer (no {', '.join(missing)})")
    state = TrainerState.load_from_json(str(folder / "trainer_state.json"))
    if state.train_batch_size != train_batch_size:
        raise ValueError(f"{folder}: written with {state.train_batch_size} responses a step, this run takes "
                         f"{train_batch_size} (--B x --G): resume with the run's own --B and --G")
    step = checkpoint_step(folder) if CHECKPOINT_RE.match(folder.name) else None
    if step is not None and int(state.global_step) != step:
        raise ValueError(f"{folder / 'trainer_state.json'}: global_step {state.global_step} in the folder of step "
                         f"{step}: the files are not one checkpoint; resume from a checkpoint written whole")
    opt_state = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
    bad = [k for st in opt_state.get("state", {}).values() for k, v in st.items()
           if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ValueError(f"{folder / 'optimizer.pt'}: NaN/Inf in the AdamW state ({sorted(set(bad))}): a step from "
                         "it would make every weight NaN; resume from an earlier checkpoint")
    run_lrs = list(getattr(scheduler, "base_lrs", []))
    optimizer.load_state_dict(opt_state)
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    saved_lrs = list(getattr(scheduler, "base_lrs", []))
    if run_lrs and saved_lrs and any(abs(a - b) > 1e-12 * max(abs(a), abs(b)) for a, b in zip(run_lrs, saved_lrs)):
        raise ValueError(f"{folder / 'scheduler.pt'}: the run was trained at lr {saved_lrs[0]:g}, this command says "
                         f"--lr {run_lrs[0]:g}: give the run's own --lr {saved_lrs[0]:g} to resume it (a new lr "
                         "is a new run: train into a new --out from --model)")
    return int(state.global_step), [dict(e) for e in state.log_history]
