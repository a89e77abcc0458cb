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
PART_SLOTS = {"gradient": 1, "momentum": 2, "weight_decay": 3}  # column of each part in _dots', after the lead


@dataclass
class PartCoefficients:
    """One parameter's constants: ``gradient = c_g Ybar R``, ``momentum = c_m m R``,
    ``weight_decay = c_w theta`` (module docstring)."""

    gradient: float
    momentum: float
    weight_decay: float


class FactoredDirections:
    """``k = lead + len(parts)`` directions (``lead + 1`` with ``total``): the ``lead`` leading rows of
    ``rows`` as stored (the two-batch probe's ``P Ybar``; none in the held-out online probe), then
    the update's ``parts`` (names in ``math.adamw.PARTS``, the step model's order), or with
    ``total`` their sum (the whole update) as one direction, formed from ``rows``' last row R and the
    held ``ybar``, ``m`` (None for a parameter without AdamW state: its momentum part is 0) and
    ``theta`` with per-parameter ``coefs``. ``paramvec.dot_set``, ``dot_rows_set`` and ``is_zero``
    accept it in place of a ``DirectionSet``."""

    def __init__(self, rows: DirectionSet, ybar: Buffer, m: list[torch.Tensor | None], theta: Buffer,
                 coefs: list[PartCoefficients], parts: list[str], total: bool = False):
        if rows.k not in (1, 2) or not parts or not set(parts) <= set(PART_SLOTS):
            raise ValueError(f"FactoredDirections: rows [P Ybar,] R and parts from {list(PART_SLOTS)}; got "
                             f"{rows.k} rows, parts {parts}")
        self.rows, self.ybar, self.m, self.theta, self.coefs, self.parts = rows, ybar, m, theta, coefs, parts
        self.lead, self.total, self.shapes = rows.k - 1, total, rows.shapes

    def with_total(self, total: bool) -> "FactoredDirections":
        """The same directions with the parts separate (False) or summed (True), sharing storage."""
        return FactoredDirections(self.rows, self.ybar, self.m, self.theta, self.coefs, self.parts, total)

    @property
    def k(self) -> int:
        return self.lead + (1 if self.total else len(self.parts))

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    def column(self, j: int) -> Buffer:
        """A leading (stored) row as a buffer of views; the parts are not written out."""
        if not 0 <= j < self.lead:
            raise ValueError(f"FactoredDirections: only the {self.lead} leading row(s) are stored; the update's "
                             "parts are factors")
        return self.rows.column(j)

    def _dots(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """[n, lead + 3] fp64: ``x . lead row``, then ``x R . Ybar``, ``x R . m``, ``x . theta`` for
        parameter i's rows x [n, n_i] (constants not applied)."""
        block = self.rows.block(i)
        R = block[self.lead]
        dev, dt = R.device, R.dtype
        y, th = self.ybar[i].reshape(-1), self.theta[i].reshape(-1)
        m = self.m[i].reshape(-1) if self.m[i] is not None else None
        n = x.shape[0]
        out = torch.zeros((n, self.lead + 3), dtype=torch.float64, device=dev)
        one = n == 1  # one row: 1-D dots (BLAS dot), a third faster than a [1, b] @ [b] product here
        xs = x[0] if one else x
        zero = torch.zeros(() if one else n, dtype=dt, device=dev)
        for s in range(0, R.numel(), BLOCK):
            e = min(s + BLOCK, R.numel())
            xb = xs[..., s:e].to(dev, dt)
            t = xb * R[s:e]
            lead = [xb @ block[j, s:e] for j in range(self.lead)]
            out += torch.stack(lead + [t @ y[s:e].to(dev, dt), t @ m[s:e].to(dev, dt) if m is not None else zero,
                                       xb @ th[s:e].to(dev, dt)], -1).double()
        return out

    def _parts(self, i: int, d: torch.Tensor) -> torch.Tensor:
        """[n, len(parts)]: each part's dot with its constant."""
        c = self.coefs[i]
        return torch.stack([d[:, self.lead - 1 + PART_SLOTS[p]] * getattr(c, p) for p in self.parts], 1)

    def _apply(self, i: int, d: torch.Tensor) -> torch.Tensor:
        """[n, k]: the leading rows' dots, then the parts' (or their sum)."""
        parts = self._parts(i, d)
        return torch.cat([d[:, :self.lead], parts.sum(1, keepdim=True) if self.total else parts], 1)

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
        terms = [self._parts(i, self._dots(i, x.reshape(1, -1)))[0].sum() for i, x in enumerate(a)]
        return reduce_shards(torch.stack(terms)) if terms else torch.zeros(0, dtype=torch.float64)

    def is_zero(self) -> bool:
        """Whether every direction is exactly 0 everywhere (over all shards): the leading rows, and
        each part (its constant 0, or its held factor 0 where R is finite; a NaN is not 0)."""
        def nonzero(t: torch.Tensor) -> int:
            return int(torch.count_nonzero(t))
        count = sum(nonzero(self.rows.block(i)[:self.lead]) for i in range(len(self.shapes))) if self.lead else 0
        for i, c in enumerate(self.coefs):
            R = self.rows.block(i)[self.lead]
            held = {"gradient": self.ybar[i], "momentum": self.m[i], "weight_decay": self.theta[i]}
            for p in self.parts:
                f = held[p]
                if getattr(c, p) == 0 or f is None:
                    continue
                # R is finite and positive unless eps = 0 and v' = 0: count those as nonzero
                count += nonzero(f.reshape(-1).to(R.device)) + (0 if p == "weight_decay" else
                                                               nonzero(~torch.isfinite(R)))
        return float(reduce_shards(torch.tensor(float(count), dtype=torch.float64))) == 0.0
