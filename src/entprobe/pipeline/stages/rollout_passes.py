"""The passes of the prediction on the step's own batch (``source="rollouts"``;
math/rollout_ustat.py has the estimator): per prompt n of the batch, X_n and the objective's Y_n,
and the dots the cross-prompt U-statistic needs, ``UnitDots``:

    e_n = X_n . Delta theta_part (each part of the update),  X_n . J y,  Y_n . y,  X_n . J Y_n,  Y_n . J Xbar

with y the gradient input of the step (minus the trainer's ``.grad``) and J the update's diagonal
Jacobian in y (``StepModel.jacobian_times_into``; its diagonal is written once, ``J 1``).

Pass 1 (phase ``rollouts_units``), per prompt: one forward (token entropies too, for X's per-token form
and the entropy H at theta), the X backward (graph kept), the Y backward; the gradients are taken from
``.grad`` without a copy and dotted on the model's device: ``Y_n . y``, then the update's parts,
``J y``, the update without the prompt (``X_n . Delta theta(y_{-n})``) and ``X_n . J Y_n``, in one
blocked pass for the closed forms (``StepModel.unit_dots``, math/unit_dots.py), else against the
parts written out (``paramvec.dot_set``). The X sum is kept (Xbar). Each Y_n is kept when all of them fit
``probe.unit_grads_budget_mb``; then ``Y_n . J Xbar`` and Ybar (for the check that the objective
reproduces the trainer's gradient) need no further pass. Otherwise pass 2 (phase ``rollouts_y``): the
Y pass again with the projection onto ``J Xbar`` (``accumulate``'s per-unit projections and sum).
Cost: 1 forward + 2 backward per sequence (+ 1 + 1 without the kept Y_n); a prompt whose Y weights
are all 0 takes no Y backward.

With TRL's entropy bonus in the loss (``bonus``: coefficient c > 0, stages/rollout_bonus.py) each Y_n adds
prompt n's share of ``-c grad H_bonus`` (the forward's entropies differentiable), no prompt is a zero-Y
one, and ``gH = grad H_bonus`` comes first (phase ``rollouts_bonus``: one forward + backward a sequence);
``bonus_effect=True`` (the guard's coefficient knob) also gives ``b_n = -X_n . J gH`` per prompt (one dot
each). Without either, nothing of this runs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from entprobe.math import paramvec as pv
from entprobe.math import unit_dots as ud
from entprobe.math.adamw import StepModel
from entprobe.math.rollout_ustat import UnitDots, clip_coefficient
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.pipeline.stages.accumulate import accumulate, check_grads, prepare_x, require_grad_path, y_loss_of
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages.prediction import directions
from entprobe.pipeline.stages import rollout_bonus as rb
from entprobe.rollouts import objectives as ob


@dataclass
class RolloutPasses:
    dots: UnitDots
    step_dots: list[float]  # Xbar . Delta theta_part, the step model's parts in order
    ybar_norm: float  # |Ybar| of the objective's units (before any clipping)
    ybar_dot_y: float  # Ybar . y
    y_norm: float  # |y|
    S: torch.Tensor  # [B, G] sequence log-probs at theta (CPU)
    entropy: torch.Tensor | None  # [B, G, T] token entropies at theta (CPU)
    kept_y: bool  # Y_n kept (no pass 2)
    Xbar: pv.Buffer  # mean of the batch's X_n (model device)
    residual: float  # |y - c Ybar|, the gradient the objective does not account for
    bonus_units: torch.Tensor | None = None  # [B] b_n = -X_n . J gH (bonus_effect=True)


DOT_BLOCK = 1 << 18  # elements a block of _dot: 1 MiB an fp32 input (fewer host calls than unit_dots.BLOCK)


def _dot(a: pv.Buffer, b: pv.Buffer, c: pv.Buffer | None = None) -> torch.Tensor:
    """``sum_i a_i (c_i) b_i`` as a 0-dim fp64 tensor on a's device (products in fp32 or wider). Where
    an input must be converted (a bf16 J X_n of the pair term) or multiplied by c, block by block
    (``DOT_BLOCK``): a parameter-sized temporary is a fresh, page-faulted allocation each time (1.6 s
    for SmolLM2-135M's 540 MB on a 2-core VM, against 0.13 s for the blocked dot)."""
    total = torch.zeros((), dtype=torch.float64, device=a[0].device)
    for i, (x, y) in enumerate(zip(a, b)):
        dt = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
        xf, yf = x.reshape(-1), y.reshape(-1).to(x.device)
        cf = c[i].reshape(-1).to(x.device) if c is not None else None
        if cf is None and xf.dtype == dt and yf.dtype == dt:
            total += torch.dot(xf, yf).double()
            continue
        for s in range(0, xf.numel(), DOT_BLOCK):
            e = s + DOT_BLOCK
            yb = yf[s:e].to(dt)
            if cf is not None:
                yb = yb * cf[s:e].to(dt)
            total += torch.dot(xf[s:e].to(dt), yb).double()
    return total


def _take_grads(ctx: ProbeContext) -> pv.Buffer:
    """``.grad`` of every trainable parameter (zeros where None), detached; ``.grad`` left None."""
    out = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in ctx.params]
    ctx.zero_grad()
    return out


@dataclass
class PromptGrads:
    """One prompt's passes: its sequence log-probs S [G] and token entropies [G, T] at theta (CPU; None
    without them), X_n and Y_n (parameter-sized, on the model's device; Y_n None: its Y weights are all 0)."""
    S: torch.Tensor
    ent: torch.Tensor | None
    X: pv.Buffer
    Y: pv.Buffer | None


def prompt_grads(ctx: ProbeContext, batch: RolloutBatch, n: int, zero_y: bool, with_entropy,
                 bonus: ob.EntropyBonus | None = None) -> PromptGrads:
    """Prompt n's forward (token entropies too with ``with_entropy``), the X backward (its graph kept
    for Y) and, unless ``zero_y`` (every Y weight 0), the Y backward of the objective (plus the bonus's
    share with ``bonus``), the gradients taken from ``.grad`` without a copy."""
    unit = batch.select(n)
    what = f"source=rollouts, prompt {n}"
    fwd = ctx.forward_S(unit, what, with_entropy=with_entropy)
    x_loss = ctx.x.loss(fwd, unit)
    require_grad_path(x_loss, what)
    x_loss.backward(retain_graph=not zero_y)
    check_grads(ctx, f"{what} (X)")
    X = _take_grads(ctx)
    Y = None
    if not zero_y:
        y_loss = ctx.y_loss(fwd.S, unit)
        (y_loss if bonus is None else y_loss + bonus.y_loss(fwd.ent)).backward()
        check_grads(ctx, f"{what} (Y)")
        Y = _take_grads(ctx)
    ctx.stats.count("backward", (1 if zero_y else 2) * unit.G)
    return PromptGrads(fwd.S.detach().cpu(), fwd.ent.detach().cpu() if fwd.ent is not None else None, X, Y)


def zero_y_prompts(ctx: ProbeContext, batch: RolloutBatch, bonus: ob.EntropyBonus | None) -> list[bool]:
    """Per prompt, whether its Y weights are all 0 (every advantage 0: a group of equal rewards), so that
    Y_n = 0 takes no backward (never with the entropy bonus, whose gradient every prompt carries)."""
    return [bonus is None and not bool(ctx.y_weights(unit, "cpu").any()) for _, unit in batch.microbatches(1)]


def copies_fit(params, n: int, budget_mb: float) -> bool:
    """Whether n parameter-sized buffers (the parameters' dtypes) fit ``budget_mb``."""
    return n * sum(p.numel() * p.element_size() for p in params) <= budget_mb * 2**20


def keeps_y(ctx: ProbeContext, B: int, budget_mb: float) -> bool:
    """Whether the B prompts' Y_n (parameter-sized, the gradients' dtype) fit ``budget_mb``."""
    return copies_fit(ctx.params, B, budget_mb)


def pair_copies(ctx: ProbeContext, n_y: int, B: int, budget_mb: float) -> torch.dtype | None:
    """The dtype the B prompts' J X_n are kept in for the pairs ``X_n . J Y_m`` (``rollout_ustat.pair_variance``)
    beside the n_y kept Y_n: the gradients' own when both fit ``budget_mb``, else bf16 (a variance
    term: bf16's 3 digits are plenty) when that fits, else None (no pair term)."""
    per = sum(p.numel() * p.element_size() for p in ctx.params)
    free = budget_mb * 2**20 - n_y * per
    if B * per <= free:
        return ctx.params[0].dtype if ctx.params else None
    if B * sum(p.numel() * 2 for p in ctx.params) <= free:
        return torch.bfloat16
    return None


def _loo_weights(c: float, k: float, B: int) -> tuple[float, float]:
    """``(a, b)`` with the step's gradient input without prompt n ``Ybar_{-n} = a y - b Y_n``:
    ``((B + k_n) Ybar - Y_n) / (B - 1)`` with ``Ybar = y / c`` (``rollout_ustat.leave_one_out``)."""
    return (B + k) / c / (B - 1), 1.0 / (B - 1)


def _loo_input(ctx: ProbeContext, y: pv.Buffer, Y: pv.Buffer | None, c: float, k: float, B: int,
               max_grad_norm: float | None, out: pv.Buffer) -> pv.Buffer:
    """The step's gradient input without prompt n (``_loo_weights``; Y_n None: 0), written into ``out``,
    clipped as the trainer clips (``clip_coefficient`` of its norm)."""
    a, b = _loo_weights(c, k, B)
    for i, (o, yt) in enumerate(zip(out, y)):
        torch.mul(yt, a, out=o)
        if Y is not None:
            o.sub_(Y[i].to(o.dtype), alpha=b)
    scale = clip_coefficient(pv.norm(out), max_grad_norm)
    if scale != 1.0:
        pv.scale_(out, scale)
    return out


_SLOT = {name: i for i, name in enumerate(ud.SLOTS)}


def _loo_coefficients(yY: float, y2: float, Y2: float, c: float, k: float, B: int, has_y: bool,
                      max_grad_norm: float | None) -> tuple[float, float]:
    """``(alpha, beta)`` with ``_loo_input``'s vector ``= alpha y - beta Y_n``, without writing it: the
    weights of ``_loo_weights`` (b = 0 without Y_n) times the trainer's clip factor of the norm
    ``|a y - b Y|^2 = a^2 |y|^2 - 2 a b y.Y + b^2 |Y|^2`` (``y2 = |y|^2``, ``Y2 = |Y_n|^2``, ``yY = y . Y_n``;
    needed only with ``max_grad_norm``)."""
    a, b = _loo_weights(c, k, B)
    b = b if has_y else 0.0
    scale = 1.0
    if max_grad_norm:
        scale = clip_coefficient(max(a * a * y2 - 2 * a * b * yY + b * b * Y2, 0.0) ** 0.5, max_grad_norm)
    return a * scale, b * scale


def _unit_dots(rows: list, loo: list, yy: list, yjx: torch.Tensor, xjyn: list, step: StepModel, moving: list[str],
               pairs: torch.Tensor | None) -> UnitDots:
    """The per-prompt dots as ``UnitDots`` (CPU): ``rows`` [J y, the parts at y], ``loo`` the moving parts
    without the prompt (the weight decay's is its part at y)."""
    rows = torch.stack(rows).cpu()
    e = rows[:, 1:]
    e_loo = e.clone()
    e_loo[:, [step.names.index(p) for p in moving]] = torch.stack(loo).cpu()
    return UnitDots(e, rows[:, 0], torch.stack(yy).cpu(), yjx.cpu(), torch.stack(xjyn).cpu(), e_loo, pairs)


def rollout_passes(ctx: ProbeContext, batch: RolloutBatch, step: StepModel, step_at: Callable[[pv.Buffer], StepModel],
                   y: pv.Buffer, c: float, max_grad_norm: float | None, budget_mb: float,
                   bonus: ob.EntropyBonus | None = None, bonus_effect: bool = False,
                   subset: list[int] | None = None, given: dict[int, PromptGrads] | None = None) -> RolloutPasses:
    """The per-prompt dots of the batch the optimizer is about to step on (module docstring).
    ``y``: the step's gradient input (minus ``.grad``, on the model's device), ``c`` its clip
    coefficient (``y = c Ybar``, 1 unclipped), ``max_grad_norm`` the trainer's clipping;
    ``step_at(y')``: the update's model at another gradient input (the update without prompt n);
    ``bonus``: the entropy bonus in the trainer's loss (None: none), ``bonus_effect``: also the
    per-prompt effect of the bonus per unit coefficient (module docstring); ``subset``: the prompts
    whose X_n and Y_n are formed (math/rollout_subset.py; None: all), each against the update without
    it of all B; the dots and S, entropies are then the subset's, in its order, Xbar its mean, and
    ``residual`` nan (Ybar over all B is not formed: the objective is not checked); ``given``: every
    prompt's passes made already (``PromptGrads`` by prompt, consumed: the trainer's step took their Y
    sum as its gradient, integrations/trl_fused.py), so that none is run here."""
    if step.jacobian_times_into is None:
        raise ValueError(f"source=rollouts needs the update's Jacobian in closed form (AdamW or SGD without "
                         f"clipping inside the optimizer); the step model here is {step.kind}")
    if batch.B < 3 or batch.G < 2:
        raise ValueError(f"source=rollouts: the batch has {batch.B} prompt(s) x {batch.G} response(s); the "
                         "cross-prompt U-statistic needs >= 3 prompts and >= 2 responses each")
    dev, B = ctx.device, batch.B
    units = list(range(B)) if subset is None else sorted(subset)
    k_units = len(units)
    prepare_x(ctx, batch)  # token_mean's constants from the batch
    coupling = ctx.objective.coupling
    k = [0.0] * B if coupling is None else [float(v) for v in coupling]
    moving = [p for p in step.names if p != "weight_decay"]  # the parts that depend on the gradient
    with ctx.phase("step_parts"):  # the Jacobian's diagonal J 1; row 0: J y; rows 1..: the update's parts
        jdt = torch.promote_types(ctx.buffers_dtype, torch.float32)
        jdiag = [torch.empty(p.shape, device=dev, dtype=jdt) for p in ctx.params]
        ones = torch.ones(max((p.numel() for p in ctx.params), default=0), device=dev, dtype=jdt)
        step.jacobian_times_into([ones[:p.numel()].view(p.shape) for p in ctx.params], jdiag)  # J 1: one ones buffer
        del ones
        fused = step.unit_dots is not None  # one blocked pass a prompt (math/unit_dots.py), no directions held
        dset = loo_set = y_loo = None
        if not fused:
            def j_times_y(out):
                for o, j, yt in zip(out, jdiag, y):
                    torch.mul(j, yt.to(o.dtype), out=o)
            dset = directions(ctx, [j_times_y], step, dev)
            loo_set = pv.empty_directions(len(moving), jdiag, dev, jdiag[0].dtype)
            y_loo = [torch.empty_like(t) for t in jdiag]
    y2 = pv.norm(y) ** 2 if fused and max_grad_norm else 0.0
    gH = jgh = None
    if bonus is not None or bonus_effect:
        with ctx.phase("rollouts_bonus"):
            gH = rb.bonus_gradient(ctx, batch)
            jgh = [j * g.to(j.dtype) for j, g in zip(jdiag, gH)] if bonus_effect else None
    fold = bonus is not None and rb.folds(ctx.objective)
    k_tok = [float(v) for v in ob.token_coupling(batch.gen_lengths)] if fold else None
    with_entropy = "grad" if bonus is not None else ctx.x.entropy
    bonus_units = torch.zeros(B, dtype=torch.float64) if bonus_effect else None
    # a prompt whose Y weights are all 0 (every advantage 0: a group of equal rewards) has Y_n = 0: no
    # Y backward, and (uncoupled objectives) the same update without it as every other such prompt
    zero_y = zero_y_prompts(ctx, batch, bonus)
    n_y = sum(not zero_y[n] for n in units)
    keep = keeps_y(ctx, n_y, budget_mb)
    pair_dtype = pair_copies(ctx, n_y, k_units, budget_mb) if keep else None
    kept_jx: dict[int, pv.Buffer] = {}  # J X_n of the prompts so far (in pair_dtype), for the pairs
    pairs = torch.zeros((B, B), dtype=torch.float64)
    Xsum = [torch.zeros_like(t) for t in jdiag]
    rows, loo, yy, xjyn, kept = [None] * B, [None] * B, [None] * B, [None] * B, {}
    S_all, ent_all = [None] * B, [None] * B
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    loo_of = None  # the prompt whose update without it loo_set holds (all zero-Y prompts share it)
    order = sorted(units, key=lambda n: not zero_y[n])  # the zero-Y prompts first
    ctx.zero_grad()
    with ctx.phase("rollouts_units"):
        for n in order:
            if given is not None:  # the passes ran already (the trainer's step took their Y sum)
                g = given.pop(n)
            else:
                with torch.enable_grad():
                    g = prompt_grads(ctx, batch, n, zero_y[n], with_entropy, bonus)
                if fold and g.Y is not None:
                    rb.fold_bonus_(g.Y, gH, bonus.coef, k_tok[n])
            S_n, ent_n, X, Y = g.S, g.ent, g.X, g.Y
            del g
            yy[n] = zero if Y is None else _dot(Y, y)
            if jgh is not None:
                bonus_units[n] = -float(_dot(X, jgh))
            for a_, t in zip(Xsum, X):
                a_.add_(t.to(a_.dtype))
            if fused:
                Y2 = float(_dot(Y, Y)) if Y is not None and max_grad_norm else 0.0
                alpha, beta = _loo_coefficients(float(yy[n]), y2, Y2, c, k[n], B, Y is not None, max_grad_norm)
                vals = step.unit_dots(X, Y, alpha, beta, jdiag)
                rows[n] = vals[[_SLOT["jy"]] + [_SLOT[p] for p in step.names]]
                loo[n] = vals[[_SLOT[p + "_loo"] for p in moving]]
                xjyn[n] = vals[_SLOT["jY"]]
            else:
                rows[n] = pv.dot_set(X, dset)
                shared = zero_y[n] and coupling is None
                if not (shared and loo_of is not None):
                    step_at(_loo_input(ctx, y, Y, c, k[n], B, max_grad_norm, y_loo)).write(
                        {p: loo_set.column(j) for j, p in enumerate(moving)})
                    loo_of = "zero" if shared else n
                loo[n] = pv.dot_set(X, loo_set)
                if Y is None:
                    xjyn[n] = zero
                else:
                    xjyn[n] = _dot(X, Y, jdiag)
            if pair_dtype is not None:  # (J X_n) . Y_m and (J X_m) . Y_n with every prompt m before it
                # J X_n written over X_n's own buffer, whose other uses are done: no parameter-sized
                # allocation (a fresh one is page-faulted: 1.1 s a prompt on SmolLM2), unless kept in bf16
                jx_n = [x.mul_(j.to(x.dtype)) if x.dtype == pair_dtype else (j * x.to(j.dtype)).to(pair_dtype)
                        for j, x in zip(jdiag, X)]
                for m_, jx_m in kept_jx.items():
                    if m_ in kept:
                        pairs[n, m_] = float(_dot(jx_n, kept[m_]))
                    if Y is not None:
                        pairs[m_, n] = float(_dot(jx_m, Y))
                kept_jx[n] = jx_n
            if Y is not None and keep:
                kept[n] = Y
            if pair_dtype is not None:
                pairs[n, n] = float(xjyn[n])
            S_all[n] = S_n
            ent_all[n] = ent_n
            del X, Y
    del loo_set, y_loo, kept_jx, jgh
    Xbar = pv.scale_(Xsum, 1.0 / k_units)
    if fused:  # Xbar . each part, before J's buffer takes J Xbar
        step_dots = [float(v) for v in step.unit_dots(Xbar, None, 1.0, 0.0, jdiag)[[_SLOT[p] for p in step.names]]]
    else:
        step_dots = [float(v) for v in pv.dot_set(Xbar, dset)[1:]]
    jx = [j.mul_(x.to(j.dtype)) for j, x in zip(jdiag, Xbar)]  # J Xbar, in J's buffer (no longer needed)
    if keep or all(zero_y[n] for n in units):
        yjx = torch.stack([_dot(kept[n], jx) if n in kept else zero for n in units])
        Ybar = None  # a subset's Y_n do not sum to the batch's gradient: no sum
        if subset is None:
            Ybar = kept.pop(min(kept)) if kept else [torch.zeros_like(t) for t in jx]  # the sum, in a kept Y_n
            for Y in kept.values():
                for a_, t in zip(Ybar, Y):
                    a_.add_(t)
        kept.clear()
    else:
        loss_of = y_loss_of(ctx) if bonus is None else (lambda fwd, mb: ctx.y_loss(fwd.S, mb) + bonus.y_loss(fwd.ent))
        with ctx.phase("rollouts_y"):
            acc = accumulate(ctx, batch if subset is None else batch.select(units), loss_of, "source=rollouts, Y . J Xbar",
                             directions=pv.stack_directions([jx], dev), unit_backward="loop",
                             with_entropy="grad" if bonus is not None else False)
        yjx, Ybar = acc.proj[:, 0].double(), acc.sum_buf
        if fold:  # the folded units' projections: Y_n' . J Xbar = Y_n . J Xbar - c k_n gH . J Xbar (the sum unchanged)
            g_jx = float(_dot(gH, jx))
            yjx = yjx - bonus.coef * g_jx * torch.tensor([k_tok[n] for n in units], dtype=torch.float64,
                                                         device=yjx.device)
    rows, loo, yy, xjyn = ([v[n] for n in units] for v in (rows, loo, yy, xjyn))
    S_all, ent_all = [S_all[n] for n in units], [ent_all[n] for n in units]
    if pair_dtype is not None and subset is not None:
        pairs = pairs[units][:, units]
    if bonus_units is not None and subset is not None:
        bonus_units = bonus_units[units]
    if subset is not None:  # Ybar over all B is the trainer's: y / c (no check of the objective here)
        del Ybar
        y_norm = pv.norm(y)
        return RolloutPasses(_unit_dots(rows, loo, yy, yjx, xjyn, step, moving, pairs if pair_dtype is not None else None),
                             step_dots, y_norm / c, y_norm ** 2 / c, y_norm, torch.cat(S_all),
                             torch.cat(ent_all) if ent_all[0] is not None else None, keep, Xbar, float("nan"),
                             bonus_units)
    Ybar = pv.scale_(Ybar, 1.0 / B)
    dots = _unit_dots(rows, loo, yy, yjx, xjyn, step, moving, pairs if pair_dtype is not None else None)
    residual = sum(float(torch.linalg.vector_norm(yt - c * Yt.to(yt.device, yt.dtype), dtype=torch.float64)) ** 2
                   for yt, Yt in zip(y, Ybar)) ** 0.5
    return RolloutPasses(dots, step_dots, pv.norm(Ybar), float(_dot(Ybar, y)), pv.norm(y), torch.cat(S_all),
                         torch.cat(ent_all) if ent_all[0] is not None else None, keep, Xbar, residual, bonus_units)
