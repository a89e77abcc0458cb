"""FSDP2 on CPU (gloo): ``ddp.strategy=fsdp2`` on two ranks gives the one-process numbers.

The model, the optimizer state and the probe's parameter-sized buffers are sharded; the run reads
committed batches (tests/data/batches/fsdp, read by both sides) with uneven shards (E 3+2 prompts, U 2+1: a rank runs filler
passes), the per-unit ``backward`` projection (units taken in turn over the ranks) and the real
sharded AdamW step, restored bit-exactly per shard. Gradient clipping and activation
checkpointing are checked sharded too (one more 2-rank run with both).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from conftest import committed_batches, compose_cfg, fp32_dot_tol, fp_tol, recording_units, rel_diff
from ddp_launch import launch
from two_batch_bounds import assert_unit_values_agree, bounds, per_unit, unit_bounds
from entprobe.config import ConfigError
from entprobe.cli.probe_job import run, to_typed

SMALL = ("batch.B_E=5", "batch.B_U=3", "batch.G=4", "batch.seed_U=7", "probe.projection=backward",
         "importance.resample_on_low_ess=false")
# The batches both sides read: committed (tests/data/batches/fsdp, sampled by the committed default
# model with SMALL), so the gradient norm the clipping test needs and the conditioning of the dot
# products compared below are the same on every machine. Regenerate: python -m entprobe.main
#   batch.B_E=5 batch.B_U=3 batch.G=4 batch.seed_U=7 model=hf model.path=tests/data/default_model
#   batch.save=tests/data/batches/fsdp
SAVED = committed_batches("fsdp")
FSDP = ("ddp.strategy=fsdp2", "ddp.timeout_s=120")


def sharded_bounds(one: dict, mags, run_one: Path, run_r0: Path) -> dict:
    """Absolute bounds on the 2-rank numbers against the one-process run's (``one``; its per-unit
    magnitudes ``mags``, ``recording_units``), after checking the per-unit projections themselves
    (two_batch_bounds.py: sharded, each is the same sum over the N parameters in two shards, its
    unit's gradient and its direction rounded on another path). A shard counted twice or lost moves
    any of them by O(1) of itself."""
    assert_unit_values_agree(per_unit(run_r0), per_unit(run_one), unit_bounds(one, mags), "rank 0")
    return bounds(one, mags)


def _instrumented(seen: dict):
    """Record in ``seen`` every ``clip_grad_norm_``'s total norm (``clip_norms``, the whole
    gradient's: a DTensor norm is read whole) and the gradient-enabled calls of the model and of
    its first decoder layer's MLP (``model_calls``, ``mlp_calls``: a checkpointed layer runs again
    in the backward). Returns a function that undoes the patches."""
    from entprobe.cli import probe_job as main
    from entprobe.runtime import sharding

    real_clip, real_load = torch.nn.utils.clip_grad_norm_, main.load_model
    seen.update(clip_norms=[], model_calls=0, mlp_calls=0)

    def clip(params, max_norm, *a, **k):
        n = real_clip(params, max_norm, *a, **k)
        seen["clip_norms"].append(float(n.full_tensor() if sharding.is_dtensor(n) else n))
        return n

    def load(cfg, check_tokenizer=None):
        lm = real_load(cfg, check_tokenizer)
        mlp = next(m for n, m in lm.model.named_modules() if n.endswith("layers.0.mlp"))

        def count(key):
            def hook(*_):
                seen[key] += torch.is_grad_enabled()
            return hook
        lm.model.register_forward_pre_hook(count("model_calls"))
        mlp.register_forward_pre_hook(count("mlp_calls"))
        return lm

    torch.nn.utils.clip_grad_norm_, main.load_model = clip, load

    def undo():
        torch.nn.utils.clip_grad_norm_, main.load_model = real_clip, real_load
    return undo


def _worker(rank: int, world: int, port: int, out: str, extra: tuple = ()) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from entprobe.runtime import distributed as D
    from entprobe.runtime import sharding
    from entprobe.pipeline.stages import ground_truth, snapshot

    out = Path(out)
    seen = {}
    real_restore = ground_truth.restore

    def checked_restore(params, optimizer, snap):  # the restore is bit-exact on every shard
        real_restore(params, optimizer, snap)
        seen["restored"] = all(torch.equal(sharding.local(p.detach()), s) for p, s in zip(params, snap.params))
        seen["sharded"] = all(sharding.is_dtensor(p) for p in params) and sharding.sharded()
        seen["state_sharded"] = all(sharding.is_dtensor(optimizer.state[p]["exp_avg"]) for p in params)
        seen["fingerprint"] = sum(float(t.double().sum()) for t in snapshot.state_fingerprint(params, optimizer))

    ground_truth.restore = checked_restore
    undo = _instrumented(seen)
    try:
        res = run(compose_cfg(out / f"run_rank{rank}", *SMALL, *FSDP, *SAVED, *extra))
    finally:
        ground_truth.restore = real_restore
        undo()
    res.update({f"check/{k}": v for k, v in seen.items()})
    (out / f"rank{rank}.json").write_text(json.dumps({k: v for k, v in res.items()
                                                      if isinstance(v, (int, float, str, bool, list))}))
    D.shutdown()


def test_fsdp2_two_ranks_equal_one_process(tmp_path):
    with recording_units() as rec:
        one = run(compose_cfg(tmp_path / "one", *SMALL, *SAVED))
    launch(_worker, 2, str(tmp_path), timeout_s=240)
    tol = sharded_bounds(one, rec.split(one["B_E"]), tmp_path / "one", tmp_path / "run_rank0")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == 2 and r0["B_E"] == 5 and r0["B_U"] == 3 and r0["projection"] == "backward"
    assert r0["check/sharded"] and r0["check/state_sharded"] and r0["check/restored"] and r1["check/restored"]
    for k in ("deltaH1", "SE_deltaH1", "deltaH_pred", "SE_deltaH_pred", "deltaH_true", "H_orig"):
        assert r0[k] == r1[k], k  # every rank the same numbers
    for k in ("deltaH1", "SE_deltaH1"):
        assert math.isfinite(one[k]) and one[k] != 0.0, k
    assert rel_diff(r0["deltaH1"], one["deltaH1"]) < fp32_dot_tol(one), (r0["deltaH1"], one["deltaH1"], fp32_dot_tol(one))
    # the per-unit projections, their SEs, the prediction and the measured change: sharded_bounds
    for k in ("SE_deltaH1", "deltaH_pred", "SE_deltaH_pred", "deltaH_true"):
        assert abs(r0[k] - one[k]) <= tol[k], (k, r0[k], one[k], tol[k])
    passes = [{k: v for k, v in r.items() if k.startswith("passes/")} for r in (one, r0)]
    assert passes[0] == passes[1]  # the filler passes and the other ranks' units are not counted


CLIP_AC = ("importance.max_grad_norm=2.0", "model.activation_checkpointing=true")


@pytest.mark.numerics
def test_fsdp2_clipping_and_activation_checkpointing_equal_one_process(tmp_path):
    """Gradient clipping (the norm of the whole gradient, over every rank's shards, in the
    prediction's closed form and in the real step) and activation checkpointing (layers
    recomputed in the backward, inside FSDP2's all-gathers) give the one-process numbers. The
    clipping binds (max_grad_norm 2.0 against a norm of 8.6 on the committed batches: a quarter of
    the gradient is kept), so a norm taken per shard (each smaller than the whole) would keep more
    of it and move the step."""
    seen = {}
    undo = _instrumented(seen)
    try:
        with recording_units() as rec:
            one = run(compose_cfg(tmp_path / "one", *SMALL, *CLIP_AC, *SAVED))
    finally:
        undo()
    free = run(compose_cfg(tmp_path / "free", *SMALL, *SAVED))
    launch(_worker, 2, str(tmp_path), CLIP_AC, timeout_s=240)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == 2 and r0["check/sharded"] and r0["check/restored"] and r1["check/restored"]
    tol = sharded_bounds(one, rec.split(one["B_E"]), tmp_path / "one", tmp_path / "run_rank0")
    # clipping: the prediction in closed form at the clipped gradient (its norm the whole
    # gradient's: pv.norm over every rank's shards), the ground truth's clip_grad_norm_ once, by the
    # global norm, which binds. Each norm sums N squares (no cancellation) in fp32 per tensor:
    # fp_tol of the norm over N terms apart
    assert len(seen["clip_norms"]) == len(r0["check/clip_norms"]) == 1
    norm = seen["clip_norms"][0]
    assert norm > 1.5 * 2.0  # at most 2/3 of the gradient kept
    for n in (r0["check/clip_norms"][0], one["pred/grad_norm"], r0["pred/grad_norm"]):
        assert abs(n - norm) <= fp_tol(torch.float32, norm, 76352), (n, norm)
    assert one["pred/step_model"] == r0["pred/step_model"] == "adamw_closed_form"
    s = 2.0 / (one["pred/grad_norm"] + 1e-6)  # clip_grad_norm_'s factor, two fp64 roundings
    assert abs(one["pred/grad_clip_factor"] - s) <= fp_tol(torch.float64, s, 2, worst_case=True)
    # the clipped step is not the free one: predicted, and read off the step the ground truth took
    # (deltaH_true itself is dominated here by the momentum part, which clipping leaves alone)
    for k in ("deltaH_pred", "deltaH1_step"):
        assert rel_diff(one[k], free[k]) > 1e-2, (k, one[k], free[k])
    # checkpointing: the first layer ran again in the backward, on one process and sharded
    sharded = {k: r0[f"check/{k}"] for k in ("model_calls", "mlp_calls")}
    for calls in (seen, sharded):
        assert calls["mlp_calls"] > calls["model_calls"] > 0, calls
    for k in ("deltaH1", "SE_deltaH1", "deltaH_pred", "SE_deltaH_pred", "deltaH_true", "H_orig"):
        assert r0[k] == r1[k], k  # every rank the same numbers
    assert rel_diff(r0["deltaH1"], one["deltaH1"]) < fp32_dot_tol(one), (r0["deltaH1"], one["deltaH1"], fp32_dot_tol(one))
    # as above; the clip norm's rounding moves the clipped gradient by eps sqrt(N) of itself, within
    # the per-unit bounds of the update's parts (a per-shard norm keeps O(1e-2) more of it)
    for k in ("SE_deltaH1", "deltaH_pred", "SE_deltaH_pred", "deltaH_true"):
        assert abs(r0[k] - one[k]) <= tol[k], (k, r0[k], one[k], tol[k])


@pytest.mark.parametrize("override, key", [
    ("probe.mode=single_batch", "probe.mode"), ("probe.projection=stored", "probe.projection"),
    ("probe.projection=jvp", "probe.projection"), ("probe.save_buffers=true", "probe.save_buffers"),
    ("importance.resample_on_low_ess=true", "importance.resample_on_low_ess"),
])
def test_fsdp2_refuses_what_it_does_not_shard(tmp_path, override, key):
    cfg = compose_cfg(tmp_path, *SMALL, *FSDP, "batch.load=/x", override)
    with pytest.raises(ConfigError, match=key):
        to_typed(cfg)


def test_fsdp2_turns_off_a_default_it_cannot_run_and_refuses_it_when_asked(tmp_path, capsys):
    """importance.resample_on_low_ess is on by default: under fsdp2 the job turns it off with one
    note (no batch.load needed: fsdp2 samples); set by the user, it is refused."""
    typed = to_typed(compose_cfg(tmp_path, *FSDP), explicit=list(FSDP))
    assert typed.importance.resample_on_low_ess is False
    assert capsys.readouterr().out.count("entprobe: note: ddp.strategy=fsdp2 sets importance.resample_on_low_ess=false") == 1
    asked = (*FSDP, "importance.resample_on_low_ess=true")
    with pytest.raises(ConfigError, match="importance.resample_on_low_ess"):
        to_typed(compose_cfg(tmp_path, *asked), explicit=list(asked))
    plain = to_typed(compose_cfg(tmp_path), explicit=[])  # ddp: nothing turned off
    assert plain.importance.resample_on_low_ess is True and "note" not in capsys.readouterr().out


def _recording_batches(seen: dict):
    """Patch the job's ``get_batches`` to keep the global E and U it returns in ``seen``; returns the undo."""
    from entprobe.cli import probe_job

    real = probe_job.get_batches

    def recording(*a, **k):
        E, U, source = real(*a, **k)
        seen.update(source=source, E_ids=E.input_ids.tolist(), U_ids=U.input_ids.tolist(), U_adv=U.advantages.tolist())
        return E, U, source
    probe_job.get_batches = recording
    return lambda: setattr(probe_job, "get_batches", real)


def _sampling_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank of a 2-rank fsdp2 run that samples its batches (no batch.load), its config made as
    the job makes it (the user's overrides explicit)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from entprobe.runtime import distributed as D

    out, seen = Path(out), {}
    given = [*SAMPLED, *FSDP]
    undo = _recording_batches(seen)
    try:
        res = run(to_typed(compose_cfg(out / f"run_rank{rank}", *given), explicit=given))
    finally:
        undo()
    keep = {k: v for k, v in res.items() if isinstance(v, (int, float, str, bool))}
    (out / f"sampled{rank}.json").write_text(json.dumps({**keep, **seen}))
    D.shutdown()


SAMPLED = ("batch.B_E=3", "batch.B_U=3", "batch.G=4", "sampling.max_new_tokens=6")


def test_fsdp2_samples_the_one_process_batches_on_the_default_config(tmp_path):
    """No batch.load and the default importance settings: two fsdp2 ranks sample in step (every
    forward all-gathers; uneven shards of 3 prompts), hold the batches a one-process run with the
    same seeds draws, and give its numbers."""
    seen = {}
    undo = _recording_batches(seen)
    try:
        with recording_units() as rec:  # the per-unit backward, as fsdp2 projects: its magnitudes
            one = run(compose_cfg(tmp_path / "one", *SAMPLED, "importance.resample_on_low_ess=false",
                                  "probe.projection=backward"))
    finally:
        undo()
    launch(_sampling_worker, 2, str(tmp_path), timeout_s=240)
    r0, r1 = (json.loads((tmp_path / f"sampled{r}.json").read_text()) for r in (0, 1))
    assert r0["source"] == r1["source"] == "sampled" and r0["world_size"] == 2
    for r in (r0, r1):
        assert seen["source"] == "sampled"
        assert r["E_ids"] == seen["E_ids"] and r["U_ids"] == seen["U_ids"] and r["U_adv"] == seen["U_adv"]
    for k in ("deltaH1", "deltaH_pred", "deltaH_true", "H_orig"):
        assert r0[k] == r1[k], k
    assert rel_diff(r0["deltaH1"], one["deltaH1"]) < fp32_dot_tol(one), (r0["deltaH1"], one["deltaH1"])
    tol = sharded_bounds(one, rec.split(one["B_E"]), tmp_path / "one", tmp_path / "run_rank0")
    assert abs(r0["deltaH_true"] - one["deltaH_true"]) <= tol["deltaH_true"], (r0["deltaH_true"], one["deltaH_true"])
