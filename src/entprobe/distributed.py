"""Everything distributed lives here; at world size 1 every function is a no-op.

Ranks own disjoint prompts. Parameter-sized buffers are all-reduced once each, counts and
per-unit scalars are summed or gathered (O(B) scalars), so results equal a one-process run on
the same prompts up to summation order.
"""
from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main() -> bool:
    return rank() == 0


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def launched_distributed() -> bool:
    """True under torchrun (WORLD_SIZE > 1) or a multi-task SLURM step."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def init_from_env(backend: str = "auto", timeout_s: int = 1800) -> bool:
    """Initialise the default process group from torchrun or SLURM variables; returns whether it did."""
    if is_dist() or not launched_distributed():
        return is_dist()
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # srun without torchrun
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        os.environ.setdefault("MASTER_ADDR", os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
        os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def shutdown() -> None:
    if is_dist():
        dist.barrier()
        dist.destroy_process_group()


def _comm_device(t: torch.Tensor) -> torch.device:
    if is_dist() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_sum_(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """All-reduce (SUM) each tensor in place: one collective per parameter-sized buffer."""
    if not is_dist():
        return tensors
    for t in tensors:
        dev = _comm_device(t)
        if t.device == dev:
            dist.all_reduce(t)
        else:
            tmp = t.to(dev)
            dist.all_reduce(tmp)
            t.copy_(tmp)
    return tensors


def reduce_scalars(*xs: float) -> list[float]:
    """Global sums of scalars in one collective (float64)."""
    if not is_dist():
        return [float(x) for x in xs]
    t = torch.tensor([float(x) for x in xs], dtype=torch.float64, device=_comm_device(torch.empty(0)))
    dist.all_reduce(t)
    return t.cpu().tolist()


def gather_units(x: torch.Tensor) -> torch.Tensor:
    """Concatenate 1-D per-unit scalars of every rank in rank order (O(B) numbers, not params)."""
    if not is_dist():
        return x
    parts = [None] * world()
    dist.all_gather_object(parts, x.detach().cpu())
    return torch.cat(parts)


def broadcast_object(obj):
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def no_sync(model):
    """``model.no_sync()`` under DDP (probe passes must not trigger gradient reducers), else nothing."""
    if hasattr(model, "no_sync") and is_dist():
        with model.no_sync():
            yield
    else:
        yield
