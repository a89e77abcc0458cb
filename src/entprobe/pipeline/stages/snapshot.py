"""Snapshot and bit-exact restore of parameters and the full optimizer state. Under FSDP2 each rank
copies and restores its own shards (``sharding.local``) of the parameters and of the state. A
snapshot with ``live_state`` copies the parameters only and refers to the optimizer's own state
tensors, for a step that leaves the state as it was (stages/chunked_step.py)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from entprobe.runtime.sharding import is_dtensor, like_param, local
from entprobe.pipeline.stages.context import device_budget_bytes


@dataclass
class Snapshot:
    params: list[torch.Tensor]  # copies of p.data on the snapshot device
    state: dict[int, dict]  # param index -> {key: copied tensor or value}
    groups: list[dict]  # hyper-parameters of each param group (no 'params')
    live: bool = False  # state's tensors are the optimizer's own (not copies): steps must leave them as they are


def _copy(v, device):
    """Tensors become (copy of this rank's shard on ``device``, original device); other values are
    kept as they are."""
    return (local(v.detach()).to(device, copy=True), v.device) if isinstance(v, torch.Tensor) else v


def snapshot_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes a snapshot copies: the parameters and every tensor of their optimizer state."""
    n = sum(local(p).numel() * p.element_size() for p in params)
    if optimizer is not None:
        n += sum(local(v).numel() * v.element_size() for p in params for v in optimizer.state.get(p, {}).values()
                 if isinstance(v, torch.Tensor))
    return n


def resolve_snapshot_device(spec: str, device: torch.device, params: list[torch.Tensor],
                            optimizer: torch.optim.Optimizer | None, weights_only: bool = False) -> torch.device:
    """``importance.snapshot_device``: ``cpu``; ``gpu`` (or ``model``) the model's device; ``auto``
    the model's device when ``snapshot_bytes`` fit ``device_budget_bytes`` there, else the CPU
    (then taking the snapshot, the step's first-order terms and the restore cross the host link:
    ~5 training-step units on an H100 with SmolLM2, benchmarks/README.md). ``weights_only``: the
    snapshot there would hold the weights alone (a chunked step, stages/chunked_step.py), so only
    they need to fit."""
    if spec == "cpu":
        return torch.device("cpu")
    if spec in ("gpu", "model") or device.type != "cuda":
        return device
    need = snapshot_bytes(params, None if weights_only else optimizer)
    return device if need <= device_budget_bytes(device) else torch.device("cpu")


def take(params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None, device,
         live_state: bool = False) -> Snapshot:
    """Copies of the parameters on ``device``, the param groups' hyper-parameters and, per
    parameter with state, its state: copies of the tensors, or with ``live_state`` the live tensors
    themselves (``(tensor, its device)`` either way; nothing state-sized is copied then)."""
    state = {}
    if optimizer is not None:
        for i, p in enumerate(params):
            if p in optimizer.state:
                state[i] = {k: (v, v.device) if live_state and isinstance(v, torch.Tensor) else _copy(v, device)
                            for k, v in optimizer.state[p].items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] \
        if optimizer is not None else []
    return Snapshot([local(p.detach()).to(device, copy=True) for p in params], state, groups, live_state)


@torch.no_grad()
def restore(params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None, snap: Snapshot) -> None:
    """Copy everything back in place (same tensors, same bits); drop state the step created. A
    live-state snapshot's tensors are the live ones: they are put back under their keys, not copied."""
    datas = [local(p.data) for p in params]
    if all(d.device == s.device for d, s in zip(datas, snap.params)):
        torch._foreach_copy_(datas, snap.params)  # one multi-tensor copy; the same bits
    else:
        for d, s in zip(datas, snap.params):
            d.copy_(s)
    for p in params:
        p.grad = None
    if optimizer is None:
        return
    for i, p in enumerate(params):
        if i not in snap.state:
            optimizer.state.pop(p, None)
            continue
        live = optimizer.state[p]
        for k, v in snap.state[i].items():
            if not isinstance(v, tuple):
                live[k] = v
                continue
            saved, dev = v
            cur = live.get(k)
            if snap.live:
                live[k] = saved
            elif isinstance(cur, torch.Tensor) and local(cur).shape == saved.shape and cur.device == dev:
                local(cur).copy_(saved)
            elif is_dtensor(p) and saved.shape == local(p).shape and saved.dim():  # a sharded state tensor
                live[k] = like_param(p, saved.to(dev, copy=True))
            else:
                live[k] = saved.to(dev, copy=True)
        for k in set(live) - set(snap.state[i]):
            del live[k]
    for g, saved in zip(optimizer.param_groups, snap.groups):
        g.update(saved)


@contextlib.contextmanager
def restored_after(params, optimizer, device):
    """Run the block on a snapshot; restore bit-exactly on exit, also when the block raises."""
    snap = take(params, optimizer, device)
    try:
        yield snap
    finally:
        restore(params, optimizer, snap)


def state_fingerprint(params, optimizer) -> list[torch.Tensor]:
    """All parameter and optimizer-state tensors, cloned (for bitwise comparison in tests)."""
    out = [local(p.detach()).clone() for p in params]
    if optimizer is not None:
        for p in params:
            for k, v in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    out.append(local(v.detach()).clone())
    return out
