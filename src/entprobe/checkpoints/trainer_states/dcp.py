"""torch.distributed.checkpoint (DCP) folders: what accelerate's FSDP checkpoints (``optimizer_0/``
beside ``pytorch_model_fsdp_0/``), torchtune and a plain ``dcp.save`` of
``get_optimizer_state_dict`` write.

A DCP folder is a ``.metadata`` file (every tensor's global shape and which ``__R_0.distcp`` file
holds which chunk) and one data file per writing rank. The optimizer's state_dict inside is keyed
by parameter name (``state[fqn] = {exp_avg, exp_avg_sq, step}``, ``param_groups[i]["params"] = [fqn,
...]``), so any world size reads back into whole tensors. It is read with torch's own DCP reader
in one process (``no_dist=True``, no process group), with two things made safe: ``.metadata`` is
unpickled by an unpickler that builds only DCP's metadata records, and the non-tensor entries
(param group hyperparameters) are read with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import torch

from entprobe.runtime.input_files import load_torch_file
from entprobe.checkpoints.errors import OptimizerStateError
from entprobe.checkpoints.trainer_states.named import MOMENTS, NamedAdamState, adam_group, clean_name, step_tensor

METADATA = ".metadata"
_DCP_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
}
_METADATA_RECORDS = {"Metadata", "MetadataIndex", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                     "TensorStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records, torch sizes, dtypes and paths, and nothing else."""

    def find_class(self, module, name):
        if (module == _DCP_MODULE and name in _METADATA_RECORDS) or (module, name) in _ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata record")


def _reader_and_planner(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = folder / METADATA
            try:
                with path.open("rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except Exception as exc:
                why = (str(exc) if isinstance(exc, pickle.UnpicklingError) and "DCP metadata record" in str(exc)
                       else "truncated, or not what dcp.save writes")
                raise OptimizerStateError(f"{path}: not a torch.distributed.checkpoint metadata file entprobe reads "
                                          f"({why}); nothing from it was executed; copy the checkpoint again"
                                          ) from None
            if not hasattr(metadata, "storage_data") or not hasattr(metadata, "state_dict_metadata"):
                raise OptimizerStateError(f"{path}: not a torch.distributed.checkpoint metadata file (no storage "
                                          "index); copy the checkpoint again")
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeReader(str(folder)), SafePlanner()


def read_dcp_folder(folder: Path) -> dict:
    """The whole state_dict a DCP folder holds, tensors whole, in this process. Every data file
    the metadata names must be there (an error names the first one missing)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader, planner = _reader_and_planner(folder)
    metadata = reader.read_metadata()
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    gone = [f for f in files if not (folder / f).is_file()]
    if gone:
        raise OptimizerStateError(f"{folder / gone[0]}: missing ({len(gone)} of the {len(files)} data files the "
                                  f"checkpoint's {METADATA} names are not there); copy every rank's file")
    for f in files:  # a truncated copy is named before torch reads past its end
        end = max(i.offset + i.length for i in metadata.storage_data.values() if i.relative_path == f)
        if (folder / f).stat().st_size < end:
            raise OptimizerStateError(f"{folder / f}: {(folder / f).stat().st_size} bytes, but {METADATA} records data "
                                      f"up to byte {end} (truncated, or of another save); copy every file of one "
                                      "save again")
    state: dict = {}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            # what dcp_to_torch_save does: an empty state_dict that the planner fills from the metadata
            _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except OptimizerStateError:
        raise
    except (Exception, CheckpointException):  # CheckpointException is a BaseException
        bad = _bad_data_file(folder, metadata)
        raise OptimizerStateError(f"{bad or folder}: {'a data file' if bad else 'a checkpoint'} that does not match "
                                  f"{folder / METADATA} (truncated, overwritten, or of another save or world size); "
                                  "copy every file of one save again") from None
    return state


def _bad_data_file(folder: Path, metadata) -> Path | None:
    """The first data file whose items, at the offsets ``.metadata`` records, are not whole
    weights-only torch records of the recorded chunk shape (None: every one reads)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        f = folder / info.relative_path
        try:
            with f.open("rb") as fh:
                fh.seek(info.offset)
                raw = fh.read(info.length)
            if len(raw) != info.length:
                return f
            obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            md = metadata.state_dict_metadata.get(index.fqn)
            if isinstance(md, TensorStorageMetadata):
                chunk = next((c for c in md.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
                if not torch.is_tensor(obj) or (chunk is not None and tuple(obj.shape) != tuple(chunk.sizes)):
                    return f
        except Exception:
            return f
    return None


def find_dcp_folder(path: Path) -> Path | None:
    """The DCP folder holding the optimizer: ``path`` itself, else its one sub-folder with a
    ``.metadata`` whose name says optimizer (accelerate's ``optimizer_0/``), else its only one."""
    if (path / METADATA).is_file():
        return path
    subs = [p for p in sorted(path.iterdir()) if p.is_dir() and (p / METADATA).is_file()] if path.is_dir() else []
    optim = [p for p in subs if "optim" in p.name]
    if len(optim) == 1:
        return optim[0]
    if len(optim) > 1:  # accelerate writes optimizer_<i> per prepared optimizer
        raise OptimizerStateError(f"{path} holds {len(optim)} optimizer states ({', '.join(p.name for p in optim)}): "
                                  f"say which one the probed step uses, e.g. optimizer.state_path={optim[0]}")
    return subs[0] if len(subs) == 1 else None


def _optimizer_dict(sd: dict, where: Path) -> dict:
    """The optimizer state_dict inside a loaded DCP state (top level, or under any one key)."""
    if isinstance(sd, dict) and "state" in sd and "param_groups" in sd:
        return sd
    for key, value in (sd.items() if isinstance(sd, dict) else []):
        if isinstance(value, dict) and "state" in value and "param_groups" in value:
            return value
    keys = list(sd)[:5] if isinstance(sd, dict) else type(sd).__name__
    raise OptimizerStateError(f"{where}: this torch.distributed.checkpoint holds no optimizer state_dict ('state' and "
                              f"'param_groups'; top-level keys {keys}); point optimizer.state_path at the optimizer's "
                              "folder (accelerate: optimizer_0/), not the model's")


def _scheduler_lr(parent: Path) -> tuple[float | None, str]:
    """accelerate saves the lr scheduler beside the DCP folders as ``scheduler.bin``."""
    for name in ("scheduler.bin", "scheduler.pt"):
        f = parent / name
        if f.is_file():
            st = load_torch_file(f, "the lr scheduler state", "fix or remove it, or set optimizer.lr")
            last = st.get("_last_lr") if isinstance(st, dict) else None
            if last:
                return float(last[0]), str(f)
    return None, ""


def read_dcp(folder: Path) -> NamedAdamState:
    """A DCP optimizer state as whole tensors per (unwrapped) parameter name."""
    sd = _optimizer_dict(read_dcp_folder(folder), folder)
    where = str(folder)
    state = {}
    for fqn, st in sd["state"].items():
        if not isinstance(st, dict) or not all(k in st for k in MOMENTS):
            continue  # a parameter that never had a gradient has no moments
        state[clean_name(str(fqn))] = {**{k: st[k].detach().float() for k in MOMENTS},
                                       "step": step_tensor(st.get("step", 0), f"{where}: {fqn}")}
    groups = []
    for i, g in enumerate(sd["param_groups"]):
        names = [clean_name(str(n)) for n in g.get("params", [])]
        if any(not isinstance(n, str) for n in g.get("params", [])):
            raise OptimizerStateError(f"{where}: param group {i} lists parameters by position, not by name; "
                                      "save with get_optimizer_state_dict (or FSDP.optim_state_dict)")
        groups.append(adam_group(g, [n for n in names if n in state], f"{where} param group {i}"))
    lr, src = _scheduler_lr(folder.parent)
    return NamedAdamState("torch.distributed.checkpoint", folder, state, groups, None, lr, src)
