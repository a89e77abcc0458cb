"""Where the parameter-sized state lives: ``auto`` placements of the buffers, the snapshot and U's
per-unit gradients against the free CUDA memory (mem_get_info faked: these rules must hold on
machines without a GPU too)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from entprobe.config import ProbeConfig
from entprobe.pipeline.stages import context as C
from entprobe.pipeline.stages.context import DEVICE_SHARE, PROBE_BUFFERS, device_budget_bytes, resolve_buffers_device
from entprobe.pipeline.stages.snapshot import resolve_snapshot_device, snapshot_bytes
from entprobe.pipeline.stages.variance import SMALL_MODEL_PARAMS, resolve_projection

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture
def free_bytes(monkeypatch):
    """Set the fake free memory of every CUDA device: ``free_bytes(n)``."""
    box = {"free": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (box["free"], 80 * 2**30))
    return lambda n: box.__setitem__("free", n)


def on_cuda(numel: int):
    """A stand-in parameter of ``numel`` fp32 elements that reports a CUDA device."""
    return SimpleNamespace(device=CUDA, numel=lambda: numel, element_size=lambda: 4)


def test_device_budget(free_bytes):
    free_bytes(1000)
    assert device_budget_bytes(CUDA) == DEVICE_SHARE * 1000
    assert device_budget_bytes(CUDA, reserved=200) == DEVICE_SHARE * 800
    assert device_budget_bytes(CUDA, reserved=2000) == 0
    assert device_budget_bytes(CPU) == float("inf")  # nothing moves off a CPU model


def test_buffers_device_rule(free_bytes):
    """auto: the model's device when PROBE_BUFFERS fp32 buffers fit 1/4 of the free memory, else
    the CPU; explicit choices are kept; a CPU model keeps them on the CPU."""
    n = 1000
    need = PROBE_BUFFERS * n * 4
    free_bytes(need / DEVICE_SHARE)
    assert resolve_buffers_device("auto", [on_cuda(n)], torch.float32) == CUDA
    assert resolve_buffers_device("auto", [on_cuda(n + 1)], torch.float32) == CPU
    assert resolve_buffers_device("auto", [on_cuda(2 * n)], torch.float16) == CUDA  # half the bytes
    assert resolve_buffers_device("cpu", [on_cuda(n)], torch.float32) == CPU
    assert resolve_buffers_device("model", [on_cuda(10 * n)], torch.float32) == CUDA
    assert resolve_buffers_device("cuda:1", [on_cuda(n)], torch.float32) == torch.device("cuda", 1)
    assert resolve_buffers_device("auto", [torch.nn.Parameter(torch.zeros(3))], torch.float32) == CPU


def test_buffers_device_agrees_across_ranks(free_bytes, monkeypatch):
    """One rank without room sends every rank's buffers to the CPU (the all-reduce of the sums
    needs the same placement everywhere)."""
    monkeypatch.setattr(C.D, "world", lambda: 2)
    monkeypatch.setattr(C.D, "reduce_scalars", lambda *xs: [x + 0.0 for x in xs])  # the other rank: no room
    free_bytes(10**9)
    assert resolve_buffers_device("auto", [on_cuda(10)], torch.float32) == CPU


def test_snapshot_device_rule(free_bytes):
    """auto: the model's device when weights + optimizer state fit 1/4 of the free memory."""
    p = torch.nn.Parameter(torch.zeros(10))
    opt = torch.optim.AdamW([p], lr=0.1)
    assert snapshot_bytes([p], opt) == 40  # no state before the first step
    p.grad = torch.ones(10)
    opt.step()
    assert snapshot_bytes([p], opt) == 40 * 3 + 4  # exp_avg, exp_avg_sq and the step tensor
    need = snapshot_bytes([p], opt)
    free_bytes(need / DEVICE_SHARE)
    assert resolve_snapshot_device("auto", CUDA, [p], opt) == CUDA
    free_bytes(need / DEVICE_SHARE - 4)
    assert resolve_snapshot_device("auto", CUDA, [p], opt) == CPU
    assert resolve_snapshot_device("gpu", CUDA, [p], opt) == CUDA
    assert resolve_snapshot_device("cpu", CUDA, [p], opt) == CPU
    assert resolve_snapshot_device("auto", CPU, [p], opt) == CPU
    assert resolve_snapshot_device("gpu", CPU, [p], opt) == CPU  # no GPU: the model's device
    # a chunked step's snapshot holds the weights alone: only they need to fit
    free_bytes(snapshot_bytes([p], None) / DEVICE_SHARE)
    assert resolve_snapshot_device("auto", CUDA, [p], opt) == CPU
    assert resolve_snapshot_device("auto", CUDA, [p], opt, weights_only=True) == CUDA
    free_bytes(snapshot_bytes([p], None) / DEVICE_SHARE - 4)
    assert resolve_snapshot_device("auto", CUDA, [p], opt, weights_only=True) == CPU


def test_the_ground_truth_sizes_a_chunked_steps_snapshot_by_the_weights(monkeypatch):
    """``run_ground_truth`` asks ``resolve_snapshot_device`` for room for the weights alone where its
    step would be chunked on the model's device (torch's AdamW) or takes no optimizer step
    (``preconditioned_sgd``), for weights and state otherwise (an optimizer with its own step)."""
    import dataclasses

    from entprobe.config import ImportanceConfig, StepMode
    from entprobe.math import paramvec as pv
    from entprobe.pipeline.stages import ground_truth as gt
    from entprobe.pipeline.stages.accumulate import accumulate, x_loss_of, y_loss_of
    from exact_model import adamw_with_state, fixed_batch, make_setup

    class OwnStep(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    setup = make_setup()
    ctx = setup.ctx("sequence", mb_size=64)
    U, E = fixed_batch(setup, 4, 4, seed=500), setup.sample(4, 4, seed=12)
    accY = accumulate(ctx, U, y_loss_of(ctx), "Y over U")
    accX = accumulate(ctx, E, x_loss_of(ctx), "X over E", with_entropy=True)
    Xbar, Ybar = (pv.scale_(pv.clone(a.sum_buf), 1.0 / a.B) for a in (accX, accY))
    asked = []
    real = gt.resolve_snapshot_device
    monkeypatch.setattr(gt, "resolve_snapshot_device", lambda *a, **k: asked.append(k["weights_only"]) or real(*a, **k))
    icfg = ImportanceConfig(importance_microbatch_size=64, resample_on_low_ess=False)
    own = OwnStep(setup.params, lr=1e-3)
    own.load_state_dict(adamw_with_state(setup).state_dict())
    for opt, cfg in ((adamw_with_state(setup), icfg), (own, icfg),
                     (adamw_with_state(setup), dataclasses.replace(icfg, step_mode=StepMode.preconditioned_sgd))):
        inp = gt.StepInputs(opt, 1e-3, Xbar, Ybar, None, U.B, accX.S, accY.token_logp, accX.entropy)
        gt.run_ground_truth(ctx, E, U, inp, cfg)
    assert asked == [True, False, True]


def test_stored_projection_reserves_device_buffers(free_bytes):
    """On CUDA, ``stored`` needs U's per-unit gradients to fit 1/4 of the free memory left after
    the Xbar / Ybar sums when those live on the device too."""
    n = SMALL_MODEL_PARAMS
    units = 4 * n * 4  # 4 units of fp32 gradients
    sums = 2 * n * 4

    def ctx(buffers_device):
        return SimpleNamespace(params=[torch.empty(n)], device=CUDA, buffers_device=buffers_device,
                               buffers_dtype=torch.float32)

    free_bytes(units / DEVICE_SHARE + sums)
    assert resolve_projection(ProbeConfig(), ctx(CUDA), 4) == "stored"
    assert resolve_projection(ProbeConfig(), ctx(CPU), 4) == "stored"
    free_bytes(units / DEVICE_SHARE + sums - 4)
    assert resolve_projection(ProbeConfig(), ctx(CUDA), 4) == "fused"
    assert resolve_projection(ProbeConfig(), ctx(CPU), 4) == "stored"  # the sums are host memory


def test_unit_backward_rule_on_cuda(free_bytes):
    """auto on CUDA: vmap while a microbatch backward is host-bound (4 N tokens below
    CUDA_HOST_BOUND_FLOPS) and its batched unit gradients and logits' gradients fit; else loop."""
    from entprobe.config import UnitBackward
    from entprobe.pipeline.stages.variance import CUDA_HOST_BOUND_FLOPS, resolve_unit_backward

    n, V, mb, G = 135_000_000, 49152, 2, 8

    def ctx():
        model = SimpleNamespace(config=SimpleNamespace(vocab_size=V, hidden_size=576, intermediate_size=1536))
        return SimpleNamespace(params=[on_cuda(n)], device=CUDA, mb_size=mb, model=model)

    def batch(T):
        return SimpleNamespace(G=G, input_ids=torch.zeros(1, G, T, dtype=torch.long))

    T = 290
    tokens = mb * G * T
    need = mb * (4 * n + 4 * tokens * V)
    free_bytes(need / DEVICE_SHARE)
    assert resolve_unit_backward(ProbeConfig(), ctx(), (batch(66), batch(T))) == "vmap"
    free_bytes(need / DEVICE_SHARE - 4)
    assert resolve_unit_backward(ProbeConfig(), ctx(), (batch(T),)) == "loop"  # no room
    free_bytes(10**12)
    T_big = int(CUDA_HOST_BOUND_FLOPS / (4 * n * mb * G)) + 1
    assert resolve_unit_backward(ProbeConfig(), ctx(), (batch(T_big),)) == "loop"  # arithmetic-bound
    assert resolve_unit_backward(ProbeConfig(), ctx(), (batch(T_big - 2),)) == "vmap"
    assert resolve_unit_backward(ProbeConfig(unit_backward=UnitBackward.loop), ctx(), (batch(T),)) == "loop"
