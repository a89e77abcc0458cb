"""What the probe holds: Adam's P is read from the optimizer's own moments (no parameter-sized
copy), and the live tensors between phases are the ones docs/memory.md lists, counted in
parameter-sized copies on the built-in default."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import compose_cfg
from entprobe.math import paramvec as pv
from entprobe.cli.probe_job import run
from entprobe.pipeline.stages import context
from entprobe.pipeline.stages.snapshot import restore, take

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_footprint import counting_phases, live_tensor_bytes  # noqa: E402


def _adamw_with_state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    with torch.no_grad():  # a coordinate Adam never moved: v = 0 there, P = 1/eps
        opt.state[params[1]]["exp_avg_sq"][0] = 0.0
    return params, opt


def test_live_preconditioner_equals_the_materialised_one_and_reads_the_restored_state():
    params, opt = _adamw_with_state()
    step = int(opt.state[params[0]]["step"])
    eager = pv.adam_preconditioner([opt.state[p]["exp_avg_sq"] for p in params], step, 0.999, 1e-8)
    live = pv.LiveAdamPreconditioner(opt, params, step, 0.999, 1e-8)
    assert len(live) == len(eager)
    for a, b in zip(live, eager):
        assert torch.equal(a, b)
    assert float(live[1][0]) == pytest.approx(1e8)
    # a real step moves v; after the bit-exact restore the live P reads the same bits again
    snap = take(params, opt, torch.device("cpu"))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert not torch.equal(live[0], eager[0])
    restore(params, opt, snap)
    assert all(torch.equal(a, b) for a, b in zip(live, eager))
    with pytest.raises(ValueError, match="step=0"):
        pv.LiveAdamPreconditioner(opt, params, 0, 0.999, 1e-8)


@pytest.mark.parametrize("projection, factored, at_x_end", [("fused", False, 9), ("stored", False, 13),
                                                            ("fused", True, 7), ("stored", True, 11)])
def test_parameter_sized_copies_between_phases(tmp_path, monkeypatch, projection, factored, at_x_end):
    """Live tensors at each phase's end, in parameter-sized copies (the small rest -- token
    batches, logits-free scalars -- is the fraction): weights and Adam's two moments (3); after Y
    over U the Ybar sum (+1; ``stored``: + B_U unit gradients); after X over E the Xbar sum and the
    four E directions (+5), or, with the update's parts held as factors (models above
    ``FACTORED_MIN_NUMEL`` parameters: forced here), ``P Ybar`` and R only (+3); after the variance
    Xbar and Ybar only (5: the E directions freed before U's two were built, those freed after
    their dots); during the ground truth the snapshot of the weights (1: the AdamW step is taken
    a few tensors at a time and puts the moments back, stages/chunked_step.py) with Xbar and Ybar.
    No P copy anywhere."""
    from entprobe.pipeline.stages import prediction

    copies: dict[str, float] = {}
    before = live_tensor_bytes()  # what earlier tests in this process left alive
    monkeypatch.setattr(context.ProbeContext, "phase", counting_phases(copies, baseline=before))
    if factored:
        monkeypatch.setattr(prediction, "FACTORED_MIN_NUMEL", 0)
    run(compose_cfg(tmp_path, f"probe.projection={projection}"))
    B_U = 4  # SHRINK
    # variance: U's two directions were fresh rows, freed at its end; the spent E directions (4) and
    # the stored unit gradients are gone by then
    want = {"accumulate_Y_U": 4 + (B_U if projection == "stored" else 0), "accumulate_X_E": at_x_end,
            "variance": 5, "gt_step": 6, "gt_restore": 6}
    for phase, n in want.items():
        assert n <= copies[phase] < n + 0.9, (phase, copies)


def test_footprint_benchmark_runs_as_documented():
    """docs/memory.md's command: both processes run and the ratio line is printed."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/bench_footprint.py"], cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "probe peak / training-process peak:" in proc.stdout
    assert "accumulate_X_E" in proc.stdout


def test_scaling_on_paper_runs_as_documented():
    """docs/scaling.md's command prints the table it quotes (70B on 64 GPUs: 93 GB peak)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/scaling_on_paper.py", "--checkpointing"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    row = next(line.split() for line in proc.stdout.splitlines() if line.startswith("70B") and line.split()[1] == "64")
    assert row[8] == "93.2", row


def test_scaling_on_paper_one_process_runs_as_documented():
    """docs/scaling.md's ``--one-process`` command prints the table it quotes (7B at 1024 tokens: 1.29
    units, 258.7 GB probe peak), and the fitted units lie between the fit's per-token ratios."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/scaling_on_paper.py", "--one-process"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    row = next(line.split() for line in proc.stdout.splitlines() if line.startswith("7B") and line.split()[1] == "1024")
    assert row[2] == "1.29" and row[5] == "258.7", row
    doc = (root / "docs" / "scaling.md").read_text()
    assert "| 7B | 1024 | 1.29 | 213.4 | 45.3 | 258.7 |" in doc
