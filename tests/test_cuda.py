"""The CUDA paths, run where a GPU is present (skipped elsewhere, CI included): the whole job on
the builtin Llama on cuda:0 for every projection path, the auto placements, and the bit-exact
restore of a snapshot kept on the device. The rest of the suite pins the CPU (conftest.SHRINK)."""
from __future__ import annotations

import pytest
import torch

from conftest import compose_cfg
from entprobe.cli.probe_job import run
from entprobe.pipeline.stages.snapshot import restored_after, state_fingerprint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PATHS = ("stored", "fused", "jvp", "backward")
KEYS = ("deltaH1", "V_X", "V_Y", "SE_deltaH1", "deltaH_pred", "SE_deltaH_pred")


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory) -> dict:
    """run() on cuda:0 for each projection path, in fp32 and under bf16 autocast (the default)."""
    out = {}
    for autocast in ("false", "true"):
        for proj in PATHS:
            cfg = compose_cfg(tmp_path_factory.mktemp(f"cuda_{proj}_{autocast}"), "model.device=cuda:0",
                              f"model.autocast_bf16={autocast}", f"probe.projection={proj}")
            out[autocast, proj] = run(cfg)
    return out


def test_placements_on_the_device(cuda_runs):
    """auto keeps the buffers and the snapshot on a GPU with room (the builtin: kilobytes)."""
    for res in cuda_runs.values():
        assert res["buffers_device"] == "cuda:0" and res["snapshot_device"] == "cuda:0"


@pytest.mark.parametrize("autocast,tol", [("false", 1e-4), ("true", 5e-2)])
def test_paths_agree_on_cuda(cuda_runs, autocast, tol):
    """Every path equals the per-unit backward: to fp32 rounding without autocast; to bf16
    rounding under autocast (the paths round in different places: measured 0.2-0.6% on V_X)."""
    ref = cuda_runs[autocast, "backward"]
    for proj in PATHS:
        res = cuda_runs[autocast, proj]
        assert res["projection"] == proj
        for key in KEYS:
            assert rel(res[key], ref[key]) < tol, (autocast, proj, key, res[key], ref[key])
        assert torch.isfinite(torch.tensor(res["deltaH_true"])) and 0 < res["ESS_frac"] <= 1


def test_fp32_cuda_matches_cpu(cuda_runs, tmp_path):
    """The same batches and state on the CPU give the same prediction as fp32 on cuda:0."""
    cpu = run(compose_cfg(tmp_path, "probe.projection=backward"))
    gpu = cuda_runs["false", "backward"]
    for key in KEYS:
        assert rel(gpu[key], cpu[key]) < 1e-3, (key, gpu[key], cpu[key])


def test_device_snapshot_restores_bitwise_after_an_exception():
    """A snapshot on cuda:0 and a real AdamW step, then an exception: weights and every state
    tensor come back with the same bits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).cuda()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for _ in range(2):  # a state with momentum
        model(torch.randn(4, 8, device="cuda")).square().sum().backward()
        opt.step()
        opt.zero_grad()
    before = state_fingerprint(params, opt)
    with pytest.raises(RuntimeError, match="injected"):
        with restored_after(params, opt, torch.device("cuda", 0)) as snap:
            assert snap.params[0].device.type == "cuda"
            model(torch.randn(4, 8, device="cuda")).square().sum().backward()
            opt.step()
            assert not torch.equal(params[0], before[0])
            raise RuntimeError("injected")
    after = state_fingerprint(params, opt)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
