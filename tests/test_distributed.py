"""DDP on CPU (gloo): two processes give the one-process numbers, every rank the same ones.

- 2 ranks on batches saved by a 1-process run, uneven shards (E 3+2 prompts, U 2+1), the per-unit
  backward projection (DDP forward/backward under no_sync) and the recomputed, DDP-synced update
  gradient; only rank 0 writes; rank 0's run directory wins.
- 2 ranks sampling (each rank its own prompts) with the ``stored`` projection (each rank keeps its
  own units' gradients) save the gathered global batch; a 1-process run on it gives the
  2-process numbers.
- launchers/torchrun.sh hands every rank the same run directory.
- launcher environments (torchrun / srun / submitit variables) map to torch's env:// variables.
"""
from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import U32, compose_cfg, fp32_dot_tol, fp_tol, recording_units
from ddp_launch import launch
from two_batch_bounds import bounds
from entprobe.checkpoints.models import load_model
from entprobe.pipeline.config_checks import to_typed
from entprobe.runtime import distributed as D
from entprobe.pipeline.run_batches import concat_batches
from entprobe.cli.probe_job import run
from entprobe.rollouts.sampling import RolloutBatch

REPO = Path(__file__).resolve().parents[1]
KEYS = ("deltaH1", "SE_deltaH1", "V_X", "V_Y", "deltaH_true", "SE_deltaH_true", "deltaH_pred", "SE_deltaH_pred")
# 5 = 3 + 2 and 3 = 2 + 1 prompts on 2 ranks; seed_U=7 gives every U group some reward variance
SMALL = ("batch.B_E=5", "batch.B_U=3", "batch.G=4", "batch.seed_U=7")
DDP_PATHS = ("probe.projection=backward", "importance.reuse_probe_gradient=false", "ddp.timeout_s=120")


def ddp_bounds(one: dict, mags, theta_norm: float) -> dict:
    """Absolute bounds on a DDP run's numbers against the one-process run ``one`` on the same
    batches (its per-unit magnitudes ``mags``; ``theta_norm`` = ||theta||): the estimators' from
    two_batch_bounds.py (each rank's units summed with the other's, the all-reduced Ybar through the
    step); ``deltaH1`` from the units' order (``fp32_dot_tol``); ``H_orig``, a mean of -log p >= 0
    terms, by the fp32 rounding of N-term functions of its magnitude; ``deltaH1_step = -Xbar .
    (theta_plus - theta)``: the update's rounding as the prediction's, plus a flip of the last bit
    of theta_plus in any coordinate (u |theta_i|, fp32): ``u sum |Xbar_i theta_i| <= u |Xbar| |theta|``."""
    tol = bounds(one, mags)
    tol["deltaH1"] = fp32_dot_tol(one) * abs(one["deltaH1"])
    tol["H_orig"] = fp_tol(torch.float32, abs(one["H_orig"]), mags.N)
    tol["deltaH1_step"] = tol["deltaH_pred"] + U32 * one["norm_Xbar"] * theta_norm
    return tol


def _numbers(res: dict) -> dict:
    """Every estimator number (timings and memory are per-rank facts, not results)."""
    return {k: v for k, v in res.items()
            if isinstance(v, (int, float)) and not k.startswith(("time/", "mem/"))}


def _worker(rank: int, world: int, port: int, saved: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    out = Path(out)
    # B: the 1-process run's saved batches; C: sampled under DDP (each rank its own prompts), saved.
    for name, extra in (("B", (*DDP_PATHS, f"batch.load='{saved}'")), ("C", (f"batch.save='{out / 'saved_C'}'", "probe.projection=stored"))):
        res = run(compose_cfg(out / f"run{name}_rank{rank}", *SMALL, *extra))
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(res))
    # Hydra gave each rank its own ${now:} directory; rank 0's wins, the other's empty one goes.
    own = out / f"hydra_rank{rank}" / f"12-00-0{rank}"
    (own / ".hydra").mkdir(parents=True)
    (own / "main.log").write_text("")
    (out / f"shared_rank{rank}.txt").write_text(str(D.shared_run_dir(own)))
    D.shutdown()


def test_two_ranks_equal_one_rank_and_each_other(tmp_path):
    saved = tmp_path / "saved"
    with recording_units() as rec:
        one = run(compose_cfg(tmp_path / "one", *SMALL, *DDP_PATHS, f"batch.save='{saved}'"))
    mags = rec.split(one["B_E"])
    model = load_model(to_typed(compose_cfg(tmp_path / "one", *SMALL)).model).model
    theta_norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in model.parameters()))
    assert one["world_size"] == 1 and one["B_E"] == 5 and one["B_U"] == 3
    launch(_worker, 2, str(saved), str(tmp_path))
    B0, B1, C0, C1 = (json.loads((tmp_path / f"{n}_rank{r}.json").read_text()) for n in "BC" for r in (0, 1))
    assert B0["world_size"] == 2 and B0["B_E"] == 5 and B0["B_U"] == 3 and B0["batch_source"] == "load"
    assert _numbers(B0) == _numbers(B1) and _numbers(C0) == _numbers(C1)  # every rank, bit for bit
    tol = ddp_bounds(one, mags, theta_norm)
    for k in KEYS + ("H_orig", "deltaH1_step"):
        assert math.isfinite(one[k]) and one[k] != 0.0, k
        assert abs(B0[k] - one[k]) <= tol[k], (k, B0[k], one[k], tol[k])
    # rewards 0 / 1 and integer lengths: their sums are exact in any order
    for k in ("batch_E/reward_mean", "batch_U/mean_gen_length"):
        assert B0[k] == one[k], k
    # Global pass counts: the work of one process, split over two.
    passes = [{k: v for k, v in r.items() if k.startswith("passes/")} for r in (one, B0)]
    assert passes[0] == passes[1] and passes[0]["passes/backward"] > 0
    assert one["gt/reused_probe_gradient"] == 0.0 == B0["gt/reused_probe_gradient"]
    # Only rank 0 writes (every rank creates the folder).
    assert (tmp_path / "runB_rank0" / "results.json").is_file()
    assert not any((tmp_path / "runB_rank1").iterdir())
    # C sampled under DDP and saved the gathered global batch: 5 and 3 prompts, one width each;
    # a 1-process run on it reproduces the 2-process numbers.
    E, U = RolloutBatch.load(tmp_path / "saved_C" / "E.pt"), RolloutBatch.load(tmp_path / "saved_C" / "U.pt")
    assert (E.B, U.B, E.G, C0["batch_source"]) == (5, 3, 4, "sampled")
    assert C0["batch_E/reward_mean"] == E.rewards.mean().item()  # rewards 0 / 1: exact sums
    again = run(compose_cfg(tmp_path / "again", *SMALL, f"batch.load='{tmp_path / 'saved_C'}'",
                            "probe.projection=stored"))
    with recording_units() as rec:  # the magnitudes of the same batches' per-unit sums
        ref = run(compose_cfg(tmp_path / "ref", *SMALL, f"batch.load='{tmp_path / 'saved_C'}'", *DDP_PATHS))
    tol = ddp_bounds(again, rec.split(ref["B_E"]), theta_norm)
    for k in KEYS + ("H_orig", "deltaH1_step"):
        assert math.isfinite(again[k]) and again[k] != 0.0, k
        assert abs(C0[k] - again[k]) <= tol[k], (k, C0[k], again[k], tol[k])
    # One run directory: both ranks got rank 0's; rank 1's Hydra-only directory was removed.
    shared = {(tmp_path / f"shared_rank{r}.txt").read_text() for r in (0, 1)}
    assert shared == {str((tmp_path / "hydra_rank0" / "12-00-00").resolve())}
    assert not (tmp_path / "hydra_rank1").exists()


def test_torchrun_wrapper_gives_every_rank_one_run_dir(tmp_path):
    # A stand-in interpreter records what the wrapper would start (torchrun hands its environment
    # to every rank; conf/config.yaml reads ENTPROBE_RUN_DIR / ENTPROBE_SWEEP_DIR).
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$OUT/argv"\n'
                    'echo "$ENTPROBE_RUN_DIR $ENTPROBE_SWEEP_DIR $OMP_NUM_THREADS" > "$OUT/env"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("ENTPROBE_RUN_DIR", "ENTPROBE_SWEEP_DIR",
                                                           "TORCHRUN_ARGS", "NPROC", "OMP_NUM_THREADS")}
    env.update(PYTHON=str(fake), OUT=str(tmp_path))
    wrapper = str(REPO / "launchers" / "torchrun.sh")
    subprocess.run([wrapper, "3", "-m", "optimizer.lr=1e-6,1e-5"], env=env, check=True, timeout=30)
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3", "-m", "entprobe.main",
                    "-m", "optimizer.lr=1e-6,1e-5"]
    run_dir, sweep_dir, omp = (tmp_path / "env").read_text().split()
    assert re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", run_dir)
    assert sweep_dir == "multirun/" + run_dir.removeprefix("outputs/") and omp == "1"  # one stamp
    env.update(ENTPROBE_RUN_DIR="/runs/x", NPROC="2", TORCHRUN_ARGS="--nnodes 2 --rdzv-endpoint h:29400")
    subprocess.run([wrapper, "batch.B_E=64"], env=env, check=True, timeout=30)
    assert (tmp_path / "argv").read_text().splitlines() == [
        "-m", "torch.distributed.run", "--nnodes", "2", "--rdzv-endpoint", "h:29400", "--nproc_per_node", "2",
        "-m", "entprobe.main", "batch.B_E=64"]
    assert (tmp_path / "env").read_text().split()[0] == "/runs/x"


def test_config_reads_the_launcher_run_dirs(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from conftest import CONF_DIR

    monkeypatch.setenv("ENTPROBE_RUN_DIR", "/runs/a")
    monkeypatch.setenv("ENTPROBE_SWEEP_DIR", "/sweeps/b")
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(config_name="config", return_hydra_config=True)
    GlobalHydra.instance().clear()
    assert (cfg.hydra.run.dir, cfg.hydra.sweep.dir) == ("/runs/a", "/sweeps/b")


def _toy(B: int, P: int, R: int, seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    G, T = 2, P + R
    resp = torch.zeros(B, G, T, dtype=torch.long)
    resp[..., P:] = 1
    resp[0, 0, P + 1:] = 0  # a short response
    ids = torch.randint(3, 18, (B, G, T), generator=g)
    return RolloutBatch(ids, torch.ones(B, G, T, dtype=torch.long), resp, -torch.rand(B, G, T, generator=g) * resp,
                        torch.rand(B, G, generator=g), torch.randn(B, G, generator=g), torch.arange(B) + seed, 0.7)


def test_concat_batches_pads_prompts_left_and_responses_right():
    a, b = _toy(2, 3, 4, 0), _toy(1, 5, 2, 1)  # prompt widths 3 and 5, response widths 4 and 2
    c = concat_batches([a, b], pad_id=0)
    assert c.input_ids.shape == (3, 2, 9) and c.temperature == 0.7  # 5 prompt + 4 response columns
    # a: 2 pad columns on the left, nothing on the right; b: 2 pad columns on the right.
    assert torch.equal(c.input_ids[:2, :, 2:], a.input_ids) and (c.input_ids[:2, :, :2] == 0).all()
    assert torch.equal(c.input_ids[2:, :, :7], b.input_ids) and (c.input_ids[2:, :, 7:] == 0).all()
    assert (c.attention_mask[:2, :, :2] == 0).all() and (c.response_mask[2:, :, 7:] == 0).all()
    assert torch.equal(c.gen_lengths, torch.cat([a.gen_lengths, b.gen_lengths]))
    assert torch.equal(c.S_sampler, torch.cat([a.S_sampler, b.S_sampler]))
    assert torch.equal(c.prompt_index, torch.tensor([0, 1, 1]))


ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables during the test; afterwards the environment exactly as before
    (export_launcher_env writes os.environ directly, out of monkeypatch's sight)."""
    saved = dict(os.environ)
    for k in list(os.environ):
        if k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC")) or k in ENV_KEYS:
            monkeypatch.delenv(k)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def test_srun_step_variables_become_torch_env(clean_env):
    for k, v in dict(SLURM_PROCID="5", SLURM_STEP_NUM_TASKS="8", SLURM_NTASKS="8", SLURM_LOCALID="1",
                     SLURM_LAUNCH_NODE_IPADDR="10.1.2.3", SLURM_JOB_ID="123456").items():
        clean_env.setenv(k, v)
    assert D.launched_distributed() and D.env_rank() == 5
    D.export_launcher_env()
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")] == \
           ["5", "8", "1", "10.1.2.3", str(20000 + 123456 % 20000)]


def test_sbatch_script_itself_is_not_a_distributed_step(clean_env):
    # The batch script of an --ntasks=4 allocation runs once: no srun step, no process group.
    for k, v in dict(SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_JOB_ID="7").items():
        clean_env.setenv(k, v)
    assert not D.launched_distributed()
    assert D.init_from_env("gloo") is False


def test_submitit_task_variables_become_torch_env(clean_env):
    for k, v in dict(SUBMITIT_EXECUTOR="local", SUBMITIT_LOCAL_JOB_ID="4242", SUBMITIT_LOCAL_NTASKS="2",
                     SUBMITIT_LOCAL_JOB_NUM_NODES="1", SUBMITIT_LOCAL_NODEID="0",
                     SUBMITIT_LOCAL_GLOBALID="1", SUBMITIT_LOCAL_LOCALID="1").items():
        clean_env.setenv(k, v)
    assert D.launched_distributed() and D.env_rank() == 1
    D.export_launcher_env()
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")] == ["1", "2", "1", "2"]
    assert os.environ["MASTER_ADDR"] == socket.gethostname() and 20000 <= int(os.environ["MASTER_PORT"]) <= 60000


def test_torchrun_variables_are_left_alone(clean_env):
    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="h", MASTER_PORT="29500",
                     SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="1").items():  # srun 1 task running torchrun
        clean_env.setenv(k, v)
    assert D.launched_distributed() and D.env_rank() == 1
    D.export_launcher_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("1", "2", "29500")


def test_torchrun_launcher_runs_two_cpu_processes_as_documented(tmp_path):
    """``launchers/torchrun.sh 2 ...`` exactly as docs/scaling.md shows it, from another directory,
    with no PYTHON set: it finds the project's .venv, two gloo ranks share one run directory."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "TORCHRUN_ARGS", "NPROC", "ENTPROBE_SWEEP_DIR")}
    env.update(ENTPROBE_RUN_DIR=str(tmp_path / "run"), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # the CPU line
    proc = subprocess.run([str(REPO / "launchers" / "torchrun.sh"), "2", "batch.B_E=8", "batch.B_U=8"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["world_size"] == 2 and (res["B_E"], res["B_U"]) == (8, 8) and math.isfinite(res["deltaH_pred"])
    assert "entropy change of the next step" in proc.stdout and (tmp_path / "run" / "report.md").is_file()
    bad = {**env, "PYTHON": "/bin/false"}
    proc = subprocess.run([str(REPO / "launchers" / "torchrun.sh"), "2"], env=bad, capture_output=True, text=True)
    assert proc.returncode == 2 and "cannot import entprobe" in proc.stderr


def test_torchrun_multirun_runs_every_job_on_both_ranks(tmp_path):
    """``launchers/torchrun.sh 2 -m optimizer.lr=...`` (docs/scaling.md's torchrun sweep) runs both
    jobs: the process group of job 0 is kept for job 1 (re-initialising it on torchrun's store
    hung at job 1 until ddp.timeout_s). Its console: Hydra's launcher lines once (rank 0's), the
    summary as an aligned table (the markdown is in the file), no line about rank 1 waiting for
    rank 0's lock on the batch cache (a rank waiting for its own job's ranks is by design)."""
    from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint

    ensure_default_checkpoint()  # built here, not by two ranks at once
    sw = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHRUN_ARGS", "NPROC", "ENTPROBE_RUN_DIR")}
    env.update(PYTHON=sys.executable, ENTPROBE_SWEEP_DIR=str(sw), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([str(REPO / "launchers" / "torchrun.sh"), "2", "-m", "optimizer.lr=1e-6,1e-5",
                           "batch.B_E=4", "batch.B_U=4", "batch.G=4", "batch.seed_U=7", "importance.enabled=false",
                           "probe.variance_enabled=false", "ddp.timeout_s=60", "logging.progress=false"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = [json.loads(p.read_text()) for p in sorted(sw.glob("*/results.json"))]
    assert not list(sw.glob(".rank*"))  # rank 1's own Hydra folders (sweep.job_subdir) are removed
    assert [(r["lr"], r["world_size"], r["batch_source"]) for r in res] == [(1e-6, 2, "sampled"), (1e-5, 2, "cache")]
    # one batch, both ranks, the same computation twice: the same Xbar . P Ybar times each lr; the
    # ratio is 10 to three fp64 roundings
    assert abs(res[1]["deltaH1"] / res[0]["deltaH1"] - 10.0) <= fp_tol(torch.float64, 10.0, 3, worst_case=True)
    console = proc.stdout + proc.stderr
    assert console.count("[HYDRA] Launching 2 jobs locally") == 1
    assert console.count("[HYDRA] \t#0 : ") == 1 and console.count("[HYDRA] \t#1 : ") == 1
    assert "waiting for the lock" not in console and "no holder recorded" not in console
    assert "|---|" not in console and "| job |" not in console and "|---|" in (sw / "sweep_summary.md").read_text()
    table = console[console.index("sweep summary: "):].splitlines()[1:4]
    assert [line.split()[:3] for line in table] == [["job", "status", "overrides"], ["0", "ok", "optimizer.lr=1e-06"],
                                                    ["1", "ok", "optimizer.lr=1e-05"]]
