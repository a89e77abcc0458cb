"""``rollout_passes.pair_copies``: the dtype the prompts' X_n are kept in for the pair term of
``SE_deltaH_pred`` (math/rollout_ustat.pair_variance), beside the kept Y_n, within
``probe.unit_grads_budget_mb``."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from entprobe.pipeline.stages.rollout_passes import pair_copies


def test_the_x_copies_take_the_gradients_dtype_then_bf16_then_none():
    """One fp32 parameter of 1 MiB, 4 prompts with Y_n (4 MiB kept): the X_n in fp32 need 4 MiB more,
    in bf16 2 MiB; below that no pair term."""
    ctx = SimpleNamespace(params=[torch.zeros(2**18, dtype=torch.float32)])
    assert pair_copies(ctx, 4, 4, 8.0) == torch.float32
    assert pair_copies(ctx, 4, 4, 7.0) == torch.bfloat16
    assert pair_copies(ctx, 4, 4, 6.0) == torch.bfloat16
    assert pair_copies(ctx, 4, 4, 5.9) is None
    # the prompts whose Y_n is 0 keep no Y_n, but their X_n still pair with the others' Y
    assert pair_copies(ctx, 2, 4, 6.0) == torch.float32
