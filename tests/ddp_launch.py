"""Start gloo ranks for multi-process tests, safely and with a deadline.

Ranks are forked from a fresh single-threaded forkserver that imported the heavy modules once:
forking the pytest process itself can inherit a lock held by a torch thread pool and hang, and
spawn would import torch and transformers again in every rank (~10 s each). ``launch_fresh``
starts plain interpreters instead, for workers that must not share anything with the pytest
process (a forkserver-launched single-batch run hung once in the full suite after other gloo runs).
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


def _run_then_exit(rank: int, fn, *args) -> None:
    """Call the worker, then leave at once: a rank that finished can hang in interpreter teardown
    (seen once after destroy_process_group), which would stall the whole test run."""
    import os
    import sys

    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn, world: int, *args, timeout_s: float = 300) -> None:
    """Run ``fn(rank, world, port, *args)`` on ``world`` ranks; fail the test after ``timeout_s``."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    procs = mp.start_processes(_run_then_exit, args=(fn, world, free_port(), *args), nprocs=world,
                               join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not procs.join(timeout=2):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail(f"{world}-rank run did not finish in {timeout_s:.0f} s")


def launch_fresh(module: str, func: str, world: int, *args, timeout_s: float = 240) -> None:
    """Run ``module.func(rank, world, port, *args)`` on ``world`` fresh interpreters (nothing
    inherited from the pytest process); fail the test on a non-zero exit or after ``timeout_s``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    port = free_port()
    code = (f"import sys; sys.path.insert(0, {here!r}); import torch; torch.set_num_threads(1); "
            f"from {module} import {func}; {func}(int(sys.argv[1]), {world}, {port}, *{list(args)!r}); "
            "import os; sys.stdout.flush(); sys.stderr.flush(); os._exit(0)")  # no teardown hang
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{world}-rank run did not finish in {timeout_s:.0f} s")
    bad = [(r, p.returncode, o[-3000:]) for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode]
    assert not bad, "\n".join(f"rank {r} exited {c}:\n{o}" for r, c, o in bad)
