"""Which run dir a single run made: ``NewRunDir`` (a Hydra callback, ``hydra.callbacks.new_run_dir``
in conf/config.yaml) notes, just before Hydra creates the run dir (``outputs/<date>/<time>/``),
the topmost folder that creation makes (the run dir itself, or ``outputs/<date>/`` on a new day,
...), or nothing when the run dir exists already (``hydra.run.dir`` of an earlier run, a folder
of the user's). The job (``probe_job.hydra_job``) removes that folder when its checks refuse the
run before any work (``runtime.rundir.Refusal``), so a refused run leaves no run dir behind and
never removes one it did not make.
"""
from __future__ import annotations

from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

_MADE: dict[str, Path] = {}  # run dir (absolute) -> the topmost folder Hydra creates for it


def first_missing(folder: Path) -> Path | None:
    """The topmost of ``folder`` and its ancestors that does not exist (what ``mkdir(parents=True)``
    creates first); None when ``folder`` exists."""
    folder = folder.absolute()
    if folder.exists():
        return None
    top = folder
    for p in folder.parents:
        if p.exists():
            break
        top = p
    return top


class NewRunDir(Callback):
    """Hydra callback: notes the folder a single run's run dir creation makes (module docstring)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        run_dir = Path(str(config.hydra.run.dir)).absolute()  # as Hydra's run_job makes it, from this cwd
        made = first_missing(run_dir)
        if made is None:
            _MADE.pop(str(run_dir), None)
        else:
            _MADE[str(run_dir)] = made


def made_for(run_dir: str | Path) -> Path | None:
    """The topmost folder this process's Hydra run created for ``run_dir`` (None: it existed, or it is
    no single run's run dir)."""
    return _MADE.get(str(Path(run_dir).absolute()))
