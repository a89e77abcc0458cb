"""The world of Stage 3's tests (test_ground_truth.py, test_ground_truth_restore.py): the exactly
enumerable policy of ``exact_model.py`` at AdamW step 20 of real DR-GRPO training (momentum, second
moments, weight decay 0.1), in full or with a LoRA adapter (``VARIANTS``), and the helpers that build
``run_ground_truth``'s inputs and read theta_plus through its ``fail_after_step`` hook.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from entprobe.math import paramvec as pv
from entprobe.config import ImportanceConfig
from entprobe.pipeline.stages.accumulate import accumulate, x_loss_of, y_loss_of
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages.ground_truth import StepInputs
from conftest import fp_tol
from exact_model import adamw_with_state, fixed_batch, make_setup

G = 4
ICFG = ImportanceConfig(importance_microbatch_size=64, split_step=False, resample_on_low_ess=False)


@dataclasses.dataclass
class World:
    setup: object
    opt: torch.optim.AdamW
    ctx: ProbeContext
    U: object
    accY: object
    Ybar: pv.Buffer
    P: pv.Buffer
    grad_H: pv.Buffer
    variant: str = "full"


@functools.lru_cache(maxsize=2)
def make_world(variant: str = "full") -> World:
    """``full``: every parameter trainable; ``lora``: a LoRA adapter over the frozen model, the
    adapter's parameters the trainable ones (its own AdamW state, P from it)."""
    setup = make_setup(lora=variant == "lora")
    opt = adamw_with_state(setup)  # 20 real AdamW DR-GRPO steps, weight decay 0.1
    ctx = setup.ctx("sequence", mb_size=64)
    U = fixed_batch(setup, 8, G, seed=500)  # the fixed update batch (committed: the same on every machine)
    accY = accumulate(ctx, U, y_loss_of(ctx), "Y over U")
    st = [opt.state[p] for p in setup.params]
    P = pv.adam_preconditioner([s["exp_avg_sq"] for s in st], int(st[0]["step"]), 0.999, 1e-8,
                               dtype=torch.float64)
    return World(setup, opt, ctx, U, accY, pv.scale_(pv.clone(accY.sum_buf), 1.0 / U.B), P,
                 setup.exact_grad_entropy(), variant)


@pytest.fixture(scope="module")
def world(request) -> World:
    """The full model's world; ``@pytest.mark.parametrize("world", VARIANTS, indirect=True)`` runs
    a test on the LoRA adapter's too (one world per variant, shared like the module's fixture)."""
    return make_world(getattr(request, "param", "full"))


VARIANTS = ["full", "lora"]


def flat(buf) -> torch.Tensor:
    return torch.cat([b.detach().reshape(-1).double() for b in buf])


# fp64 steps read off fp64 parameters: theta_plus - theta against a displacement written out by
# hand. Each coordinate differs by the roundings of theta_plus = theta + Delta and of the
# difference (of |theta| and |Delta|) and of each side's chain of elementwise operations (relative
# to the terms it adds, ``terms``): under 16 roundings of ``2 |theta| + terms`` in fp64. A dot
# with those coordinates (``-Xbar . (theta_plus - theta)``) moves by the coordinates' bounds times
# |Xbar_i|, plus its own N-term rounding. A wrong step (a part lost, a factor off) is off by
# 1e-2 of the step or more, and the step is >= 1e-6 of theta here.
def disp_tol(theta: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    return fp_tol(torch.float64, 1.0, 16, worst_case=True) * (2 * theta.abs() + terms)


def dot_tol(x: torch.Tensor, coord_tol: torch.Tensor, disp: torch.Tensor) -> float:
    return float(x.abs() @ coord_tol) + fp_tol(torch.float64, float((x * disp).abs().sum()), x.numel())


def set_lr(opt, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def inputs(w: World, E, lr: float, Xbar: pv.Buffer | None = None, opt=None, U=None, accY=None) -> StepInputs:
    accX = accumulate(w.ctx, E, x_loss_of(w.ctx), "X over E", with_entropy=True)
    Xbar = Xbar if Xbar is not None else pv.scale_(accX.sum_buf, 1.0 / accX.B)
    accY = accY or w.accY
    Ybar = pv.scale_(pv.clone(accY.sum_buf), 1.0 / accY.B)
    return StepInputs(opt or w.opt, lr, Xbar, Ybar, w.P, (U or w.U).B, accX.S, accY.token_logp, accX.entropy)


class AtThetaPlus:
    """``fail_after_step`` hook that records the exact entropy and the parameters at theta_plus."""

    def __init__(self, setup):
        self.setup, self.H, self.theta = setup, None, None

    def __call__(self):
        self.H = float(self.setup.exact_entropy())
        self.theta = flat(self.setup.params)


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Same dtype, shape and bits (0.0 vs -0.0 and NaN payloads count as different)."""
    def bits(t):
        return t.contiguous().view(torch.int64 if t.element_size() == 8 else torch.int32)
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
                                    for x, y in zip(a, b))
