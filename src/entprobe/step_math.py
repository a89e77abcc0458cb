"""The update the user's optimizer will apply, as a function of the probe's ``Ybar`` (pure math on
tensors; no config, no I/O, no distributed calls).

The training loss's gradient on U is ``g = -Ybar_raw`` (the DR-GRPO loss; docs/math.md), so before
any step is taken the update ``Delta theta(Ybar)`` of a known optimizer state is known exactly,
and its first-order entropy change ``deltaH_pred = grad H . Delta theta = -Xbar . Delta theta``
(Xbar estimates -grad H) is a prediction of the real step. Its U-side uncertainty follows from the
Jacobian ``d Delta theta / d Ybar``, diagonal for these elementwise optimizers.

torch.optim.AdamW (``foreach``/``fused`` give the same update), per parameter with ``t = step + 1``,
``bc_k = 1 - beta_k^t``::

    m' = beta1 m + (1 - beta1) g          v' = beta2 v + (1 - beta2) g^2
    D  = sqrt(v') / sqrt(bc2) + eps
    Delta theta = -lr wd theta  -  (lr / bc1) beta1 m / D  -  (lr / bc1) (1 - beta1) g / D
                  [weight_decay]   [momentum]                [gradient]

(decoupled decay first, then ``addcdiv``). The three parts sum to the update exactly; the
momentum and gradient parts share the real denominator D (which the new gradient enters through
v'). With ``y = -g``, ``dD/dy = -(1 - beta2) g / (sqrt(bc2) sqrt(v'))`` and

    d[gradient]/dy = (lr / bc1) (1 - beta1) / D  -  (lr / bc1) (1 - beta1) g (1 - beta2) g / (D^2 sqrt(bc2) sqrt(v'))
    d[momentum]/dy = -(lr / bc1) beta1 m (1 - beta2) g / (D^2 sqrt(bc2) sqrt(v'))

(0 where v' = 0: no gradient and no history). A parameter without state (never stepped) has
m = v = 0 and step 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PARTS = ("gradient", "momentum", "weight_decay")


@dataclass
class AdamWHyper:
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    step: float  # steps already taken (the state's count); the update is step + 1


def adamw_update(y: torch.Tensor, m: torch.Tensor, v: torch.Tensor, theta: torch.Tensor,
                 h: AdamWHyper) -> dict[str, torch.Tensor]:
    """AdamW's ``Delta theta`` for the loss gradient ``g = -y``, split into ``PARTS`` (same dtype as
    y; compute in at least fp32)."""
    t = h.step + 1.0
    bc1, bc2 = 1.0 - h.beta1 ** t, 1.0 - h.beta2 ** t
    g = -y
    v_new = v * h.beta2 + (1.0 - h.beta2) * g * g
    D = v_new.sqrt() / bc2 ** 0.5 + h.eps
    scale = h.lr / bc1
    return {"gradient": -scale * (1.0 - h.beta1) * g / D,
            "momentum": -scale * h.beta1 * m / D,
            "weight_decay": -h.lr * h.weight_decay * theta}


def adamw_jacobian(y: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamWHyper) -> dict[str, torch.Tensor]:
    """Diagonal ``d Delta theta_part / d y`` for the parts that depend on y (gradient, momentum)."""
    t = h.step + 1.0
    bc1, bc2 = 1.0 - h.beta1 ** t, 1.0 - h.beta2 ** t
    g = -y
    v_new = v * h.beta2 + (1.0 - h.beta2) * g * g
    root = v_new.sqrt()
    D = root / bc2 ** 0.5 + h.eps
    scale = h.lr / bc1
    # d(1/D)/dy = -(1/D^2) dD/dy = (1 - beta2) g / (D^2 sqrt(bc2) sqrt(v'))  (0 where v' = 0)
    dinv = torch.where(root > 0, (1.0 - h.beta2) * g / (D * D * bc2 ** 0.5 * root.clamp(min=1e-300)),
                       torch.zeros_like(root))
    # gradient part = scale (1 - beta1) y / D
    return {"gradient": scale * (1.0 - h.beta1) * (1.0 / D + y * dinv),
            "momentum": -scale * h.beta1 * m * dinv}


def sgd_update(y: torch.Tensor, theta: torch.Tensor, lr: float, weight_decay: float) -> dict[str, torch.Tensor]:
    """Plain SGD without momentum (coupled decay): ``Delta theta = -lr (g + wd theta) = lr y - lr wd theta``."""
    return {"gradient": lr * y, "momentum": torch.zeros_like(y), "weight_decay": -lr * weight_decay * theta}


@dataclass
class StepModel:
    """The update ``Delta theta(Ybar)`` the optimizer will apply, aligned with the trainable
    parameters, by part (``PARTS``; a missing part is zero), and the diagonal Jacobian of each
    Ybar-dependent part (``jacobian`` None: unknown, the U side of the SE cannot be formed)."""
    parts: dict[str, list[torch.Tensor]]
    jacobian: dict[str, list[torch.Tensor]] | None
    kind: str  # what produced it: adamw_closed_form | sgd_closed_form | preconditioned_sgd | optimizer_step
