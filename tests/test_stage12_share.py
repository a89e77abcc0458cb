"""Stages 1-2 shared across the lrs of a sweep (stage12_share.py): the same numbers as each job
run on its own, computed once.

- On the exact fp64 model (``run_two_batch``): a job reading another lr's Stages 1-2 gives every
  prediction / SE / deltaH1 key to fp64 rounding (``stored`` projections; ``jvp``: fp32, see
  below) and the same measured change, bit for bit, as the job computing its own.
- On the built-in default (``run`` with a sweep's batch cache, fp32): the same to the fp32
  rounding of the update's parts at another lr (``share_tolerances``: from each dot's terms'
  magnitudes); lr-free keys and the measured change identical; a job differing in anything but
  the lr computes its own; a corrupt or stale entry is reported and recomputed.
- When sharing is refused, and why.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import compose_cfg, fp_tol, recording_units, se_tol, welch_interval_tol
from entprobe.math import estimators as est
from entprobe.runtime import distributed as D
from entprobe.config import ImportanceConfig, ProbeConfig, ProjectionMode
from entprobe.pipeline.geometry import Geometry
from entprobe.cli.probe_job import run, to_typed
from entprobe.pipeline.modes.two_batch import run_two_batch
from entprobe.pipeline.lr_share import BUFFERS, ENTRY, SUBDIR, Stage12Share, why_not_shared
from exact_oracle import batch_of, make_oracle

UNTIMED = ("time/", "mem/", "passes/", "stage12", "reused_stage12", "snapshot_device")
# keys that do not depend on the lr: from the stored Stages 1-2 exactly
LR_FREE = ("bars_dot", "H_orig", "V_X", "V_Y", "frac_var", "norm_Xbar", "norm_PYbar", "cos_Xbar_PYbar", "B_E", "B_U")


def numeric(res: dict) -> dict:
    return {k: v for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and not k.startswith(UNTIMED)}


def share_tolerances(own: dict, mags, r: float, dtype: torch.dtype) -> dict:
    """Absolute bounds, per results key, on a job reading another lr's Stages 1-2 against the job
    computing its own at ``own["lr"]``. The lr-linear values are the other lr's times r (in fp64);
    the job's own are its own fp32 (``dtype``) computation: each coordinate of the update's parts
    (and of J Xbar) rounds once more at its scale (eps of it, both jobs), and each dot of them
    (``Xbar . Delta_part``, per unit ``X_n . Delta_part``, ``Y_v . J Xbar``) sums N such terms
    (``fp_tol``). ``mags``: the per-unit magnitudes recorded at the other lr (``recording_units``),
    times r. Means of per-unit dots are bounded by the mean of the per-unit bounds (triangle
    inequality), SEs by ``se_tol``, intervals by ``welch_interval_tol``. Every other number (lr-free,
    or -lr times an lr-free one, or the ground truth) is the same computation in both: exact. A
    sharing that forgot to rescale a value is off by the factor r (10 or 0.1 here)."""
    parts = [k for k in ("gradient", "momentum", "weight_decay") if f"deltaH_pred_{k}" in own]

    def unit(M):  # per-unit bound on a job's own dot of N terms of total magnitude M (at this lr)
        return torch.tensor([fp_tol(dtype, r * float(m), mags.N) + fp_tol(dtype, r * float(m)) for m in M],
                            dtype=torch.float64)
    tE = {k: unit(mags.E[:, 1 + j]) for j, k in enumerate(parts)}
    tu = unit(mags.U[:, 1])
    e_tot = sum(tE.values())
    dpred, dse = float(e_tot.mean()), se_tol(e_tot)
    q = est.t_quantile(own["B_E"] - 1)
    w = welch_interval_tol(dpred, [(own["SE_deltaH_pred_E"] ** 2, own["B_E"], dse),
                                   (own["SE_deltaH_pred_U"] ** 2, own["B_U"], se_tol(tu))])
    tol = {"deltaH_pred": dpred, "SE_deltaH_pred": dse, "SE_deltaH_pred_E": dse, "SE_deltaH_pred_U": se_tol(tu),
           "ci95_pred_low": dpred + q * dse, "ci95_pred_high": dpred + q * dse,
           "SE_deltaH_pred_expected": w["SE"], "pred/expected_df": w["df"],
           "ci95_pred_expected_low": w["ci"], "ci95_pred_expected_high": w["ci"],
           "deltaH_true_minus_pred": dpred, "SE_deltaH_true_minus_pred": dse,
           "ci95_true_minus_pred_low": dpred + q * dse, "ci95_true_minus_pred_high": dpred + q * dse}
    # the rounding bound holds min(step bound, |deltaH1_step - deltaH_pred|); the floor is
    # lr sqrt(R / SE_sampling), so its relative tolerance is half of R's and of SE_sampling's
    tol.update({"SE_deltaH_true_minus_pred_sampling": dse, "rounding_true_minus_pred": dpred})
    if "lr_floor_true_minus_pred" in own and own["rounding_true_minus_pred"] > 0:
        tol["lr_floor_true_minus_pred"] = own["lr_floor_true_minus_pred"] * 0.5 * (
            dse / own["SE_deltaH_true_minus_pred_sampling"] + dpred / own["rounding_true_minus_pred"])
    for k in parts:
        tol[f"deltaH_pred_{k}"], tol[f"SE_deltaH_pred_{k}"] = float(tE[k].mean()), se_tol(tE[k])
    # the attribution: each parameter tensor's part of deltaH_pred, bounded by the whole's
    tol.update({k: dpred for k in own if k.startswith("attr_pred/")})
    return tol


def assert_same_results(shared: dict, own: dict, tol: dict | None = None) -> None:
    """Every number within ``tol[key]`` (``share_tolerances``; a key not in it, or ``tol`` None:
    equal); lr-free keys and the ground truth's exactly."""
    a, b = numeric(shared), numeric(own)
    assert set(a) == set(b)
    for k in b:
        if math.isnan(b[k]):
            assert math.isnan(a[k]), k
            continue
        if k == "z_true_minus_pred":  # the ratio of two checked numbers
            continue
        assert abs(a[k] - b[k]) <= (tol or {}).get(k, 0.0), (k, a[k], b[k], (tol or {}).get(k, 0.0))
    for k in (*LR_FREE, "deltaH_true", "SE_deltaH_true", "ESS_frac", "deltaH1_step", "H_upd"):
        assert a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])), (k, a[k], b[k])
    for k in ("flags", "projection", "pred/step_model", "pred/dominant_part"):
        assert shared.get(k) == own.get(k), k


# ---------------------------------------------------------------- exact fp64 model
# stored: per-unit gradients (lr-free) dotted with fp64 directions: the jobs differ by fp64
# rounding. jvp: the tangents (lr times a direction) pass the model's fp32 eager-attention
# softmax, so a job's own projections are linear in lr only to fp32 rounding.
@pytest.mark.parametrize("projection,dtype", [("stored", torch.float64), ("jvp", torch.float32)])
def test_reused_stage12_equals_the_jobs_own_on_the_exact_model(projection, dtype, tmp_path):
    o = make_oracle("sequence", 3)
    gen = torch.Generator().manual_seed(11)
    E, U = batch_of(o, o.draw(1, 6, gen)[0]), batch_of(o, o.draw(1, 5, gen)[0])
    share = Stage12Share(tmp_path / "entry", {"test": projection}, timeout_s=10)
    pcfg = ProbeConfig(projection=ProjectionMode(projection), top_k_params=0)
    icfg = ImportanceConfig(split_step=False, resample_on_low_ess=False)

    def job(lr: float, with_share: Stage12Share | None, cfg=pcfg) -> dict:
        for g in o.opt.param_groups:
            g["lr"] = lr
        try:
            return run_two_batch(o.setup.ctx("sequence", mb_size=2), E, U, Geometry(o.opt, lr, None), cfg, icfg,
                                 tmp_path / f"run_{lr:g}_{with_share is not None}_{cfg.projection.value}",
                                 share=with_share)
        finally:
            for g in o.opt.param_groups:
                g["lr"] = 1e-2

    first = job(1e-3, share)
    assert first["reused_stage12"] is False and (share.folder / ENTRY).is_file()
    assert_same_results(first, job(1e-3, None))  # the writer's numbers are a plain job's
    with recording_units() as rec:  # the per-unit magnitudes at lr 1e-3, from the per-unit backward
        job(1e-3, None, dataclasses.replace(pcfg, projection=ProjectionMode.backward))
    mags = rec.split(E.B)
    for lr in (3e-3, 1e-4):
        reused = job(lr, share)
        assert reused["reused_stage12"] is True and reused["stage12_share"] == "reused from lr=0.001"
        own = job(lr, None)
        assert own["deltaH_pred"] != first["deltaH_pred"] and own["deltaH_true"] != first["deltaH_true"]
        assert_same_results(reused, own, share_tolerances(own, mags, lr / 1e-3, dtype))


# ---------------------------------------------------------------- built-in default through run()
QUICK = ("batch.B_E=4", "batch.B_U=4", "batch.seed_U=7")
# the per-unit backward: its passes record the per-unit magnitudes the tolerances come from
BACKWARD = ("probe.projection=backward",)


@pytest.mark.numerics
def test_lr_sweep_shares_stage12_and_matches_independent_jobs(tmp_path):
    cache = tmp_path / "batch_cache" / "k"

    def job(name: str, *overrides: str) -> dict:
        return run(compose_cfg(tmp_path / name, *QUICK, *BACKWARD, *overrides), batch_cache=cache)

    with recording_units() as rec:
        first = job("a", "optimizer.lr=1e-3")
    mags = rec.split(first["B_E"])
    assert first["reused_stage12"] is False and first["batch_source"] == "sampled"
    assert "time/accumulate_X_E_s" in first
    (entry,) = [p for p in (cache / SUBDIR).iterdir() if p.is_dir()]
    reused = {lr: job(f"s{lr}", f"optimizer.lr={lr}") for lr in ("1e-2", "1e-4")}
    own = {lr: job(f"o{lr}", f"optimizer.lr={lr}", "batch.share_across_lr=false") for lr in ("1e-2", "1e-4")}
    for lr in reused:
        assert reused[lr]["reused_stage12"] is True and "time/accumulate_X_E_s" not in reused[lr]
        assert own[lr]["reused_stage12"] is False and own[lr]["stage12_share"] == "off: batch.share_across_lr=false"
        assert reused[lr]["deltaH_true"] != first["deltaH_true"]
        # fp32: a job's own dots of its fp32 update parts carry their rounding (measured 5.8e-5 of
        # deltaH_pred_weight_decay, whose terms cancel to 1/455 of their magnitude); the shared
        # job's are the first job's, rescaled
        assert_same_results(reused[lr], own[lr], share_tolerances(own[lr], mags, float(lr) / 1e-3, torch.float32))
    # the same batches loaded from a folder (batch.load, as benchmarks/lr_sweep.py does): shared too
    assert job("l", "optimizer.lr=3e-3", f"batch.load='{cache}'")["reused_stage12"] is True
    assert len([p for p in (cache / SUBDIR).iterdir() if p.is_dir()]) == 1

    # a job that differs in anything but the lr computes (and stores) its own
    other = job("w", "optimizer.lr=1e-2", "probe.weighting_mode=sequence")
    assert other["reused_stage12"] is False and other["stage12_share"].startswith("computed here")
    assert len([p for p in (cache / SUBDIR).iterdir() if p.is_dir()]) == 2

    # corrupt: a flipped byte in Xbar / Ybar is found by its checksum, recomputed and rewritten
    buf = entry / BUFFERS
    data = bytearray(buf.read_bytes())
    data[len(data) // 2] ^= 0xFF
    buf.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="corrupt: buffers.pt does not match its checksum"):
        again = job("c", "optimizer.lr=1e-2")
    assert again["reused_stage12"] is False
    assert_same_results(again, own["1e-2"])
    assert job("c2", "optimizer.lr=1e-2")["reused_stage12"] is True  # rewritten whole

    # stale: an entry written for another configuration in this folder is not read
    meta = json.loads((entry / ENTRY).read_text())
    meta["key"]["config"]["probe"]["top_units"] += 1
    (entry / ENTRY).write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match=r"stale: written for another configuration \(differs in \['config'\]\)"):
        assert job("t", "optimizer.lr=1e-4")["reused_stage12"] is False


def test_sharing_is_refused_where_a_rescaling_is_not_exact(tmp_path, monkeypatch):
    cfg = to_typed(compose_cfg(tmp_path))
    p = torch.nn.Parameter(torch.zeros(3))
    adamw = Geometry(torch.optim.AdamW([p], lr=1e-3), 1e-3, None)
    cache = tmp_path / "cache"
    assert why_not_shared(cfg, cache, adamw, cfg.importance) is None
    assert why_not_shared(cfg, None, adamw, cfg.importance).startswith("not a sweep")
    off = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, share_across_lr=False))
    assert why_not_shared(off, cache, adamw, cfg.importance) == "batch.share_across_lr=false"
    # clipping scales the gradient by a factor free of the lr: AdamW's clipped step is linear in it
    clip = dataclasses.replace(cfg.importance, max_grad_norm=1.0)
    assert why_not_shared(cfg, cache, adamw, clip) is None
    rms = Geometry(torch.optim.RMSprop([p], lr=1e-3), 1e-3, None)
    assert why_not_shared(cfg, cache, rms, cfg.importance) == (
        "the update is the optimizer's own step (RMSprop): linear in lr only up to rounding")
    two = Geometry(torch.optim.AdamW([{"params": [p], "lr": 1e-4}], lr=1e-3), 1e-3, None)
    assert why_not_shared(cfg, cache, two, cfg.importance) == "param groups with different lrs"
    monkeypatch.setattr(D, "world", lambda: 2)
    assert why_not_shared(cfg, cache, adamw, cfg.importance) == "2 processes (sharing is single-process only)"


def test_a_plain_run_says_why_it_shared_nothing(tmp_path):
    res = run(compose_cfg(tmp_path, *QUICK, "importance.enabled=false"))
    assert res["reused_stage12"] is False
    assert res["stage12_share"].startswith("off: not a sweep")
    assert json.loads((Path(tmp_path) / "results.json").read_text())["reused_stage12"] is False


def test_a_sharded_optimizer_state_folder_enters_the_key_by_its_files(tmp_path):
    """A sharded trainer's optimizer state is a folder: its digest covers every file under it."""
    from entprobe.rollouts.saved_batches import file_digest

    (tmp_path / "optimizer_0").mkdir()
    (tmp_path / "optimizer_0" / "rank0.pt").write_bytes(b"a" * 100)
    (tmp_path / "optimizer_0" / "rank1.pt").write_bytes(b"b" * 100)
    before = file_digest(tmp_path)
    (tmp_path / "optimizer_0" / "rank1.pt").write_bytes(b"c" * 100)
    assert file_digest(tmp_path) != before
    assert file_digest(tmp_path / "optimizer_0" / "rank0.pt") != file_digest(tmp_path / "optimizer_0" / "rank1.pt")


def test_the_optimizer_scheduler_and_trainer_state_enter_the_key_by_their_whole_contents(tmp_path, monkeypatch):
    """A byte changed between the chunks the old digest sampled, or another scheduler.pt beside
    optimizer.pt, is another key (a stale entry would be reused otherwise)."""
    from entprobe.pipeline.lr_share import state_files_digest

    monkeypatch.setenv("ENTPROBE_DIGEST_CACHE", "")
    opt = tmp_path / "optimizer.pt"
    opt.write_bytes(bytes(3_000_000))
    (tmp_path / "scheduler.pt").write_bytes(b"s1")
    before = state_files_digest(opt)
    assert set(before) == {"optimizer.pt", "scheduler.pt"} and state_files_digest(None) is None
    with open(opt, "r+b") as f:
        f.seek(1_500_000 + 12_345)
        f.write(b"\x01")
    moved = state_files_digest(opt)
    assert moved["optimizer.pt"] != before["optimizer.pt"]
    (tmp_path / "scheduler.pt").write_bytes(b"s2")
    (tmp_path / "trainer_state.json").write_text("{}")
    again = state_files_digest(opt)
    assert again["scheduler.pt"] != moved["scheduler.pt"] and "trainer_state.json" in again
