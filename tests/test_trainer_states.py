"""Sharded optimizer states from real trainers read back, in one process, to the plain state of the
same run: torch.distributed.checkpoint and accelerate (written by torch and accelerate on 4 gloo CPU
ranks, tests/sharded_writers.py), verl FSDP2 (its save code transcribed there: verl does not
import here) and DeepSpeed ZeRO-1/2/3 (written by deepspeed 0.19.8 on 4 CPU ranks and kept in
tests/data/deepspeed: DeepSpeed is no dependency; tests/write_deepspeed_states.py writes them).
Then bad inputs: a missing rank file, files of two world sizes, a parameter without state, a
foreign object in a file, and model.path at a trainer folder without HF weights."""
from __future__ import annotations

import json
import math
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import compose_cfg
from ddp_launch import launch_fresh
from entprobe.config import ConfigError
from entprobe.cli.probe_job import run
from entprobe.checkpoints.optim_state import OptimizerStateError, load_optimizer, read_optimizer_state

HERE = Path(__file__).resolve().parent
DS = HERE / "data" / "deepspeed"
LR_NEXT = 7e-4  # the LambdaLR's lr for step 4 (sharded_writers.lr_at)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    launch_fresh("sharded_writers", "write_checkpoints", 4, str(out), timeout_s=400)
    return out


def reference_model(written: Path):
    return AutoModelForCausalLM.from_pretrained(written / "reference")


def assert_same_state(model, got, want, rtol: float = 0.0) -> None:
    """Per parameter: the same moments (to ``rtol`` of the tensor's largest entry) and step, and
    the same weight decay for it."""
    decay = [{id(p): g["weight_decay"] for g in lo.optimizer.param_groups for p in g["params"]} for lo in (got, want)]
    for name, p in model.named_parameters():
        assert decay[0][id(p)] == decay[1][id(p)], name
        a, b = got.optimizer.state[p], want.optimizer.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            assert float((a[k] - b[k]).abs().max()) <= rtol * float(b[k].abs().max()), (name, k)
        assert float(a["step"]) == float(b["step"]), name


@pytest.mark.parametrize("fmt", ["dcp", "accelerate"])
def test_dcp_and_accelerate_fsdp_read_back_to_the_plain_state(written, fmt):
    """4 ranks wrote it; one process reads every moment back bit for bit, the decay / no-decay
    groups by name, and the next lr from accelerate's scheduler.bin (DCP alone: the param groups')."""
    model = reference_model(written)
    want = load_optimizer(model, str(written / "reference"))
    got = load_optimizer(model, str(written / fmt))
    assert_same_state(model, got, want)
    assert (got.lr, want.lr) == (LR_NEXT, LR_NEXT) and got.step == want.step == 3
    assert got.lr_source.endswith("scheduler.bin" if fmt == "accelerate" else "param groups (torch.distributed.checkpoint)")
    assert got.path == str(written / fmt / ("optimizer_0" if fmt == "accelerate" else ""))


def test_verl_fsdp2_reads_back_and_probes_like_its_plain_state(written, tmp_path):
    """verl's per-rank DTensor shards, named through the model file, equal the run's full state; a
    probe of verl's huggingface/ weights with the sharded state equals one with the plain state."""
    actor = written / "verl" / "global_step_3" / "actor"
    hf = actor / "huggingface"
    model = AutoModelForCausalLM.from_pretrained(hf)
    want = load_optimizer(model, str(written / "verl" / "reference_optimizer.pt"), lr=LR_NEXT)
    for where in (actor, actor.parent):  # the actor folder, or global_step_N above it
        got = load_optimizer(model, str(where))
        assert_same_state(model, got, want)
        assert got.lr == LR_NEXT and got.lr_source == str(actor / "extra_state_world_size_4_rank_0.pt")
    plain = tmp_path / "plain"
    shutil.copytree(hf, plain)
    shutil.copy(written / "verl" / "reference_optimizer.pt", plain / "optimizer.pt")
    common = ("model=hf", "batch.B_E=2", "batch.B_U=2", "sampling.max_new_tokens=6", f"optimizer.lr={LR_NEXT}")
    res = run(compose_cfg(tmp_path / "sharded", *common, f"model.path='{hf}'", f"optimizer.state_path='{actor}'"))
    ref = run(compose_cfg(tmp_path / "ref", *common, f"model.path='{plain}'", f"optimizer.state_path='{plain}'"))
    for k in ("deltaH1", "SE_deltaH1", "deltaH_pred", "deltaH_true"):
        assert math.isfinite(res[k]) and res[k] == ref[k], k
    assert res["adam_step"] == 3 and res["optimizer_path"] == str(actor)
    assert (res["optimizer_format"], ref["optimizer_format"]) == ("verl FSDP2 checkpoint, world size 4", "optimizer.pt")


def _ds_model():
    sys.path.insert(0, str(HERE))
    from write_deepspeed_states import tiny_model

    return tiny_model()


@pytest.mark.parametrize("folder", ["zero1", "zero2", "zero3", "zero2_universal"])
def test_deepspeed_zero_reads_back_to_the_same_steps_in_plain_torch(folder):
    """ZeRO-N on 4 ranks (and DeepSpeed's universal conversion of ZeRO-2) against the same 3 steps by
    torch's AdamW in one process (the gradients agree to rounding, so the moments to ~1e-6), with
    DeepSpeed's own groups and hyperparameters."""
    model = _ds_model()
    want = load_optimizer(model, str(DS / "reference_optimizer.pt"), lr=1e-2)
    got = load_optimizer(model, str(DS / folder))  # the folder with `latest` / `latest_universal`
    assert_same_state(model, got, want, rtol=1e-5)
    step = "global_step3_universal" if folder.endswith("universal") else "global_step3"
    assert got.lr == 1e-2 and got.step == 3 and got.path == str(DS / folder / step)
    if folder.endswith("universal"):  # the same numbers as the partitions it was converted from
        zero2 = load_optimizer(model, str(DS / "zero2"))
        assert_same_state(model, got, zero2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_partition_layout_is_deepspeeds_own_consolidation(stage):
    """The same un-partitioning applied to the fp32 master weights gives exactly what DeepSpeed's
    zero_to_fp32 consolidated (fp32.pt), every parameter; without DeepSpeed installed."""
    from entprobe.runtime.input_files import load_torch_file
    from entprobe.checkpoints.trainer_states import deepspeed as ds

    folder = DS / f"zero{stage}" / "global_step3"
    files = ds.rank_files(folder)
    optims = [load_torch_file(f, "", "", allow=ds.SAFE)["optimizer_state_dict"] for f in files]
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    shapes = [[(n, tuple(s)) for n, s in g.items()]
              for g in torch.load(folder / model_file, weights_only=True)["param_shapes"]]
    want = torch.load(DS / f"zero{stage}" / "fp32.pt", weights_only=True)
    got = {}
    if stage == 3:
        flats = [torch.cat([t.reshape(-1) for t in o["fp32_flat_groups"]]) for o in optims]
        got = ds.un_partition(flats, [s for g in shapes for s in g], 3, "fp32")
    else:
        for gi, g in enumerate(shapes):  # saved without the rank's padding
            got |= ds.un_partition([o["single_partition_of_fp32_groups"][gi] for o in optims], g, stage, "fp32")
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    assert "deepspeed" not in sys.modules  # the stand-ins, not DeepSpeed's classes, were built


# ---------------------------------------------------------------- bad inputs


def test_missing_rank_files_are_named(written, tmp_path):
    actor = shutil.copytree(written / "verl" / "global_step_3" / "actor", tmp_path / "actor")
    (actor / "optim_world_size_4_rank_2.pt").unlink()
    with pytest.raises(OptimizerStateError, match=r"optim_world_size_4_rank_2\.pt is missing \(1 of 4 ranks"):
        read_optimizer_state(str(actor))
    shutil.copy(written / "verl" / "global_step_3" / "actor" / "optim_world_size_4_rank_2.pt", actor)
    (actor / "model_world_size_4_rank_0.pt").unlink()
    with pytest.raises(OptimizerStateError, match=r"model_world_size_4_rank_0\.pt is missing: its parameter names"):
        read_optimizer_state(str(actor))
    ds = shutil.copytree(DS / "zero2", tmp_path / "zero2")
    (ds / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(OptimizerStateError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt is missing"):
        read_optimizer_state(str(ds))
    dcp = shutil.copytree(written / "dcp", tmp_path / "dcp")
    (dcp / "__3_0.distcp").unlink()
    with pytest.raises(OptimizerStateError, match=r"__3_0\.distcp: missing .*copy every rank's file"):
        read_optimizer_state(str(dcp))


def test_files_of_two_world_sizes_are_refused(written, tmp_path):
    actor = shutil.copytree(written / "verl" / "global_step_3" / "actor", tmp_path / "actor")
    shutil.copy(actor / "optim_world_size_4_rank_0.pt", actor / "optim_world_size_2_rank_0.pt")
    with pytest.raises(OptimizerStateError, match=r"optimizer files of world sizes \[2, 4\]"):
        read_optimizer_state(str(actor))
    (actor / "optim_world_size_2_rank_0.pt").unlink()
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 8}))
    with pytest.raises(OptimizerStateError, match=r"records world_size 8 but the optimizer files are optim_world_size_4"):
        read_optimizer_state(str(actor))
    ds = shutil.copytree(DS / "zero3", tmp_path / "zero3")  # the last rank gone: 3 files of a 4-way partition
    (ds / "global_step3" / "zero_pp_rank_3_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(OptimizerStateError, match=r"partitioned over 4 ranks, but 3 rank files"):
        read_optimizer_state(str(ds))


def test_a_parameter_without_state_or_of_another_shape_is_named(written):
    """The state meets the model by name: a model with a third layer names the first parameter the
    checkpoint has no state for; a wider model names the first shape that differs."""
    from entprobe.checkpoints.builtin import build_char_tokenizer, build_tiny_llama

    vocab = len(build_char_tokenizer())
    with pytest.raises(OptimizerStateError, match=r"no Adam state for parameter 'model\.layers\.2\.self_attn\.q_proj"
                                                  r"\.weight' \(9 of the model's 30"):
        load_optimizer(build_tiny_llama(vocab, layers=3), str(written / "dcp"))
    with pytest.raises(OptimizerStateError, match=r"state shape mismatch at parameter 'model\.embed_tokens\.weight': "
                                                  r"checkpoint \(18, 64\) vs model \(18, 32\)"):
        load_optimizer(build_tiny_llama(vocab, hidden=32), str(written / "verl" / "global_step_3"))
    stored = read_optimizer_state(str(DS / "zero2"))
    stored.named.groups[1].names.append("lm_head.weight")  # a parameter in two groups: whose lr / decay?
    with pytest.raises(OptimizerStateError, match=r"'lm_head\.weight' is in 2 param groups \(one expected\)"):
        load_optimizer(_ds_model(), stored)
    with pytest.raises(OptimizerStateError, match=r"ZeRO-1 .*mismatch at parameter 'model\.embed_tokens\.weight': "
                                                  r"checkpoint \(18, 6\) vs model \(18, 64\)"):
        load_optimizer(reference_model(written), str(DS / "zero1"))


def test_corrupt_moments_are_refused_before_the_model_loads(written, tmp_path):
    import torch.distributed.tensor  # noqa: F401

    actor = shutil.copytree(written / "verl" / "global_step_3" / "actor", tmp_path / "actor")
    f = actor / "optim_world_size_4_rank_1.pt"
    sd = torch.load(f, weights_only=True)
    sd["state"][3]["exp_avg_sq"].to_local()[0] = float("nan")
    torch.save(sd, f)
    with pytest.raises(OptimizerStateError, match=r"non-finite exp_avg_sq for parameter "
                                                  r"'model\.layers\.0\.self_attn\.v_proj\.weight'"):
        run(compose_cfg(tmp_path / "run", "model=hf", f"model.path='{actor / 'huggingface'}'",
                        f"optimizer.state_path='{actor}'"))


def _edit_rank_file(f: Path, fn) -> None:
    import torch.distributed.tensor  # noqa: F401  (DTensors load weights-only once it is imported)

    sd = torch.load(f, weights_only=True)
    fn(sd)
    torch.save(sd, f)


def _later_save(sd: dict) -> None:
    """What a later save of the same run leaves in a rank's file: step 9, other moments."""
    for st in sd["state"].values():
        st["step"] = torch.tensor(9.0)
        for k in ("exp_avg", "exp_avg_sq"):
            st[k].to_local().mul_(4)


def test_verl_rank_files_of_different_saves_are_refused(written, tmp_path):
    """A rank's file from a later save (another step), or whose shards have other shapes than rank
    0's, is named with the two values instead of being stitched into one state."""
    actor = shutil.copytree(written / "verl" / "global_step_3" / "actor", tmp_path / "actor")
    f = actor / "optim_world_size_4_rank_1.pt"
    _edit_rank_file(f, _later_save)
    with pytest.raises(OptimizerStateError, match=rf"{f}: Adam step 9 for parameter .* where "
                                                  r"optim_world_size_4_rank_0\.pt has 3: the rank files come from "
                                                  r"different saves"):
        read_optimizer_state(str(actor))
    shutil.copy(written / "verl" / "global_step_3" / "actor" / f.name, f)
    _edit_rank_file(f, lambda sd: sd["state"].update({0: sd["state"][1], 1: sd["state"][0]}))
    with pytest.raises(OptimizerStateError, match=rf"{f}: model\.embed_tokens\.weight exp_avg is a \(16, 64\) shard "
                                                  r"of \(64, 64\), where rank 0's file .* makes rank 1's share "
                                                  r"\(5, 64\) of \(18, 64\)"):
        read_optimizer_state(str(actor))


def _edit_ds_rank_file(f: Path, fn) -> None:
    """Edit a DeepSpeed optimizer file, saving it back without the stand-ins (records dropped, the
    ZeRO stage as a plain int) so that it still loads weights-only."""
    from entprobe.checkpoints.trainer_states.deepspeed import SAFE, _Record, _ZeroStage

    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items() if not isinstance(x, _Record)}
        if isinstance(v, (list, tuple)):
            return type(v)(plain(x) for x in v if not isinstance(x, _Record))
        return int(v) if isinstance(v, _ZeroStage) else v

    with torch.serialization.safe_globals(SAFE):
        sd = plain(torch.load(f, weights_only=True))
    fn(sd["optimizer_state_dict"])
    torch.save(sd, f)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_rank_files_of_different_saves_are_refused(tmp_path, stage):
    """A rank's partition file of another step, or of another partition size, is named with both
    values (it was cut into the parameters as if it were rank 0's save)."""
    ds = shutil.copytree(DS / f"zero{stage}", tmp_path / "ds")
    f = ds / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    base = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
    _edit_ds_rank_file(f, lambda o: o[base]["state"][0].update(step=torch.tensor(9.0)))
    with pytest.raises(OptimizerStateError, match=rf"{f}: Adam step \(flat group 0\) 9, where "
                                                  r"zero_pp_rank_0_mp_rank_00_optim_states\.pt has 3: the rank files"):
        read_optimizer_state(str(ds))
    shutil.copy(DS / f"zero{stage}" / "global_step3" / f.name, f)
    _edit_ds_rank_file(f, lambda o: o[base]["state"][0].update(exp_avg=o[base]["state"][0]["exp_avg"][:-3]))
    with pytest.raises(OptimizerStateError, match=rf"{f}: exp_avg partition size \(flat group 0\) \d+, where "
                                                  r"zero_pp_rank_0_mp_rank_00_optim_states\.pt has \d+"):
        read_optimizer_state(str(ds))


def test_folders_that_name_no_optimizer_state_say_what_to_do(written, tmp_path):
    """DeepSpeed's `latest` naming an empty folder, two accelerate optimizer_N folders, a broken
    verl fsdp_config.json: each named, with what to set."""
    from entprobe.runtime.input_files import InputFileError

    ds = tmp_path / "ds"
    (ds / "global_step7").mkdir(parents=True)
    (ds / "latest").write_text("global_step7")
    with pytest.raises(OptimizerStateError, match=rf"{ds / 'latest'} names 'global_step7', which holds no optimizer "
                                                  r"files .*optimizer\.state_path"):
        read_optimizer_state(str(ds))
    acc = shutil.copytree(written / "accelerate", tmp_path / "acc")
    shutil.copytree(acc / "optimizer_0", acc / "optimizer_1")
    with pytest.raises(OptimizerStateError, match=rf"{acc} holds 2 optimizer states \(optimizer_0, optimizer_1\): "
                                                  rf".*optimizer\.state_path={acc / 'optimizer_0'}"):
        read_optimizer_state(str(acc))
    actor = shutil.copytree(written / "verl" / "global_step_3" / "actor", tmp_path / "actor")
    (actor / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_')
    with pytest.raises(InputFileError, match=r"fsdp_config\.json:1:\d+: verl's FSDP config is not valid JSON"):
        read_optimizer_state(str(actor))


@pytest.mark.parametrize("defect", ["truncated", "random", "swapped", "metadata_truncated", "metadata_random"])
def test_damaged_dcp_files_are_named(written, tmp_path, defect):
    """Each damaged file of a torch.distributed.checkpoint folder is named, with no library text."""
    import os

    dcp = shutil.copytree(written / "dcp", tmp_path / "dcp")
    f = dcp / ("__1_0.distcp" if not defect.startswith("metadata") else ".metadata")
    data = f.read_bytes()
    if defect in ("truncated", "metadata_truncated"):
        f.write_bytes(data[:len(data) // 2])
    elif defect in ("random", "metadata_random"):
        f.write_bytes(os.urandom(len(data)))
    else:  # rank 1's and rank 2's files under each other's names
        f.write_bytes((dcp / "__2_0.distcp").read_bytes())
        (dcp / "__2_0.distcp").write_bytes(data)
    with pytest.raises(OptimizerStateError) as info:
        read_optimizer_state(str(dcp))
    msg = str(info.value)
    assert msg.startswith(f"{f}: ") and "copy" in msg and "Error" not in msg, msg


class Foreign:
    """An object of a class no allowlist names."""


def test_files_that_need_code_execution_are_refused_with_the_conversion(tmp_path):
    ds = shutil.copytree(DS / "zero2", tmp_path / "zero2")
    f = ds / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    from entprobe.checkpoints.trainer_states.deepspeed import SAFE

    with torch.serialization.safe_globals(SAFE):
        sd = torch.load(f, weights_only=True)
    sd["client_state"] = Foreign()
    torch.save(sd, f)
    with pytest.raises(OptimizerStateError, match=r"does not unpickle .*deepspeed\.checkpoint\.ds_to_universal "
                                                  r"--input_folder .*global_step3"):
        read_optimizer_state(str(ds))
    meta = tmp_path / "dcp" / ".metadata"
    meta.parent.mkdir()
    meta.write_bytes(pickle.dumps(Foreign()))
    with pytest.raises(OptimizerStateError, match=r"not a torch\.distributed\.checkpoint metadata file .*nothing from "
                                                  r"it was executed"):
        read_optimizer_state(str(meta.parent))


def test_model_path_at_a_trainer_folder_says_where_the_weights_are(written, tmp_path):
    actor = written / "verl" / "global_step_3" / "actor"
    with pytest.raises(ConfigError, match=rf"set model\.path={actor / 'huggingface'}"):
        run(compose_cfg(tmp_path / "a", "model=hf", f"model.path='{actor}'", f"optimizer.state_path='{actor}'"))
    bare = shutil.copytree(actor, tmp_path / "actor", ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ConfigError, match=r"no weights .*python -m verl\.model_merger merge --backend fsdp"):
        run(compose_cfg(tmp_path / "b", "model=hf", f"model.path='{bare / 'huggingface'}'"))
    with pytest.raises(ConfigError, match=r"accelerate merge-weights .*/pytorch_model_fsdp_0"):
        run(compose_cfg(tmp_path / "c", "model=hf", f"model.path='{written / 'accelerate'}'"))
    with pytest.raises(ConfigError, match=r"zero_to_fp32\.py"):
        run(compose_cfg(tmp_path / "d", "model=hf", f"model.path='{DS / 'zero3'}'"))


def _fsdp_worker(rank: int, world: int, port: int, out: str, hf: str, actor: str, saved: str) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from entprobe.runtime import distributed as D

    res = run(compose_cfg(Path(out) / f"fsdp_rank{rank}", *FSDP_PROBE, "ddp.strategy=fsdp2", "ddp.timeout_s=120",
                          f"model.path='{hf}'", f"optimizer.state_path='{actor}'", f"batch.load='{saved}'"))
    (Path(out) / f"fsdp_rank{rank}.json").write_text(json.dumps({k: v for k, v in res.items()
                                                                 if isinstance(v, (int, float, str, bool))}))
    D.shutdown()


FSDP_PROBE = ("model=hf", "batch.B_E=3", "batch.B_U=3", "sampling.max_new_tokens=6", f"optimizer.lr={LR_NEXT}",
              "probe.projection=backward", "importance.resample_on_low_ess=false")


def test_a_four_rank_verl_state_probed_on_two_fsdp2_ranks_equals_one_process(written, tmp_path):
    """Resharding on load: verl's state written by 4 ranks, read whole and sharded over 2 fsdp2
    ranks, gives the one-process numbers of the plain state on the same saved batches."""
    from ddp_launch import launch

    actor = written / "verl" / "global_step_3" / "actor"
    hf = actor / "huggingface"
    plain = tmp_path / "plain"
    shutil.copytree(hf, plain)
    shutil.copy(written / "verl" / "reference_optimizer.pt", plain / "optimizer.pt")
    saved = tmp_path / "saved"
    one = run(compose_cfg(tmp_path / "one", *FSDP_PROBE, f"model.path='{plain}'", f"optimizer.state_path='{plain}'",
                          f"batch.save='{saved}'"))
    launch(_fsdp_worker, 2, str(tmp_path), str(hf), str(actor), str(saved), timeout_s=240)
    r0, r1 = (json.loads((tmp_path / f"fsdp_rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == 2 and r0["optimizer_format"] == "verl FSDP2 checkpoint, world size 4"
    # this policy earns no reward (Ybar = 0, so deltaH1 = 0): the step is AdamW's momentum and decay
    for k in ("deltaH_pred", "SE_deltaH_pred"):
        assert math.isfinite(one[k]) and one[k] != 0.0, k
        assert r0[k] == r1[k] and abs(r0[k] - one[k]) <= 1e-4 * abs(one[k]), (k, r0[k], one[k])
    assert abs(r0["deltaH_true"] - one["deltaH_true"]) < 1e-6 * abs(one["H_orig"])
