"""Faults of entprobe-run and of the torchrun sweep (issue 39, "runs"):

- ``entprobe-run`` on a fresh ``--out`` leaves each job's own wandb run in its ``step-<N>/wandb/``
  (it was moved into ``step-<N>/previous-*/`` with a false "held an earlier run" line: the job set
  aside the earlier outputs after its logger had started the run there);
- a lock waiter prints nothing while the holder is another rank of its own job, or has taken the
  lock but not yet recorded itself ("no holder recorded"); another job's holder it names;
- the sweep summary on the console is an aligned table, no markdown (that stays in the file).

The torchrun sweep's console (one ``Launching`` line, no raw markdown, no lock line) is checked in
tests/test_distributed.py's torchrun multirun test.
"""
from __future__ import annotations

FAKE_RESULTS = {"H_orig": 1.0, "SE_H_orig": 0.1, "B_E": 2, "deltaH_pred": -0.01, "deltaH_true": -0.02}


def test_entprobe_run_keeps_each_jobs_wandb_run_in_its_step_folder(tmp_path, monkeypatch, capsys):
    """The real probe job (``probe_job.run``: its run dir handling) and a real offline wandb run per
    checkpoint; only the probe's computation (``probe_job._run``) is replaced. A second
    entprobe-run into the same --out does hold an earlier run: that one is moved aside, and says so."""
    import entprobe.cli.probe_job as PJ
    from entprobe.cli.probe_run import main

    monkeypatch.setattr(PJ, "_run", lambda cfg, *a, **kw: dict(FAKE_RESULTS))
    for var in ("WANDB_MODE", "WANDB_ERROR_REPORTING", "WANDB_DISABLE_GIT", "WANDB_SILENT", "WANDB_QUIET"):
        monkeypatch.delenv(var, raising=False)  # offline_env sets the first three
    run = tmp_path / "grpo"
    for step in (3, 6):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    out = tmp_path / "over"
    given = ["logging.logger=wandb", "logging.wandb.mode=offline", "logging.progress=false"]
    assert main([str(run), "--out", str(out), *given]) == 0
    printed = "".join(capsys.readouterr())
    assert "held an earlier run" not in printed
    for step in (3, 6):
        job = out / f"step-{step}"
        assert not list(job.glob("previous-*")), sorted(p.name for p in job.iterdir())
        (wandb_run,) = job.glob("wandb/offline-run-*/run-*.wandb")  # where `wandb sync step-N/wandb/...` looks
        assert wandb_run.stat().st_size > 0
    first = {step: next((out / f"step-{step}").glob("wandb/offline-run-*")).name for step in (3, 6)}
    assert main([str(run), "--out", str(out), *given]) == 0
    printed = "".join(capsys.readouterr())
    for step in (3, 6):
        job = out / f"step-{step}"
        assert f"[entprobe] {job} held an earlier run: moved wandb into previous-" in printed
        (prev,) = job.glob("previous-*")
        assert [p.name for p in prev.glob("wandb/offline-run-*")] == [first[step]]  # the first run's, whole
        (now,) = job.glob("wandb/offline-run-*")
        assert now.name != first[step] and list(now.glob("run-*.wandb"))
