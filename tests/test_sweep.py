"""Sweeps: every job runs, batches are sampled once per batch config, a summary row per job.

- ``-m optimizer.lr=1e-6,1e-5`` with the basic launcher: the second lr job loads the first one's
  batches (deltaH1 scales exactly with lr); an out-of-range lr among them (``-1.0``) refuses the
  sweep before job 0 runs (tests/test_job_faults.py); a job that fails while it runs is recorded as
  failed (tests/test_cli.py).
- ``hydra/launcher=submitit_local`` with 2 tasks: one job, DDP over the two submitit tasks, equal to
  a 1-process run on the same batches.
- ``hydra/launcher=slurm`` composes into a valid sbatch script for hydra-submitit-launcher 1.2.0.
"""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from conftest import CONF_DIR, compose_cfg, fp32_dot_tol, fp_tol, recording_units
from entprobe.reporting import sweep
from entprobe.cli.probe_job import run, to_typed
from two_batch_bounds import bounds

# seed_U=7: every U group has some reward variance, so deltaH1 != 0
SMALL = ("batch.B_E=5", "batch.B_U=3", "batch.G=4", "batch.seed_U=7", "model.device=cpu",
         "logging.wandb.mode=disabled", "logging.progress=false", "logging.console_table=false")


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _cli(cwd: Path, *args: str, timeout: int = 300, **extra_env: str) -> subprocess.CompletedProcess:
    """``python -m entprobe.main ...`` as a user types it (no launcher variables inherited)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", **extra_env)
    return subprocess.run([sys.executable, "-m", "entprobe.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "sweep_summary.csv") as f:
        return list(csv.DictReader(f))


def test_lr_sweep_reuses_batches(tmp_path):
    sw = tmp_path / "sweep"
    proc = _cli(tmp_path, "-m", *SMALL, "optimizer.lr=1e-6,1e-5", f"hydra.sweep.dir={sw}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(sw)
    assert [(r["job"], r["status"], r["overrides"]) for r in rows] == [
        ("0", "ok", "optimizer.lr=1e-06"), ("1", "ok", "optimizer.lr=1e-05")]
    assert all(float(r["time_s"]) > 0 for r in rows)
    res = [json.loads((sw / str(j) / "results.json").read_text()) for j in (0, 1)]
    # The summary carries results.json's numbers.
    for r, x in zip(rows, res):
        for k in ("deltaH_pred", "SE_deltaH_pred", "deltaH_true", "SE_deltaH_true", "deltaH_true_minus_pred",
                  "SE_deltaH_true_minus_pred", "ESS_frac", "deltaH1", "SE_deltaH1"):
            assert float(r[k]) == x[k], k
    # One batch for both lr values: sampled by job 0, loaded from the cache by job 1.
    assert [x["batch_source"] for x in res] == ["sampled", "cache"] == [r["batch"] for r in rows[:2]]
    # Stages 1-2 computed by job 0, rescaled by job 1 (tests/test_stage12_share.py checks the numbers)
    assert [x["reused_stage12"] for x in res] == [False, True]
    assert [r["stage12"] for r in rows] == ["computed", "reused"]
    assert "time/sample_E_s" in res[0] and "time/sample_E_s" not in res[1]
    for k in ("bars_dot", "H_orig", "V_X", "V_Y", "batch_E/reward_mean", "batch_U/reward_mean"):
        assert res[0][k] == res[1][k], k  # identical E and U (and weights): bit for bit
    # -lr times the same bars_dot (and sqrt(V)): the ratio is 1e-5 / 1e-6 to three fp64 roundings
    ten = fp_tol(torch.float64, 10.0, 3, worst_case=True)
    assert res[0]["deltaH1"] != 0.0 and abs(res[1]["deltaH1"] / res[0]["deltaH1"] - 10.0) <= ten
    assert abs(res[1]["SE_deltaH1"] / res[0]["SE_deltaH1"] - 10.0) <= ten
    cached = [p for p in (sw / sweep.CACHE_DIR).iterdir() if p.is_dir()]
    assert len(cached) == 1 and sweep.cache_complete(cached[0])
    md = (sw / "sweep_summary.md").read_text()
    assert "2 jobs, 0 failed." in md and md.count("\n| ") == 3  # header + 2 rows


def test_lr_sweep_with_gradient_clipping_shares_stage12(tmp_path):
    """``importance.max_grad_norm`` (a TRL checkpoint's ``max_grad_norm=1.0``): the clipped AdamW
    step is the closed form at ``s Ybar`` with s free of the lr, so the sweep's second job rescales
    the first one's Stages 1-2 (prediction, parts, SEs, the clip factor), and takes its own clipped
    step."""
    sw = tmp_path / "sweep"
    proc = _cli(tmp_path, "-m", *SMALL, "importance.max_grad_norm=1.0", "optimizer.lr=1e-4,1e-3",
                f"hydra.sweep.dir={sw}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = [json.loads((sw / str(j) / "results.json").read_text()) for j in (0, 1)]
    assert [x["reused_stage12"] for x in res] == [False, True] and [r["stage12"] for r in _rows(sw)] == ["computed", "reused"]
    assert all(x["pred/step_model"] == "adamw_closed_form" for x in res)
    assert res[0]["pred/grad_clip_factor"] == res[1]["pred/grad_clip_factor"] < 0.5  # clipping binds
    assert res[1]["stage12_share"] == "reused from lr=0.0001"
    # the rescaled prediction: each part times r = 1e-3 / 1e-4 in fp64, summed again (3 terms)
    r = 1e-3 / 1e-4
    parts = [res[0][f"deltaH_pred_{k}"] for k in ("gradient", "momentum", "weight_decay")]
    assert abs(res[1]["deltaH_pred"] - r * res[0]["deltaH_pred"]) <= fp_tol(
        torch.float64, r * sum(abs(x) for x in parts), 3, k=2, worst_case=True)
    # its SE: the sd of the per-prompt contributions times r, each centred (e_n - mean e: rounded
    # relative to |e_n| + |mean e|) and squared, B_E of them summed in fp64
    e = json.loads((sw / "0" / "per_unit.json").read_text())["E/deltaH_pred"]
    B, mean = len(e), sum(e) / len(e)
    mag = r * (max(abs(x) for x in e) + abs(mean)) * math.sqrt(B / (B - 1))
    assert abs(res[1]["SE_deltaH_pred"] - r * res[0]["SE_deltaH_pred"]) <= fp_tol(torch.float64, mag, B, k=2,
                                                                                   worst_case=True)
    assert res[0]["deltaH_true"] != res[1]["deltaH_true"]  # each job's own step


def test_submitit_local_job_runs_ddp_over_its_tasks(tmp_path):
    sw = tmp_path / "sweep"
    proc = _cli(tmp_path, "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                "hydra.launcher.timeout_min=5", "ddp.timeout_s=120", *SMALL, "optimizer.lr=1e-5",
                f"hydra.sweep.dir={sw}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(sw)
    assert [(r["job"], r["status"], r["batch"]) for r in rows] == [("0", "ok", "sampled")]  # rank 0 only
    assert list(sw.glob("*/results.json")) == [sw / "0" / "results.json"]
    assert (sw / ".submitit").is_dir() and not list(sw.glob(".rank*"))  # rank 1's Hydra folder removed
    ddp = json.loads((sw / "0" / "results.json").read_text())
    assert ddp["world_size"] == 2 and ddp["B_E"] == 5 and ddp["B_U"] == 3
    assert ddp["reused_stage12"] is False and ddp["stage12_share"] == "off: 2 processes (sharing is single-process only)"
    cache = next(p for p in (sw / sweep.CACHE_DIR).iterdir() if p.is_dir())
    with recording_units() as rec:  # the per-unit backward: the magnitudes of the per-unit sums
        one = run(compose_cfg(tmp_path / "one", *SMALL, "optimizer.lr=1e-5", f"batch.load='{cache}'",
                              "probe.projection=backward"))
    # the ranks sum the fp32 units in another order, each unit's sums on another path:
    # tests/two_batch_bounds.py (deltaH1: fp32_dot_tol, the units' order)
    tol = {**bounds(one, rec.split(one["B_E"])), "deltaH1": fp32_dot_tol(one) * abs(one["deltaH1"])}
    for k in ("deltaH1", "SE_deltaH1", "V_X", "V_Y", "deltaH_true"):
        assert math.isfinite(one[k]) and abs(ddp[k] - one[k]) <= tol[k], (k, ddp[k], one[k], tol[k])


def test_cache_key_ignores_the_optimizer_and_tracks_what_sampling_depends_on(tmp_path):
    def key(*o: str, world: int = 1) -> str:
        return sweep.batch_cache_key(to_typed(compose_cfg(tmp_path, *o)), world)
    base = key()
    assert key("optimizer.lr=1e-3", "importance.is_mode=clip", "batch.save=/x") == base
    others = {key("batch.B_E=9"), key("batch.seed_U=3"), key("sampling.temperature=0.7"),
              key("model.builtin_seed=1"), key("probe.mode=single_batch"), key(world=2)}
    assert base not in others and len(others) == 6


def test_summary_lists_only_the_overrides_that_vary(tmp_path):
    for num, ov, status in ((0, ["a=1", "lr=1"], "ok"), (1, ["a=1", "lr=2"], "failed")):
        row = {"job": num, "status": status, "overrides": ov, "time_s": 1.5, "output_dir": str(tmp_path / str(num)),
               "batch": "", "stage12": "", "error": "" if status == "ok" else "RuntimeError: x|y", "deltaH1": 0.25 * (num + 1),
               "SE_deltaH1": 0.1, "deltaH_true": float("nan"), "ESS_frac": 0.5, "deltaH_pred": -0.02,
               "SE_deltaH_pred": 0.01, "SE_deltaH_true": float("nan"), "deltaH_true_minus_pred": float("nan"),
               "SE_deltaH_true_minus_pred": float("nan"), "lr": 1e-6 * (num + 1), "B_E": 4, "B_U": 4}
        (tmp_path / sweep.ROWS_DIR).mkdir(exist_ok=True)
        (tmp_path / sweep.ROWS_DIR / f"{num:06d}.json").write_text(json.dumps(row))
    csv_path, md_path = sweep.write_summary(tmp_path)
    rows = _rows(tmp_path)
    assert [r["overrides"] for r in rows] == ["lr=1", "lr=2"] and rows[1]["deltaH1"] == "0.5"
    md = md_path.read_text().splitlines()
    assert md[2] == "2 jobs, 1 failed."
    assert md[-3] == ("| 1 | failed | lr=2 | 2e-06 | 4 | 4 | -0.02 | 0.01 | nan | nan | nan | nan | 0.5 | 0.5 | "
                      "0.1 | 1.5 |  |  | RuntimeError: x\\|y |")
    assert md[-1] == "![predicted vs measured](sweep_summary.png)"  # from the one job that completed
    assert (tmp_path / "sweep_summary.png").is_file()


def test_slurm_launcher_config_makes_an_sbatch_script(tmp_path, monkeypatch):
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from submitit.slurm.slurm import SlurmExecutor

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(config_name="config", return_hydra_config=True, overrides=[
            "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.nodes=2",
            "hydra.launcher.tasks_per_node=4", "hydra.launcher.gpus_per_node=4",
            "+hydra.launcher.additional_parameters.mail-type=END", f"hydra.sweep.dir={tmp_path}"])
    GlobalHydra.instance().clear()
    HydraConfig.instance().set_config(cfg)
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher"
    # What launcher.launch() hands to submitit (same key mapping), rendered without a cluster.
    params = dict(launcher.params)
    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 1))
    ex = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"),
                               slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    ex.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    text = ex._executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
                 "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=8", "#SBATCH --mem=64GB",
                 "#SBATCH --time=120", "#SBATCH --mail-type=END", "export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK"):
        assert line in text, line
    assert text.index("export PYTHONUNBUFFERED=1") < text.index("srun")


FAKE_WANDB = """
import json, os
def _rec(**kw):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps(kw, default=str) + "\\n")
class Table:
    def __init__(self, columns, data):
        self.columns, self.data = columns, data
class Image:
    def __init__(self, path):
        self.path = path
class Run:
    def __init__(self):
        self.summary = {}
        self.history = []
    def log(self, d):
        self.history.append({k: type(v).__name__ for k, v in d.items()})
        self.table = {r[0]: r[1] for r in d["results"].data}
    def finish(self, exit_code=0):
        _rec(call="finish", exit_code=exit_code, summary=self.summary, history=self.history, table=self.table)
def init(**kw):
    _rec(call="init", **kw)
    return Run()
"""


def test_documented_sweep_writes_its_plot_and_wandb_runs_are_named_grouped_and_summarised(tmp_path):
    """docs/scaling.md's sweep, verbatim: ``python -m entprobe.main -m batch.B_E=8,16 optimizer.lr=1e-6,1e-5``.
    sweep_summary.png and the summary's lr / B columns; each job's wandb run (a fake wandb module
    shadows the real one) is named from its overrides, grouped by the sweep, tagged, with every
    result in the summary and only the table and images in the history; one batch per B_E."""
    fake = tmp_path / "fake"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    calls = tmp_path / "calls.jsonl"
    proc = _cli(tmp_path, "-m", "batch.B_E=8,16", "optimizer.lr=1e-6,1e-5",
                PYTHONPATH=os.pathsep.join([str(fake), *filter(None, [os.environ.get("PYTHONPATH")])]),
                FAKE_WANDB_LOG=str(calls))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sw,) = tmp_path.glob("multirun/*/*")
    rows = _rows(sw)
    assert sorted((float(r["lr"]), int(r["B_E"]), int(r["B_U"])) for r in rows) == [
        (1e-6, 8, 8), (1e-6, 16, 8), (1e-5, 8, 8), (1e-5, 16, 8)]
    assert sorted(r["batch"] for r in rows) == ["cache", "cache", "sampled", "sampled"]
    assert sorted(r["stage12"] for r in rows) == ["computed", "computed", "reused", "reused"]  # one per B_E
    png = sw / "sweep_summary.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![predicted vs measured](sweep_summary.png)" in (sw / "sweep_summary.md").read_text()

    log = [json.loads(line) for line in calls.read_text().splitlines()]
    inits, finishes = [c for c in log if c["call"] == "init"], [c for c in log if c["call"] == "finish"]
    assert len(inits) == len(finishes) == 4
    for job, (init, fin) in enumerate(zip(inits, finishes)):
        r = rows[job]
        assert init["name"] == f"B_E={r['B_E']},lr={r['lr']}", init["name"]
        assert init["group"] == str(sw.relative_to(tmp_path)) and init["job_type"] == "two_batch"
        assert init["mode"] == "offline" and init["dir"] == str(sw / str(job))
        assert init["tags"] == ["two_batch", "builtin", "token_mean", "sweep"]
        res = json.loads((sw / str(job) / "results.json").read_text())
        assert fin["exit_code"] == 0 and fin["summary"]["deltaH_pred"] == res["deltaH_pred"]
        assert set(fin["summary"]) == {k for k, v in res.items() if isinstance(v, (bool, int, float, str))}
        # one history step: the results table and the images, no scalar
        assert fin["history"] == [{"results": "Table", "plots/attribution": "Image",
                                   "plots/importance_weights": "Image", "plots/projections": "Image"}]
        assert fin["table"]["deltaH_pred"] == res["deltaH_pred"] and fin["table"]["SE_deltaH_true"] == res["SE_deltaH_true"]


def test_a_multirun_into_a_busy_sweep_dir_takes_its_own_job_folders(tmp_path):
    """Two multiruns into one hydra.sweep.dir: while another live multirun holds job folders 0
    and 1 (its claims ``.jobs/<n>.lock``), this one writes 0-2 and 1-2, leaves the other's results
    alone, and the summary has a row per folder, each with that job's own lr and numbers."""
    from entprobe.runtime.locks import try_lock

    sw = tmp_path / "sweep"
    held = [try_lock(sw / sweep.CLAIMS_DIR / f"{n}.lock") for n in (0, 1)]  # the other multirun
    theirs = {"lr": 1e-4, "deltaH_pred": 0.5}
    (sw / "0").mkdir(parents=True)
    (sw / "0" / "results.json").write_text(json.dumps(theirs))
    other_row = {"job": "0", "status": "ok", "overrides": ["optimizer.lr=1e-4"], "lr": 1e-4, "B_E": 5, "B_U": 3,
                 "deltaH_pred": 0.5, "time_s": 1.0, "output_dir": str(sw / "0"), "batch": "", "stage12": "", "error": ""}
    (sw / sweep.ROWS_DIR).mkdir()
    (sw / sweep.ROWS_DIR / "0.json").write_text(json.dumps(other_row))
    try:
        proc = _cli(tmp_path, "-m", *SMALL, "importance.enabled=false", "probe.variance_enabled=false",
                    "optimizer.lr=3e-4,3e-3", f"hydra.sweep.dir={sw}")
    finally:
        for lock in held:
            lock.release()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((sw / "0" / "results.json").read_text()) == theirs and not (sw / "1").exists()
    assert not list(sw.glob("previous-*")) and not list(sw.glob("*/previous-*"))
    rows = _rows(sw)
    assert [(r["job"], float(r["lr"])) for r in rows] == [("0", 1e-4), ("0-2", 3e-4), ("1-2", 3e-3)]
    for r in rows[1:]:
        res = json.loads((sw / r["job"] / "results.json").read_text())
        assert r["output_dir"] == str(sw / r["job"]) and res["lr"] == float(r["lr"])
        assert float(r["deltaH_pred"]) == res["deltaH_pred"] and r["overrides"].endswith(f" optimizer.lr={r['lr']}")


def test_job_subdir_is_claimed_once_per_process_and_other_ranks_get_their_own(tmp_path, monkeypatch):
    from entprobe.runtime.locks import try_lock

    monkeypatch.setattr(sweep, "_CLAIMED", {})
    assert sweep.job_subdir(tmp_path, 0) == "0" == sweep.job_subdir(tmp_path, 0)  # resolved again: same
    other = try_lock(tmp_path / sweep.CLAIMS_DIR / "1.lock")
    third = try_lock(tmp_path / sweep.CLAIMS_DIR / "1-2.lock")
    assert sweep.job_subdir(tmp_path, 1) == "1-3"
    other.release(), third.release()
    monkeypatch.setenv("RANK", "1")
    assert sweep.job_subdir(tmp_path, 2) == ".rank1/2"
    for key, (lock, _) in sweep._CLAIMED.items():
        lock.release()


def test_plan_reads_the_job_folders_of_concurrent_multiruns(tmp_path):
    """``entprobe.plan`` on a sweep dir takes ``<num>-<k>`` folders (sweep.job_subdir) as jobs too."""
    from entprobe.reporting.planning import sweep_jobs

    for name in ("10", "0-2", "1", "0", "0-10", "previous-0", ".jobs", "x-2", "3-", "5"):
        (tmp_path / name).mkdir()
        if name != "5":
            (tmp_path / name / "results.json").write_text("{}")
    assert [p.name for p in sweep_jobs(tmp_path)] == ["0", "0-2", "0-10", "1", "10"]
