"""Everything distributed lives here; at world size 1 every function is a no-op.

Ranks own disjoint prompts. Parameter-sized buffers are all-reduced once each, counts and
per-unit scalars are summed or gathered (O(B) scalars), so results equal a one-process run on
the same prompts up to summation order.

Launch environments recognised by ``init_from_env`` (see docs/scaling.md for the commands):

    torchrun --nproc_per_node 2 -m entprobe.main          # RANK / WORLD_SIZE / MASTER_* from torchrun
    srun --ntasks-per-node 4 python -m entprobe.main       # SLURM_PROCID / SLURM_STEP_NUM_TASKS
    python -m entprobe.main -m hydra/launcher=slurm ...    # submitit tasks: exported via submitit
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import inspect
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from entprobe.runtime import sharding


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main() -> bool:
    return rank() == 0


def env_rank() -> int:
    """This process's global rank as the launcher announced it (usable before/after the group)."""
    if is_dist():
        return rank()
    for key in ("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def _submitit_tasks() -> int:
    """Number of tasks of the submitit job this process belongs to (0 outside submitit)."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return 0
    try:
        import submitit
        return submitit.JobEnvironment().num_tasks
    except Exception:  # not a submitit job after all (e.g. a stale variable)
        return 0


def _slurm_step_tasks() -> int:
    """Tasks of the current srun step (the batch script itself is not a multi-task step)."""
    if "SLURM_PROCID" not in os.environ:
        return 0
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))


def launched_distributed() -> bool:
    """True under torchrun (WORLD_SIZE > 1), a multi-task srun step or a multi-task submitit job."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return True
    return _slurm_step_tasks() > 1 or _submitit_tasks() > 1


def launch_id() -> str:
    """Who launched this process, the same for every rank of one distributed job ("" outside one):
    torchrun's run id and rendezvous address, the SLURM job and step, the submitit job, else the
    rendezvous address (MASTER_ADDR:MASTER_PORT) of a hand-started process group."""
    if not launched_distributed():
        return ""
    env = os.environ
    rdzv = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun {env['TORCHELASTIC_RUN_ID']} {rdzv}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm {env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}"
    if env.get("SUBMITIT_LOCAL_JOB_ID"):
        return f"submitit {env['SUBMITIT_LOCAL_JOB_ID']}"
    return f"group {rdzv}"


def export_launcher_env() -> None:
    """Fill torch's env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) from
    submitit or SLURM when no torchrun set them. Idempotent; a no-op under torchrun."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    if _submitit_tasks() > 1:  # hydra/launcher=slurm or submitit_local with tasks_per_node > 1
        from submitit.helpers import TorchDistributedEnvironment

        e = TorchDistributedEnvironment()  # ranks from the job environment, port from the job id
        os.environ.update(RANK=str(e.rank), WORLD_SIZE=str(e.world_size), LOCAL_RANK=str(e.local_rank),
                          LOCAL_WORLD_SIZE=str(e.local_world_size))
        os.environ.setdefault("MASTER_ADDR", e.master_addr)  # a user's setup may pin these
        os.environ.setdefault("MASTER_PORT", str(e.master_port))
    elif _slurm_step_tasks() > 1:  # srun python -m entprobe.main
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_STEP_NUM_TASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        os.environ.setdefault("MASTER_ADDR", os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
        os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def init_from_env(backend: str = "auto", timeout_s: int = 1800, model_device: str = "auto") -> bool:
    """Initialise the default process group from torchrun / SLURM / submitit variables.

    ``backend="auto"``: nccl when the model runs on CUDA (``model_device`` ``auto`` with CUDA
    available, or ``cuda[:N]``), else gloo (a CPU model on a GPU machine cannot use nccl).
    Returns whether a group exists."""
    if is_dist() or not launched_distributed():
        return is_dist()
    export_launcher_env()
    if backend == "auto":
        on_cuda = model_device.startswith("cuda") or (model_device == "auto" and torch.cuda.is_available())
        backend = "nccl" if on_cuda else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def shutdown(ok: bool = True, keep_group: bool = False) -> None:
    """Tear the group down. After a failure skip the barrier: the other ranks may never reach it
    (torchrun / srun then stop them), and a barrier would hang until the timeout.

    ``keep_group``: the end of one job of a multirun. The group stays for the next job and is
    destroyed when the process exits: a second ``init_process_group`` on the same rendezvous
    store (torchrun's) reads the first group's stale gloo / nccl addresses and hangs until
    ``ddp.timeout_s``."""
    sharding.unshard_state()
    if not is_dist():
        return
    if ok:
        dist.barrier()
    if keep_group:
        _destroy_at_exit()
    else:
        dist.destroy_process_group()


_EXIT_HOOK: list[bool] = []


def _destroy_at_exit() -> None:
    """Destroy the process group (if one is left) when the interpreter exits; registered once."""
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(lambda: is_dist() and dist.destroy_process_group())


def wrap(model: torch.nn.Module, device: torch.device, find_unused_parameters: bool = True,
         strategy: str = "ddp") -> torch.nn.Module:
    """DDP around ``model`` when a group exists, else ``model``. Buffers are not re-broadcast at
    every forward (ranks run different numbers of forwards; the buffers never change).
    ``strategy="fsdp2"``: the model is sharded in place instead (``sharding.shard_model``)."""
    sharding.unshard_state()
    if not is_dist() or world() == 1:
        return model
    if strategy == "fsdp2":
        return sharding.shard_model(model, device)
    DDP = torch.nn.parallel.DistributedDataParallel
    no_buffer_sync = ({"forward_sync_buffers": False}  # torch >= 2.13 spelling
                      if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                      else {"broadcast_buffers": False})
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               find_unused_parameters=find_unused_parameters, **no_buffer_sync)


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
    """Concatenate per-unit tensors (dim 0) of every rank in rank order (O(B) numbers, not params)."""
    if not is_dist():
        return x
    parts = [None] * world()
    dist.all_gather_object(parts, x.detach().cpu())
    return torch.cat(parts)


def gather_objects(obj) -> list:
    """Every rank's ``obj`` in rank order (small picklable things: token batches, paths)."""
    if not is_dist():
        return [obj]
    parts = [None] * world()
    dist.all_gather_object(parts, obj)
    return parts


def all_true(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (one collective; ``flag`` itself without a group)."""
    if not is_dist():
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.int64, device=_comm_device(torch.empty(0)))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


HYDRA_OWN = {".hydra", "main.log"}  # what Hydra writes into a run dir before the job starts


def shared_run_dir(own: str | Path, hydra_files: set[str] = HYDRA_OWN) -> Path:
    """One run directory for all ranks: rank 0's. Ranks started a second apart resolve Hydra's
    ``${now:}`` differently; a rank whose own directory differs removes it when it holds only
    what Hydra wrote there (``.hydra/``, the job log), and its then-empty parent."""
    own = Path(own).resolve()
    shared = Path(broadcast_object(str(own)))
    if shared != own and own.is_dir() and {p.name for p in own.iterdir()} <= hydra_files:
        shutil.rmtree(own, ignore_errors=True)
        with contextlib.suppress(OSError):
            own.parent.rmdir()  # the ${now:%Y-%m-%d} level, only if nothing else is in it
    return shared


@contextlib.contextmanager
def no_sync(model):
    """``model.no_sync()`` under DDP, else nothing. Wrap the forward *and* the backward: DDP arms
    its gradient all-reduce in ``forward`` when sync is on, whatever context the backward runs in."""
    if hasattr(model, "no_sync") and is_dist():
        with model.no_sync():
            yield
    else:
        yield

