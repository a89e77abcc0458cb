"""Errors meant for the person at the command line: each of entprobe's own error classes whose
message names the config key or file and what to change. The commands print such an error as one
line, ``entprobe: error: <message>``, and exit 2 (the usage-error convention); the traceback only
with ``HYDRA_FULL_ERROR=1``. Any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Iterator

from hydra.errors import CompactHydraException

from entprobe.checkpoints.errors import OptimizerStateError
from entprobe.checkpoints.peft import AdapterError
from entprobe.config import ConfigError
from entprobe.reporting.planning import PlanError
from entprobe.runtime.input_files import InputFileError
from entprobe.runtime.atomic_io import OutputFileError
from entprobe.runtime.locks import LockTimeout
from entprobe.rollouts.saved_batches import BatchSaveError
from entprobe.tasks.base import RewardFunctionError
from entprobe.tasks.jsonl import TaskFileError

# each raised with a message that says what to change; add a new user-facing error class here
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, InputFileError, OptimizerStateError, AdapterError,
                                                 PlanError, LockTimeout, RewardFunctionError, OutputFileError,
                                                 BatchSaveError, TaskFileError)
EXIT_USAGE = 2  # argparse's and most Unix tools' exit status for a usage error
FULL_ERROR_ENV = "HYDRA_FULL_ERROR"


def is_user_error(exc: BaseException) -> bool:
    """True for an error whose message is meant for the user (``USER_ERRORS``)."""
    return isinstance(exc, USER_ERRORS)


def full_error() -> bool:
    """True when ``HYDRA_FULL_ERROR=1`` asks for tracebacks of user errors too."""
    return os.environ.get(FULL_ERROR_ENV, "") not in ("", "0")


def one_line(exc: BaseException) -> str:
    """``entprobe: error: <message>`` with the message's lines joined (one line on the console)."""
    msg = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return f"entprobe: error: {msg or type(exc).__name__}"


@contextlib.contextmanager
def exits_on_user_error() -> Iterator[None]:
    """For the argparse commands (``entprobe.plan``, ``entprobe.train``): a user error inside the
    block is printed as one line on stderr and exits 2 (re-raised with ``HYDRA_FULL_ERROR=1``)."""
    try:
        yield
    except USER_ERRORS as exc:
        if full_error():
            raise
        print(one_line(exc), file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser for entprobe's commands: a usage error (an unknown option, a value of the
    wrong type, a missing argument) is one line, ``entprobe: error: <what> (<prog> --help)``, exit 2,
    instead of argparse's usage block."""

    def error(self, message: str):
        print(f"entprobe: error: {message} ({self.prog} --help shows the usage)", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE)


class OneLineError(CompactHydraException):
    """A user error as Hydra's compact exception: Hydra prints its message alone (no traceback)
    and, in a multirun, still runs the other jobs before raising the first failure."""


_failed: dict[str, int] = {"user": 0, "other": 0}  # how the Hydra jobs of this process failed


@contextlib.contextmanager
def hydra_one_line(multirun: bool) -> Iterator[None]:
    """Around a Hydra job: a user error is printed as one line (``entprobe: error: <message>``) on
    stderr and exits 2; in a multirun it becomes ``OneLineError`` instead, so that the other jobs
    still run and Hydra reports the first failure (its overrides and this line), remembered so that
    ``hydra_exit_status`` turns Hydra's exit 1 into 2. Untouched with ``HYDRA_FULL_ERROR=1`` (Hydra
    then prints the full traceback)."""
    try:
        yield
    except USER_ERRORS as exc:
        if full_error():
            raise
        if not multirun:
            print(one_line(exc), file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USAGE) from None
        _failed["user"] += 1
        raise OneLineError(one_line(exc)) from exc
    except Exception:
        _failed["other"] += 1
        raise


HYDRA_JOB_FAILED = "Error executing job with overrides: "
HYDRA_HINT = "\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"


class _OneLineStderr:
    """stderr while Hydra reports a failed multirun job: its ``Error executing job with overrides:
    [...]`` line and the ``entprobe: error: ...`` line after it become one line naming the job
    (``entprobe: error: job a=1 b=2: ...``), and the HYDRA_FULL_ERROR hint is dropped when every
    failure was a user error. Every other write goes through unchanged, as it comes."""

    def __init__(self, stream):
        self.stream, self.pending = stream, None

    def write(self, s: str) -> int:
        if s.startswith(HYDRA_JOB_FAILED):
            self.pending = s[len(HYDRA_JOB_FAILED):].strip()
            return len(s)
        if self.pending is not None:
            job, self.pending = self.pending, None
            if s.startswith("entprobe: error: "):
                overrides = " ".join(o.strip().strip("'\"") for o in job.strip("[]").split(",") if o.strip())
                return self.stream.write(f"entprobe: error: job {overrides or '(no overrides)'}: "
                                         f"{s[len('entprobe: error: '):]}")
            self.stream.write(HYDRA_JOB_FAILED + job + os.linesep)
        if s == HYDRA_HINT and _failed["user"] and not _failed["other"]:
            return len(s)
        return self.stream.write(s)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def multirun_failures_one_line() -> Iterator[None]:
    """Around Hydra's entry: a multirun job that fails with a user error is reported as one line
    (``_OneLineStderr``); untouched with ``HYDRA_FULL_ERROR=1``."""
    if full_error():
        yield
        return
    real = sys.stderr
    sys.stderr = _OneLineStderr(real)
    try:
        yield
    finally:
        sys.stderr = real


def hydra_exit_status(code) -> object:
    """The exit status for Hydra's ``SystemExit(code)``: 2 instead of Hydra's 1 when the failures of
    a multirun were user errors (``hydra_one_line``), ``code`` otherwise."""
    return EXIT_USAGE if code == 1 and _failed["user"] and not _failed["other"] else code
