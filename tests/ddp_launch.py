"""Start gloo ranks for multi-process tests, safely and with a deadline.

Ranks are forked from a fresh single-threaded forkserver that imported the heavy modules once:
forking the pytest process itself can inherit a lock held by a torch thread pool and hang, and
spawn would import torch and transformers again in every rank (~10 s each).
"""
from __future__ import annotations

import multiprocessing
import socket
import time

import pytest
import torch.multiprocessing as mp

PRELOAD = ["entprobe.main", "transformers.models.llama.modeling_llama", "conftest"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(fn, world: int, *args, timeout_s: float = 300) -> None:
    """Run ``fn(rank, world, port, *args)`` on ``world`` ranks; fail the test after ``timeout_s``."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    procs = mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=False,
                               start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not procs.join(timeout=2):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail(f"{world}-rank run did not finish in {timeout_s:.0f} s")
