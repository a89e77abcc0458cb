"""Optimizer states that sharded trainers write, read whole and keyed by parameter name.

    named = read_trainer_state(Path("/ckpt/global_step_100/actor"))   # None: no such layout there
    named.state["model.layers.0.mlp.up_proj.weight"]["exp_avg_sq"]     # the whole tensor

``optimizer.state_path`` may point at any of these folders; the format is told by its files:

================================  =====================================================================
torch.distributed.checkpoint      a ``.metadata`` there, or in one sub-folder (accelerate FSDP's
                                  ``optimizer_0/``; torchtune; ``dcp.save`` of ``get_optimizer_state_dict``)
verl FSDP2                        ``optim_world_size_W_rank_R.pt`` there or in ``actor/``
DeepSpeed ZeRO-1/2/3              ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` there, or a ``latest`` file
================================  =====================================================================
"""
from __future__ import annotations

from pathlib import Path

from entprobe.trainer_states.named import NamedAdamState, check_moments

FORMATS = ("an HF Trainer optimizer.pt (or its checkpoint folder), a torch.distributed.checkpoint folder "
           "(accelerate FSDP: the folder with optimizer_0/), a verl FSDP2 checkpoint (global_step_N/actor) or a "
           "DeepSpeed ZeRO checkpoint (global_stepN/, or the folder with its 'latest' file)")


def read_trainer_state(path: Path) -> NamedAdamState | None:
    """The name-keyed state of the sharded checkpoint at ``path`` (moments checked finite and
    ``exp_avg_sq >= 0``), or None when ``path`` holds none of the layouts above."""
    from entprobe.trainer_states.dcp import find_dcp_folder, read_dcp
    from entprobe.trainer_states.deepspeed import find_deepspeed_folder, read_deepspeed
    from entprobe.trainer_states.verl import find_verl_folder, read_verl

    for find, read in ((find_verl_folder, read_verl), (find_deepspeed_folder, read_deepspeed),
                       (find_dcp_folder, read_dcp)):
        folder = find(path)
        if folder is not None:
            named = read(folder)
            check_moments(named)
            return named
    return None


__all__ = ["FORMATS", "NamedAdamState", "read_trainer_state"]
