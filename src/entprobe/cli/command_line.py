"""``python -m entprobe.main``'s command line checked before Hydra starts (``check_command_line``):
the config each job would run is composed from the package's conf/ (``pipeline.api.compose_config``)
and typed and range-checked as the job does it (``config_checks.to_typed``, with the checkpoint's
training_args.bin when it has one). A mistake is a ``ConfigError`` naming the override and what to
write (an unknown key with the nearest one, an unknown group option with the group's options, a
value of the wrong type with the type wanted, ``+key`` on the typed schema, a range): the entry
prints it as one line and exits 2 before Hydra writes anything, so a refused run leaves no run or
sweep folder, and before wandb starts.

A multirun is checked job by job, as Hydra's basic sweeper splits it (the values of each swept
key, every combination; each job's error names its overrides), with the same typed and range
checks as a single run: a value out of range in any job (``batch.G=4,1``, ``optimizer.lr=-1``
among the lrs of a sweep) refuses the whole sweep before job 0 runs, so no job folder is left
behind (a job that fails while it runs still fails alone, recorded in the sweep's summary). A
``--flag`` that is not Hydra's (``--lr 1e-5``) is refused with the override it means
(``unknown_flag``). Left to Hydra and the job itself:
``--help``, ``--info`` and the other commands that run no job (``--cfg`` is composed only), another config
(``--config-name``, ``--config-dir``, ``--config-path``), another sweeper (``hydra/sweeper=...``),
and any failure of the check that is not a user error (the job then reports what it finds).
"""
from __future__ import annotations

import argparse
import contextlib
import io

from omegaconf import open_dict

from entprobe.checkpoints.trainer_args import set_in_config_files
from entprobe.cli.user_errors import USER_ERRORS
from entprobe.config import ConfigError
from entprobe.pipeline.api import compose_config, compose_configs
from entprobe.pipeline.config_checks import to_typed
from entprobe.pipeline.config_errors import composition_error

# Hydra's options that run no job or compose another config: the command line is left to Hydra
_NOT_CHECKED = ("help", "hydra_help", "info", "shell_completion", "config_path", "config_name", "config_dir",
                "experimental_rerun")


def hydra_args(argv: list[str]) -> argparse.Namespace | None:
    """Hydra's own reading of the command line (its argument parser); None when Hydra would refuse
    it (Hydra then says why)."""
    from hydra._internal.utils import get_args_parser

    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        try:
            return get_args_parser().parse_args(argv)
        except SystemExit:
            return None


def check_job(cfg, job: str | None = None) -> None:
    """Type and range-check one job's composed config ``cfg`` (with Hydra's node) as the job does
    (``probe_job.hydra_job``'s ``to_typed``, the notes it prints left to the job; a multirun's
    ``job``: its overrides). A ConfigError (or another user error, e.g. a damaged
    training_args.bin) is raised, named by ``job`` in a multirun."""
    given = list(cfg.hydra.overrides.task) + set_in_config_files(cfg.hydra.runtime)
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            to_typed(cfg, explicit=given)
    except USER_ERRORS as exc:
        if job is None:
            raise
        raise ConfigError(f"job {job}: {' '.join(str(exc).split())}") from exc
    except Exception:  # noqa: BLE001 -- not a user error: the job itself meets it and reports it
        return


def sweep_jobs(overrides: list[str]) -> list[list[str]] | None:
    """The jobs of a multirun of ``overrides`` as Hydra's basic sweeper makes them (every combination
    of the swept values); None for a sweep it does not make (another sweeper, a range it refuses)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if any(o.lstrip("+~").startswith(("hydra/sweeper", "hydra.sweeper")) for o in overrides):
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:  # a syntax error: named as the command line's
        raise composition_error(exc, overrides) from exc
    try:
        return [list(job) for job in BasicSweeper.split_arguments(parsed, None)[0]]
    except HydraException:
        return None


# ``--name`` flags people type for a key (argparse habits): the override each one means
FLAG_KEYS = {"lr": "optimizer.lr", "learning_rate": "optimizer.lr", "B_E": "batch.B_E", "B_U": "batch.B_U",
             "G": "batch.G", "seed": "seed"}


def unknown_flag(argv: list[str]) -> str | None:
    """The message for the first ``--name`` (or ``--name=value``) in ``argv`` that is not one of
    Hydra's own options (``--help``, ``--cfg``, ``--multirun``, ``--config-name``, ...: its argument
    parser's), None when there is none. Hydra takes settings as ``key=value`` overrides only; a
    flag named in ``FLAG_KEYS`` is told its override (``--lr 1e-5``: ``set optimizer.lr=1e-5``)."""
    from hydra._internal.utils import get_args_parser

    hydra_flags = set(get_args_parser()._option_string_actions)
    for n, arg in enumerate(argv):
        if arg == "--":
            return None
        if not arg.startswith("--") or arg.split("=", 1)[0] in hydra_flags:
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq and n + 1 < len(argv) and not argv[n + 1].startswith("-") and "=" not in argv[n + 1]:
            value = argv[n + 1]
        key = FLAG_KEYS.get(name) or FLAG_KEYS.get(name.replace("-", "_"))
        if key:
            return f"--{name} is not an option: set {key}={value or '<value>'}"
        return (f"--{name} is not an option: settings are key=value overrides (e.g. optimizer.lr=1e-5); "
                "python -m entprobe.main --help lists every key")
    return None


def check_command_line(argv: list[str]) -> None:
    """Check the config of every job ``argv`` (``python -m entprobe.main``'s arguments) runs, before
    Hydra starts (module docstring); a mistake raises its user error. A ``--flag`` that is not
    Hydra's is refused first (``unknown_flag``), instead of Hydra's usage block."""
    flag = unknown_flag(argv)
    if flag:
        raise ConfigError(flag)
    args = hydra_args(argv)
    if args is None or any(getattr(args, name, None) for name in _NOT_CHECKED):
        return
    overrides = list(args.overrides)
    if args.cfg:  # --cfg job|hydra|all prints the composed config: its overrides must compose
        compose_config(overrides, return_hydra_config=True)
        return
    if not (args.multirun or "hydra.mode=MULTIRUN" in overrides):
        check_job(compose_config(overrides, return_hydra_config=True))  # Hydra's errors: one line each
        return
    jobs = sweep_jobs(overrides) or []
    for job, cfg in zip(jobs, compose_configs(jobs, return_hydra_config=True)):
        check_job(cfg, " ".join(job))
