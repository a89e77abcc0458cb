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

Gradient clipping (``torch.nn.utils.clip_grad_norm_(params, c)`` before the step) scales the whole
gradient by one factor, ``s = min(1, c / (||g|| + 1e-6))`` with ``||g||`` the 2-norm over every
parameter (``clip_factor``); s does not depend on the lr, so the clipped update is the closed form
above at ``s y``, linear in the lr like the unclipped one. Its Jacobian in y is no longer diagonal:
``d(s y)/dy = s I + y (ds/dy)^T`` with ``ds/dy = kappa y``, ``kappa = -c / (||y|| (||y|| + 1e-6)^2)``
while clipping binds (``s < 1``; 0 otherwise, ``clip_slope``), a rank-one term. With ``J_0`` the
diagonal Jacobian at ``s y``, ``J = J_0 (s I + kappa y y^T)`` and the U side of the SE needs
``J^T x = s J_0 x + kappa (y . J_0 x) y`` (the gradient of ``x . Delta theta`` in y): one dot over
all parameters (``clipped_vjp``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

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


def _denominator(y: torch.Tensor, v: torch.Tensor, h: AdamWHyper, bc2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sqrt(v'), D)`` with ``v' = beta2 v + (1 - beta2) y^2``, ``D = sqrt(v') / sqrt(bc2) + eps``."""
    root = torch.addcmul(v * h.beta2, y, y, value=1.0 - h.beta2).sqrt_()
    return root, (root / bc2 ** 0.5).add_(h.eps)


def _corrections(h: AdamWHyper) -> tuple[float, float]:
    t = h.step + 1.0
    return 1.0 - h.beta1 ** t, 1.0 - h.beta2 ** t


def adamw_update(y: torch.Tensor, m: torch.Tensor, v: torch.Tensor, theta: torch.Tensor,
                 h: AdamWHyper) -> dict[str, torch.Tensor]:
    """AdamW's ``Delta theta`` for the loss gradient ``g = -y``, split into ``PARTS`` (same dtype as
    y; compute in at least fp32). y may carry leading batch dimensions over the state's. The
    reference form (tests, the exact simulator); the probe writes in place (``adamw_update_into``)."""
    bc1, bc2 = _corrections(h)
    _, D = _denominator(y, v, h, bc2)
    scale = h.lr / bc1
    return {"gradient": (y / D).mul_(scale * (1.0 - h.beta1)),
            "momentum": (m / D).mul_(-scale * h.beta1),
            "weight_decay": theta * (-h.lr * h.weight_decay)}


def _dinv(y: torch.Tensor, root: torch.Tensor, D: torch.Tensor, h: AdamWHyper, bc2: float) -> torch.Tensor:
    """``d(1/D)/dy = -(1 - beta2) y / (D^2 sqrt(bc2) sqrt(v'))``, 0 where ``v' = 0``."""
    den = D.square().mul_(root).mul_(bc2 ** 0.5)
    return (y * -(1.0 - h.beta2)).div_(den).masked_fill_(root == 0, 0.0)


def adamw_jacobian(y: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamWHyper) -> dict[str, torch.Tensor]:
    """Diagonal ``d Delta theta_part / d y`` for the parts that depend on y (gradient, momentum);
    the reference form of ``adamw_jacobian_times_into``."""
    bc1, bc2 = _corrections(h)
    root, D = _denominator(y, v, h, bc2)
    dinv = _dinv(y, root, D, h, bc2)
    scale = h.lr / bc1
    # gradient part = scale (1 - beta1) y / D; momentum part = -scale beta1 m / D
    return {"gradient": (y * dinv).add_(D.reciprocal()).mul_(scale * (1.0 - h.beta1)),
            "momentum": (m * dinv).mul_(-scale * h.beta1)}


# roundings, each relative to the update's magnitude, in one computation of torch's AdamW step and
# of the closed form together: torch's lerp (m: 2), mul + addcmul (v: 2), sqrt, / sqrt(bc2), + eps,
# the division and the scaling by lr / bc1 (8 in all, sqrt halving v's); the closed form's mul,
# addcmul, sqrt, + eps, division, scaling and the parts' sum (7): 16 with room
STEP_CHECK_ROUNDINGS = 16


def step_check_tolerance(u: float, x_theta: float, x_delta: float) -> float:
    """Bound on ``|Xbar . (theta_plus - theta) - Xbar . Delta theta|`` (the step taken against the
    closed form, both dots in fp64) from rounding alone, with ``u`` the unit roundoff of the
    parameters' (or the computation's, if coarser) dtype, ``x_theta = sum_i |Xbar_i| |theta_i|`` and
    ``x_delta = sum_i |Xbar_i| sum_part |Delta theta_part,i|``::

        tol = u (2 x_theta + (STEP_CHECK_ROUNDINGS + 1) x_delta)

    theta_plus is stored rounded (``u |theta_plus| <= u (|theta| + |Delta|)`` per coordinate) after the
    decay's own rounding (``u |theta|``); each side's update carries its roundings, relative to its
    parts' magnitudes. A deterministic (worst-case) bound: an honest step never exceeds it."""
    return u * (2.0 * x_theta + (STEP_CHECK_ROUNDINGS + 1) * x_delta)


CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: s = min(1, c / (||g|| + 1e-6))


def clip_factor(norm: float, max_norm: float | None) -> float:
    """``s = min(1, max_norm / (norm + 1e-6))``: what ``clip_grad_norm_(params, max_norm)`` scales
    every gradient by, ``norm`` the 2-norm of the whole gradient (1 without clipping)."""
    if not max_norm:
        return 1.0
    return min(1.0, max_norm / (norm + CLIP_EPS))


def clip_slope(norm: float, max_norm: float | None) -> float:
    """``kappa`` with ``ds/dy = kappa y``: ``-max_norm / (norm (norm + 1e-6)^2)`` where clipping
    binds (``max_norm / (norm + 1e-6) < 1``), else 0 (s = 1 there, flat)."""
    if not max_norm or max_norm / (norm + CLIP_EPS) >= 1.0 or norm == 0.0:
        return 0.0
    return -max_norm / (norm * (norm + CLIP_EPS) ** 2)


def clipped_vjp(y: torch.Tensor, J0x: torch.Tensor, s: float, kappa: float) -> torch.Tensor:
    """``J^T x = s J_0 x + kappa (y . J_0 x) y`` on one flat vector (the reference form; the probe
    forms it tensor by tensor, its dot summed over all of them: pipeline/stages/prediction.py)."""
    return J0x * s + y * (kappa * float((y.double() * J0x.double()).sum()))


def adamw_update_into(y: torch.Tensor, m: torch.Tensor, v: torch.Tensor, theta: torch.Tensor, h: AdamWHyper,
                      out: dict[str, torch.Tensor], scratch: torch.Tensor) -> None:
    """``adamw_update`` written into ``out[part]`` (the parts present), in place, with one scratch
    tensor of y's size: no parameter-sized allocation (on a 135M model each fresh one costs a
    page-faulted pass). With ``s = sqrt(bc2)`` and ``D' = sqrt(v') + eps s = s D``:
    gradient ``scale (1 - beta1) s y / D'``, momentum ``-scale beta1 s m / D'``."""
    bc1, bc2 = _corrections(h)
    sq, scale = bc2 ** 0.5, h.lr / bc1
    torch.mul(v, h.beta2, out=scratch).addcmul_(y, y, value=1.0 - h.beta2).sqrt_().add_(h.eps * sq)
    if "gradient" in out:
        torch.div(y, scratch, out=out["gradient"]).mul_(scale * (1.0 - h.beta1) * sq)
    if "momentum" in out:
        torch.div(m, scratch, out=out["momentum"]).mul_(-scale * h.beta1 * sq)
    if "weight_decay" in out:
        torch.mul(theta, -h.lr * h.weight_decay, out=out["weight_decay"])


def adamw_factors_into(y: torch.Tensor, v: torch.Tensor, h: AdamWHyper, out: torch.Tensor, s: float = 1.0
                       ) -> tuple[float, float, float]:
    """The update's parts as factors (math/factored_directions.py): ``out = R = 1 / D'`` with
    ``D' = sqrt(beta2 v + (1 - beta2) y^2) + eps sqrt(bc2)`` (y the clipped gradient ``s Ybar``;
    pass y unclipped and s) and the constants ``(c_g, c_m, c_w)`` with ``gradient = c_g Ybar R``,
    ``momentum = c_m m R``, ``weight_decay = c_w theta``: ``adamw_update_into``'s parts."""
    bc1, bc2 = _corrections(h)
    sq, scale = bc2 ** 0.5, h.lr / bc1
    torch.mul(v, h.beta2, out=out).addcmul_(y, y, value=(1.0 - h.beta2) * s * s).sqrt_().add_(h.eps * sq)
    out.reciprocal_()
    return scale * (1.0 - h.beta1) * sq * s, -scale * h.beta1 * sq, -h.lr * h.weight_decay


def adamw_jacobian_times_into(y: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamWHyper,
                              x: torch.Tensor, out: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor) -> None:
    """``out = J x`` for the whole update's diagonal Jacobian J (gradient + momentum parts), in
    place with two scratch tensors: with ``D' = sqrt(v') + eps s`` (``s = sqrt(bc2)``) and
    ``c = scale s``,
    ``J = (c / D') [(1 - beta1) - (1 - beta2) y ((1 - beta1) y - beta1 m) / (D' sqrt(v'))]``
    (the second term 0 where v' = 0, where y = 0 too: sqrt(v') is floored at the smallest normal
    number there, which no nonzero sqrt(v') reaches). 13 elementwise passes, constants folded."""
    bc1, bc2 = _corrections(h)
    sq, scale = bc2 ** 0.5, h.lr / bc1
    c, b1, b2 = scale * sq, h.beta1, h.beta2
    torch.mul(v, b2, out=s1).addcmul_(y, y, value=1.0 - b2).sqrt_().clamp_min_(torch.finfo(s1.dtype).tiny)
    torch.add(s1, h.eps * sq, out=s2)  # D'
    torch.mul(y, -c * (1.0 - b2) * (1.0 - b1), out=out).add_(m, alpha=c * (1.0 - b2) * b1).mul_(y)
    out.div_(s1).div_(s2).add_(c * (1.0 - b1)).div_(s2).mul_(x)


@dataclass
class StepModel:
    """The update ``Delta theta(Ybar)`` the optimizer will apply, by part (``names``, a subset of
    ``PARTS``, or ``["update"]`` unsplit), written on demand into caller-owned buffers aligned with
    the trainable parameters (``write({name: buffer})``), and ``J^T x`` for the whole update's
    Jacobian J in Ybar, the gradient of ``x . Delta theta(Ybar)`` (``jacobian_times_into(x, out)``:
    ``J x`` for the elementwise optimizers' diagonal J; with gradient clipping J has a rank-one
    term and this is its transpose's product; None: unknown, the U side of the SE cannot be
    formed). Nothing parameter-sized is held between the calls. ``facts``: results that describe
    the update (``pred/grad_norm``, ``pred/grad_clip_factor`` with clipping)."""
    names: list[str]
    write: Callable[[dict[str, list[torch.Tensor]]], None]
    jacobian_times_into: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None
    kind: str  # what produced it: adamw_closed_form | sgd_closed_form | preconditioned_sgd | optimizer_step
    facts: dict = field(default_factory=dict)
    # the closed forms without clipping: ``unit_dots(X, Y, alpha, beta, J)``, math/unit_dots.py's values for
    # one prompt (X . each part at Ybar and at ``alpha Ybar - beta Y``, X . J Ybar, X . J Y) in one blocked pass
    unit_dots: Callable[..., torch.Tensor] | None = None
    # the closed forms: ``dots_with(x) -> (x . Delta theta, sum_i |x_i| sum_part |Delta theta_part,i|, x . theta,
    # sum_i |x_i| |theta_i|)`` in fp64 without writing the update out (the online probe's check of the step
    # taken; None: write it)
    dots_with: Callable[[list[torch.Tensor]], tuple[float, float, float, float]] | None = None
    # the closed forms: whether the update at a zero gradient is exactly 0 but for the weight decay (nothing
    # carried: SGD without momentum; AdamW whose every m is 0, e.g. before its first step), read off the
    # optimizer's state without writing the update (None: write it and look)
    carries_nothing: Callable[[], bool] | None = None
    # plain AdamW's closed form: ``factors_into(out) -> (coefs, m, ybar)``, the update's parts as factors of
    # held tensors (math/factored_directions.py): ``out[i] = R_i`` written, per parameter its
    # ``PartCoefficients``-style ``(c_g, c_m, c_w)``, AdamW's live ``exp_avg`` (None without state) and Ybar
    factors_into: Callable[[list[torch.Tensor]], tuple[list[tuple[float, float, float]],
                                                       list[torch.Tensor | None], list[torch.Tensor]]] | None = None
