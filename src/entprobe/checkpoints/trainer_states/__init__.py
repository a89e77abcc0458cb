"""Optimizer states that sharded trainers write, read whole and keyed by parameter name.

    named = read_trainer_state(Path("/ckpt/global_step_100/actor"))   # None: no such layout there
    named.state["model.layers.0.mlp.up_proj.weight"]["exp_avg_sq"]     # the whole tensor

``optimizer.state_path`` may point at any of these folders; the format is told by its files:

================================  =====================================================================
torch.distributed.checkpoint      a ``.metadata`` there, or in one sub-folder (accelerate FSDP's
                                  ``optimizer_0/``; torchtune; ``dcp.save`` of ``get_optimizer_state_dict``)
verl FSDP2                        ``optim_world_size_W_rank_R.pt`` there or in ``actor/``
DeepSpeed ZeRO-1/2/3              ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` there, or a ``latest`` file;
                                  its universal conversion: ``zero/<name>/exp_avg_sq.pt`` (``latest_universal``)
================================  =====================================================================
"""
from __future__ import annotations

from pathlib import Path

from entprobe.checkpoints.errors import OptimizerStateError
from entprobe.checkpoints.trainer_states.named import NamedAdamState, check_moments
from entprobe.checkpoints.trainer_states.dcp import find_dcp_folder, read_dcp
from entprobe.checkpoints.trainer_states.deepspeed import find_deepspeed_folder, read_deepspeed
from entprobe.checkpoints.trainer_states.verl import MERGE, find_verl_folder, read_verl

FORMATS = ("an HF Trainer optimizer.pt (or its checkpoint folder), a torch.distributed.checkpoint folder "
           "(accelerate FSDP: the folder with optimizer_0/), a verl FSDP2 checkpoint (global_step_N/actor) or a "
           "DeepSpeed ZeRO checkpoint (global_stepN/, or the folder with its 'latest' file, or their universal conversion)")


def read_trainer_state(path: Path) -> NamedAdamState | None:
    """The name-keyed state of the sharded checkpoint at ``path`` (moments checked finite and
    ``exp_avg_sq >= 0``), or None when ``path`` holds none of the layouts above."""
    for find, read in ((find_verl_folder, read_verl), (find_deepspeed_folder, read_deepspeed),
                       (find_dcp_folder, read_dcp)):
        folder = find(path)
        if folder is not None:
            named = read(folder)
            if not named.state:
                raise OptimizerStateError(f"{folder} ({named.fmt}) holds no Adam moments (exp_avg / exp_avg_sq): "
                                          "an Adam / AdamW run's checkpoint is needed")
            check_moments(named)
            return named
    return None


def _has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(
        any(folder.glob(pattern)) for pattern in ("*.safetensors", "pytorch_model*.bin"))


def weights_hint(folder: Path) -> str | None:
    """What to do when ``model.path`` is a sharded trainer's folder without HF weights (None: not
    one): the trainer's full-weights folder when it wrote one, else the command that merges them."""
    actor = find_verl_folder(folder) or (find_verl_folder(folder.parent) if folder.name == "huggingface" else None)
    if actor is not None:
        hf = actor / "huggingface"
        if _has_weights(hf) and hf != folder:
            return f"verl wrote the full weights to {hf}: set model.path={hf}"
        return (f"{hf} holds verl's config and tokenizer but no weights (verl saves them there when the "
                f"checkpoint contents include hf_model); merge the shards with verl: `{MERGE.format(actor=actor)}`, "
                f"then set model.path={hf}")
    if (folder / "pytorch_model_fsdp_0").is_dir():
        return (f"{folder}/pytorch_model_fsdp_0 holds accelerate's sharded FSDP weights: merge them with "
                f"`accelerate merge-weights {folder}/pytorch_model_fsdp_0 {folder}/merged`, copy the model's "
                f"config.json and tokenizer files into {folder}/merged and set model.path={folder}/merged")
    ds = find_deepspeed_folder(folder)
    if ds is not None:
        top = ds.parent if (ds.parent / "latest").is_file() else ds
        return (f"{folder} is a DeepSpeed checkpoint: consolidate the weights with the script DeepSpeed saved "
                f"beside it, `python {top}/zero_to_fp32.py {top} {top}/fp32 --safe_serialization`, copy the "
                f"model's config.json and tokenizer files into {top}/fp32 and set model.path={top}/fp32")
    return None


__all__ = ["FORMATS", "NamedAdamState", "read_trainer_state", "weights_hint"]
