"""The dots one prompt of ``source="rollouts"`` needs against the update, in one blocked pass over its
parameters (pure math on flat tensors; no config, no I/O, no distributed calls).

For X (the prompt's entropy-side gradient), Y (its objective-side gradient, or none), the step's
gradient input y, AdamW's state (m, v), the parameters theta and the update's diagonal Jacobian J at
y (``jd``, written once per probe), with ``y' = alpha y - beta Y`` the input without the prompt
(clipped as the trainer clips: the caller folds the clip factor into alpha and beta), the values

    [X . Delta_gradient(y), X . Delta_momentum(y), X . Delta_weight_decay, X . J y,
     X . Delta_gradient(y'), X . Delta_momentum(y'), X . J Y]

with AdamW's parts (math/adamw.py; ``s = sqrt(bc2)``, ``D'(u) = sqrt(beta2 v + (1 - beta2) u^2) + eps s``)

    Delta_gradient(u) = (lr / bc1) (1 - beta1) s u / D'(u),   Delta_momentum(u) = -(lr / bc1) beta1 s m / D'(u),
    Delta_weight_decay = -lr wd theta

(plain SGD: ``lr u``, no momentum part, the same decay). Taken block by block (``BLOCK`` elements),
so that each input is read from memory once and the intermediates stay in cache: on a 135M-parameter
model the unfused form (the update written out, then dotted) made ~30 passes over parameter-sized
buffers per prompt. Products in the inputs' dtype promoted to at least fp32, block sums in fp64.
"""
from __future__ import annotations

import torch

from entprobe.math.adamw import AdamWHyper

BLOCK = 1 << 16  # elements per block: ~10 fp32 inputs and temporaries of 256 KiB stay in a core's cache
SLOTS = ("gradient", "momentum", "weight_decay", "jy", "gradient_loo", "momentum_loo", "jY")


def _coefficients(h: AdamWHyper, adam: bool) -> tuple[float, float, float, float]:
    """``(c_g, c_m, eps', c_wd)`` of the module docstring's parts: ``Delta_gradient(u) = c_g u / D'(u)``,
    ``Delta_momentum(u) = c_m m / D'(u)``, ``D'(u) = sqrt(beta2 v + (1 - beta2) u^2) + eps'``,
    ``Delta_weight_decay = c_wd theta`` (plain SGD: ``c_g = lr``, no momentum, ``D' = 1``)."""
    if adam:
        bc1, bc2 = 1.0 - h.beta1 ** (h.step + 1.0), 1.0 - h.beta2 ** (h.step + 1.0)
        sq = bc2 ** 0.5
        return h.lr / bc1 * (1.0 - h.beta1) * sq, -h.lr / bc1 * h.beta1 * sq, h.eps * sq, -h.lr * h.weight_decay
    return h.lr, 0.0, 0.0, -h.lr * h.weight_decay


def unit_dots(x: torch.Tensor, y: torch.Tensor, Y: torch.Tensor | None, jd: torch.Tensor, h: AdamWHyper, adam: bool,
              alpha: float, beta: float, m: torch.Tensor | None = None, v: torch.Tensor | None = None,
              theta: torch.Tensor | None = None) -> torch.Tensor:
    """The 7 values of the module docstring (``SLOTS`` order) as fp64, over flat tensors of one
    parameter group and step count (``h``); ``m, v`` AdamW's state (``adam``), ``theta`` only with
    weight decay, ``Y`` None: a prompt with no objective gradient (``X . J Y`` 0, ``y' = alpha y``)."""
    dt = torch.promote_types(torch.promote_types(x.dtype, jd.dtype), torch.float32)
    cg, cm, eps, wd = _coefficients(h, adam)
    zero = torch.zeros((), dtype=dt, device=x.device)
    raw = torch.zeros(len(SLOTS), dtype=torch.float64, device=x.device)  # the dots before the constants
    n = x.numel()
    for s in range(0, n, BLOCK):
        e = min(n, s + BLOCK)
        xb, yb, jb = x[s:e].to(dt), y[s:e].to(dt), jd[s:e].to(dt)
        Yb = Y[s:e].to(dt) if Y is not None else None
        yl = torch.mul(yb, alpha)
        if Yb is not None:
            yl.sub_(Yb, alpha=beta)
        xj = xb * jb
        row = [zero] * len(SLOTS)
        row[3] = torch.dot(xj, yb)
        if Yb is not None:
            row[6] = torch.dot(xj, Yb)
        if wd and theta is not None:
            row[2] = torch.dot(xb, theta[s:e].to(dt))
        if adam:
            mb, v2 = m[s:e].to(dt), v[s:e].to(dt) * h.beta2
            q = xb / torch.addcmul(v2, yb, yb, value=1.0 - h.beta2).sqrt_().add_(eps)  # X / D'(y)
            row[0], row[1] = torch.dot(q, yb), torch.dot(q, mb)
            q = xb / v2.addcmul_(yl, yl, value=1.0 - h.beta2).sqrt_().add_(eps)  # X / D'(y')
            row[4], row[5] = torch.dot(q, yl), torch.dot(q, mb)
        else:
            row[0], row[4] = torch.dot(xb, yb), torch.dot(xb, yl)
        raw += torch.stack(row).double()
    return raw * torch.tensor([cg, cm, wd, 1.0, cg, cm, 1.0], dtype=torch.float64, device=x.device)


CHECK_SLOTS = ("gradient", "momentum", "weight_decay", "x_delta_abs", "x_theta", "x_theta_abs")


def check_dots(x: torch.Tensor, y: torch.Tensor, theta: torch.Tensor, h: AdamWHyper, adam: bool,
               m: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
    """What the online step check needs of Xbar, in one blocked pass and in fp64 throughout (``CHECK_SLOTS``
    order, over flat tensors of one parameter group and step count ``h``; ``y`` the step's gradient input)::

        [X . Delta_gradient(y), X . Delta_momentum(y), X . Delta_weight_decay,
         sum_i |X_i| sum_part |Delta_part,i|, X . theta, sum_i |X_i| |theta_i|]

    with the parts of the module docstring. Every input is exactly representable in fp64, so each
    value is the exact one to the fp64 sums' rounding (``n eps64`` of its magnitude): the step taken,
    ``-X . (theta_plus - theta)``, differenced from the fp64 dots before and after it, is compared with
    the first three's sum within the update's own fp32 roundings (math/adamw.py, step_check_tolerance).
    It replaces three parameter-sized passes (the update written out chunk by chunk, then dotted; and
    the two dots with theta), each converting whole tensors to fp64."""
    dt = torch.float64
    cg, cm, eps, wd = _coefficients(h, adam)
    out = torch.zeros(len(CHECK_SLOTS), dtype=dt, device=x.device)
    n = x.numel()
    zero = torch.zeros((), dtype=dt, device=x.device)
    for s in range(0, n, BLOCK):
        e = min(n, s + BLOCK)
        xb, yb, tb = x[s:e].to(dt), y[s:e].to(dt), theta[s:e].to(dt)
        xa, ta = xb.abs(), tb.abs()
        if adam:  # 1 / D'(y), then the two parts (fresh tensors: the inputs are never written)
            inv = torch.addcmul(v[s:e].to(dt) * h.beta2, yb, yb, value=1.0 - h.beta2).sqrt_().add_(eps).reciprocal_()
            g, mo = torch.mul(yb, inv).mul_(cg), inv.mul_(m[s:e].to(dt)).mul_(cm)
        else:
            g, mo = torch.mul(yb, cg), None
        mag = g.abs()
        if mo is not None:
            mag.add_(mo.abs())
        if wd:
            mag.add_(ta, alpha=abs(wd))
        xt = torch.dot(xb, tb)
        out += torch.stack([torch.dot(xb, g), torch.dot(xb, mo) if mo is not None else zero, wd * xt,
                            torch.dot(xa, mag), xt, torch.dot(xa, ta)])
    return out
