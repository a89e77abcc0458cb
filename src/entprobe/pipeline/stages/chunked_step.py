"""The ground truth's optimizer step taken a few parameter tensors at a time, so that its snapshot
holds the weights only (one parameter-sized copy instead of three with AdamW).

``chunked_step``: for each chunk of parameters (``chunks``), only the chunk's parameters hold their
gradient, their optimizer-state tensors are copied, ``optimizer.step()`` moves them, and the copies
are put back into the same live state tensors. The weights end where one full step puts them, bit
for bit; the optimizer state ends as it began. Nothing after the step reads the new state: E at
theta_plus and ``xbar_dot_step`` read the weights, ``split_step`` reads the snapshot's (old) state,
and its repeated zero-gradient steps are themselves chunked (``step_on``).

Which path ``run_ground_truth`` takes (``chunked_step_applies``):

- chunked, snapshot = the weights (``take(..., live_state=True)``): ``step_mode=optimizer``, the
  step is torch's own Adam, AdamW or SGD step (``torch_own_step``: these classes or subclasses that
  do not override ``step``), called with no step hooks and through no instance-level wrapper but an
  LR scheduler's, the model is not sharded, and every parameter of the optimizer is on the
  snapshot's device. Those steps update each parameter from its own gradient, its own state and its
  param group's hyper-parameters only, and skip parameters without a gradient, so stepping disjoint
  chunks in turn is one step (tests/test_chunked_step.py checks it bitwise).
- full snapshot (weights and every state tensor, ``take``): anything else. Another optimizer may
  couple its parameters (a global norm, a shared counter) and a hook or wrapper may act once per
  call; FSDP2 parameters and state are DTensor shards, restored through ``like_param``, and the
  chunked step is not tested on them; a snapshot on another device than the parameters'
  (``importance.snapshot_device=cpu``) is asked for to keep its copies off that device, where the
  chunks' state copies would be made.
- ``preconditioned_sgd`` takes no optimizer step: not chunked, and its snapshot is the weights alone
  (the state is never touched).
"""
from __future__ import annotations

import inspect

import torch

from entprobe.runtime import sharding
from entprobe.runtime.sharding import is_dtensor

CHUNKS = 16  # a chunk holds at most max(largest tensor, 1/CHUNKS of all the stepped tensors), in bytes


def torch_own_step(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step`` is torch's own Adam/AdamW/SGD step (a subclass that does not override
    ``step`` keeps it; torch's profiling wrapper is seen through). A subclass with its own step may
    update differently from the closed form: it is stepped on a snapshot instead."""
    own = {inspect.unwrap(c.step) for c in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)}
    return inspect.unwrap(type(opt).step) in own


def _plain_call(opt: torch.optim.Optimizer) -> bool:
    """``opt.step()`` runs the class's step and nothing else per call: no step pre- or post-hooks
    (the optimizer's or global ones) and no instance attribute ``step`` other than the wrapper an LR
    scheduler installs (it only marks the optimizer as stepped)."""
    from torch.optim import optimizer as o
    if (opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or o._global_optimizer_pre_hooks
            or o._global_optimizer_post_hooks):
        return False
    wrapper = vars(opt).get("step")
    return wrapper is None or (getattr(wrapper, "_wrapped_by_lr_sched", False)
                               and inspect.unwrap(wrapper) is inspect.unwrap(type(opt).step))


def _device(d) -> torch.device:
    """``d`` with its index (``cuda`` -> ``cuda:<current>``), as tensors report theirs."""
    d = torch.device(d)
    return torch.empty(0, device=d).device if d.index is None and d.type != "cpu" else d


def chunked_step_applies(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor], snapshot_device,
                         step_mode: str) -> bool:
    """Whether the ground truth takes its step chunk by chunk with a weights-only snapshot (the
    module's docstring says when and why)."""
    if step_mode != "optimizer" or optimizer is None or not torch_own_step(optimizer) or not _plain_call(optimizer):
        return False
    everything = [p for g in optimizer.param_groups for p in g["params"]] + list(params)
    if sharding.sharded() or any(is_dtensor(p) for p in everything):
        return False
    dev = _device(snapshot_device)
    return all(p.device == dev for p in everything)


def weights_only_snapshot(step_mode: str, chunked: bool) -> bool:
    """Whether the ground truth's snapshot holds the weights alone: its step is chunked
    (``chunked``, from ``chunked_step_applies`` on the snapshot's device), or it takes no optimizer
    step at all (``preconditioned_sgd``: the state is never touched)."""
    return chunked or step_mode == "preconditioned_sgd"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def chunks(params: list[torch.Tensor], grads: list[torch.Tensor], parts: int = CHUNKS) -> list[list[int]]:
    """Consecutive runs of indices into ``params``, each of at most ``max(largest, total / parts)``
    parameter bytes (a tensor larger than that is a chunk of its own). One chunk of everything when
    a parameter or gradient is not contiguous: a multi-tensor (``foreach``) kernel takes its slow
    path for a whole list when one member is not dense, so a chunk without that member could take
    the fast one and round differently."""
    if not params:
        return []
    if not all(t.is_contiguous() for t in params + grads):
        return [list(range(len(params)))]
    sizes = [_nbytes(p) for p in params]
    cap = max(max(sizes), sum(sizes) // parts)
    out, run, used = [], [], 0
    for i, n in enumerate(sizes):
        if run and used + n > cap:
            out.append(run)
            run, used = [], 0
        run.append(i)
        used += n
    return out + [run]


def _copy_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict | None:
    """p's state as ``{key: (live value, copy of a tensor or None)}``; None when p has no state."""
    st = opt.state.get(p)  # .get: the state is a defaultdict, reading it must not create an entry
    if st is None:
        return None
    return {k: (v, v.clone() if isinstance(v, torch.Tensor) else None) for k, v in st.items()}


def _put_back(opt: torch.optim.Optimizer, p: torch.Tensor, saved: dict | None) -> None:
    """p's state as ``_copy_state`` found it: the same tensor objects holding the same bits, the
    same keys (those the step created dropped), no state where there was none."""
    if saved is None:
        opt.state.pop(p, None)
        return
    live = opt.state[p]
    for k in set(live) - set(saved):
        del live[k]
    for k, (obj, copy) in saved.items():
        if copy is not None:
            obj.copy_(copy)
        live[k] = obj


@torch.no_grad()
def chunked_step(optimizer: torch.optim.Optimizer, parts: int = CHUNKS) -> None:
    """``optimizer.step()`` on the gradients the parameters hold, one chunk of parameters at a time
    (``chunks``): the weights move as one step moves them and the optimizer state (every tensor and
    value in ``optimizer.state``) is left as it was, also when a step raises (the weights are then
    partly moved: the caller restores them from its snapshot). The parameters get their gradients
    back at the end. Holds one chunk's state copy at a time; the step's own temporaries are a chunk's."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        for chunk in chunks(params, grads, parts):
            saved = [_copy_state(optimizer, params[i]) for i in chunk]
            try:
                for i in chunk:
                    params[i].grad = grads[i]
                optimizer.step()
            finally:
                for i, s in zip(chunk, saved):
                    params[i].grad = None
                    _put_back(optimizer, params[i], s)
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def step_on(optimizer: torch.optim.Optimizer, snap) -> None:
    """One optimizer step from the snapshot's state: chunked when the snapshot refers to the live
    state (``snap.live``, which must stay as it is), else ``optimizer.step()``."""
    if snap.live:
        chunked_step(optimizer)
    else:
        optimizer.step()
