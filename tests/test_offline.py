"""Offline means no network: with ``logging.wandb.mode=offline`` or ``disabled`` a whole run of the
CLI resolves no host name and opens no network connection (wandb's service socket is a Unix
socket and allowed). The socket functions are replaced before anything is imported; every
attempt is recorded (to a file, at once) and refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

GUARD = r"""
import json, socket, sys
attempts, record = [], sys.argv[1]
def refuse(kind):
    def fn(*args, **kwargs):
        attempts.append([kind, repr(args[:2])[:200]])
        open(record, "w").write(json.dumps(attempts))  # now: the process may end through os._exit
        raise OSError(f"network refused by the test: {kind}")
    return fn
open(record, "w").write("[]")
for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "create_connection"):
    setattr(socket, name, refuse(name))
_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex
def connect(self, address, _orig=_connect):
    if self.family != socket.AF_UNIX:
        return refuse("connect")(address)
    return _orig(self, address)
def connect_ex(self, address, _orig=_connect_ex):
    if self.family != socket.AF_UNIX:
        return refuse("connect_ex")(address)
    return _orig(self, address)
socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
sys.argv = ["entprobe.main", *sys.argv[2:]]
import runpy
runpy.run_module("entprobe.main", run_name="__main__")
"""


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_a_run_makes_no_network_lookup_or_connection(tmp_path, mode):
    run_dir, record = tmp_path / "run", tmp_path / "attempts.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true")
    proc = subprocess.run(
        [sys.executable, "-c", GUARD, str(record), "batch.B_E=4", "batch.B_U=4", "batch.G=4",
         f"logging.wandb.mode={mode}", "logging.progress=false", "logging.verdict=false",
         "importance.enabled=false", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "results.json").is_file()
    assert json.loads(record.read_text()) == []
    assert (run_dir / "wandb").is_dir() == (mode == "offline")
