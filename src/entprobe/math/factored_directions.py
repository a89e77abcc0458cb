"""The E side's projection directions of an AdamW step, held as factors instead of written out.

The two-batch probe projects each E prompt's gradient x onto ``P Ybar`` (the seeds' ``deltaH1``) and
onto each part of the update AdamW will apply to the U gradient Ybar (math/adamw.py). Per parameter
element, with ``D' = sqrt(beta2 v + (1 - beta2) (s Ybar)^2) + eps sqrt(bc2)`` and ``R = 1 / D'``:

    gradient      = c_g Ybar R        c_g = (lr / bc1) (1 - beta1) sqrt(bc2) s
    momentum      = c_m m R           c_m = -(lr / bc1) beta1 sqrt(bc2)
    weight_decay  = c_w theta         c_w = -lr wd

(s the gradient-clipping factor, 1 without clipping; the constants per param group and step count).
Ybar, m and theta are held anyway (the U sum, AdamW's state, the weights), so only ``P Ybar`` and R
are stored: 2 parameter-sized rows where the written-out parts take 4 (docs/memory.md). A dot is
formed block by block (``BLOCK`` elements, fp32 products summed in fp64 across blocks):

    x . gradient = c_g sum_b (x_b R_b) . Ybar_b,   x . momentum = c_m sum_b (x_b R_b) . m_b,
    x . weight_decay = c_w sum_b x_b . theta_b

It reads x, R, Ybar, m, theta and ``P Ybar`` once: about the memory traffic of the written-out
``[4, n]`` rows' product. Each part equals the written-out row's dot to fp32 rounding (the row
rounds ``Ybar / D'`` where this rounds ``1 / D'`` and the product ``x R``: a few eps of each term).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from entprobe.math.paramvec import Buffer, DirectionSet
from entprobe.runtime.sharding import reduce_shards

BLOCK = 1 << 18  # elements a block: its products stay in cache; few host calls on a 135M model
PART_SLOTS = {"gradient": 1, "momentum": 2, "weight_decay": 3}  # column of each part in _dots' [n, 4]


@dataclass
class PartCoefficients:
    """One parameter's constants: ``gradient = c_g Ybar R``, ``momentum = c_m m R``,
    ``weight_decay = c_w theta`` (module docstring)."""

    gradient: float
    momentum: float
    weight_decay: float


class FactoredDirections:
    """``k = 1 + len(parts)`` directions: row 0 ``P Ybar``, then the update's ``parts`` (names in
    ``math.adamw.PARTS``, the step model's order), formed from ``rows`` (a two-row ``DirectionSet``:
    ``P Ybar``, R) and the held ``ybar``, ``m`` (None for a parameter without AdamW state: its
    momentum part is 0) and ``theta`` with per-parameter ``coefs``. ``paramvec.dot_set``,
    ``dot_rows_set`` and ``is_zero`` accept it in place of a ``DirectionSet``."""

    def __init__(self, rows: DirectionSet, ybar: Buffer, m: list[torch.Tensor | None], theta: Buffer,
                 coefs: list[PartCoefficients], parts: list[str]):
        if rows.k != 2 or not set(parts) <= set(PART_SLOTS):
            raise ValueError(f"FactoredDirections: rows P Ybar and R, parts from {list(PART_SLOTS)}; got "
                             f"{rows.k} rows, parts {parts}")
        self.rows, self.ybar, self.m, self.theta, self.coefs, self.parts = rows, ybar, m, theta, coefs, parts
        self.shapes = rows.shapes

    @property
    def k(self) -> int:
        return 1 + len(self.parts)

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    def column(self, j: int) -> Buffer:
        """Row 0 (``P Ybar``) as a buffer of views; the parts are not written out."""
        if j != 0:
            raise ValueError("FactoredDirections: only P Ybar (row 0) is stored; the update's parts are factors")
        return self.rows.column(0)

    def _dots(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """[n, 4] fp64: ``x . P Ybar``, ``x R . Ybar``, ``x R . m``, ``x . theta`` for parameter i's
        rows x [n, n_i] (constants not applied)."""
        block = self.rows.block(i)
        PY, R = block[0], block[1]
        dev, dt = PY.device, PY.dtype
        y, th = self.ybar[i].reshape(-1), self.theta[i].reshape(-1)
        m = self.m[i].reshape(-1) if self.m[i] is not None else None
        n = x.shape[0]
        out = torch.zeros((n, 4), dtype=torch.float64, device=dev)
        one = n == 1  # one row: 1-D dots (BLAS dot), a third faster than a [1, b] @ [b] product here
        xs = x[0] if one else x
        zero = torch.zeros(() if one else n, dtype=dt, device=dev)
        for s in range(0, PY.numel(), BLOCK):
            e = min(s + BLOCK, PY.numel())
            xb = xs[..., s:e].to(dev, dt)
            t = xb * R[s:e]
            out += torch.stack([xb @ PY[s:e], t @ y[s:e].to(dev, dt), t @ m[s:e].to(dev, dt) if m is not None else zero,
                                xb @ th[s:e].to(dev, dt)], -1).double()
        return out

    def _apply(self, i: int, d: torch.Tensor) -> torch.Tensor:
        """[n, k]: row 0's dot, then each part's with its constant."""
        c = self.coefs[i]
        return torch.stack([d[:, 0]] + [d[:, PART_SLOTS[p]] * getattr(c, p) for p in self.parts], 1)

    def dot_rows(self, rows: Buffer) -> torch.Tensor:
        """Per-row dots of stacked rows (``[n, *shape]`` per parameter) with the k directions: [n, k] fp64."""
        n = rows[0].shape[0]
        total = torch.zeros((n, self.k), dtype=torch.float64, device=self.device)
        for i, x in enumerate(rows):
            total += self._apply(i, self._dots(i, x.reshape(n, -1)))
        return reduce_shards(total)

    def dot(self, a: Buffer) -> torch.Tensor:
        """``[a . direction_j for j]``: [k] fp64 on the directions' device."""
        return self.dot_rows([x.unsqueeze(0) for x in a])[0]

    def part_terms(self, a: Buffer) -> torch.Tensor:
        """Per parameter tensor, ``a_i . (sum of the parts)_i``: [n_params] fp64 (the attribution
        of ``a . Delta theta``)."""
        terms = [self._apply(i, self._dots(i, x.reshape(1, -1)))[0, 1:].sum() for i, x in enumerate(a)]
        return reduce_shards(torch.stack(terms)) if terms else torch.zeros(0, dtype=torch.float64)

    def is_zero(self) -> bool:
        """Whether every direction is exactly 0 everywhere (over all shards): ``P Ybar``, and each
        part (its constant 0, or its held factor 0 where R is finite; a NaN is not 0)."""
        def nonzero(t: torch.Tensor) -> int:
            return int(torch.count_nonzero(t))
        count = nonzero(self.rows.mat[0]) if self.rows.mat is not None else \
            sum(nonzero(b[0]) for b in self.rows.blocks)
        for i, c in enumerate(self.coefs):
            R = self.rows.block(i)[1]
            held = {"gradient": self.ybar[i], "momentum": self.m[i], "weight_decay": self.theta[i]}
            for p in self.parts:
                f = held[p]
                if getattr(c, p) == 0 or f is None:
                    continue
                # R is finite and positive unless eps = 0 and v' = 0: count those as nonzero
                count += nonzero(f.reshape(-1).to(R.device)) + (0 if p == "weight_decay" else
                                                               nonzero(~torch.isfinite(R)))
        return float(reduce_shards(torch.tensor(float(count), dtype=torch.float64))) == 0.0
