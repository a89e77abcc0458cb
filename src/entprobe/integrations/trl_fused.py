"""``EntropyProbeCallback(..., fused_backward=True)``: on a probed step, the trainer's gradient is the sum of
the probe's per-prompt passes, and the trainer's own backward is not run.

The rollouts probe (``source="rollouts"``) takes, per prompt n of the step's batch, a forward, the X
backward and the Y backward of the trainer's loss (stages/rollout_passes.py). Its Y_n sum to the
trainer's gradient: ``.grad = -(1/B) sum_n Y_n`` (the objective's units, ``y = c Ybar``), to fp32
rounding once the objective has been checked against the trainer's own ``.grad`` on a whole batch. So on
a probed step the trainer's backward repeats work the probe does anyway. With ``fused_backward=True``,
TRL's ``compute_loss`` runs as it does but without a graph (its forward, its logged metrics and the loss
value it returns), then the probe's passes run, ``.grad`` is set to their Y sum, and the loss goes back detached, so the
trainer's ``backward()`` touches no parameter. The probe later takes the same passes from memory
(``rollout_passes(given=...)``): its cost is then its passes less the trainer's backward.

A step is fused only when all of these hold (else the trainer and the probe run as without it):
- an earlier probe of the run checked the objective against the trainer's gradient on a whole batch, and
  the relative difference ``rollouts/grad_residual`` was at most ``FUSE_RESIDUAL`` (1000 fp32 eps; the rounding
  of one batched backward against per-prompt ones is ~1 eps; another loss, dropout or a mask is far above it);
- one micro-batch a step (``gradient_accumulation_steps=1``), no entropy bonus in the loss, every prompt
  probed (no ``probe.rollouts_prompts`` subset);
- all B prompts' X_n and Y_n fit ``probe.unit_grads_budget_mb`` (2 B parameter-sized buffers, as many
  as the probe keeps at its peak without fusing).

What changes for the run: the gradient of a fused step is the per-prompt sum, not TRL's batched
backward's, so it differs from TRL's in the last bits (fp32 rounding of the sum's order). AdamW can
carry that further for entries whose gradient is at the rounding level (their update is about
``lr sign(m)`` early on), so the run after it is not bit-identical to an unprobed one. Each fused probe logs ``rollouts/fused_backward``
(1) beside its ``rollouts/grad_residual`` (the check of the sum against the gradient the optimizer
stepped on, rounding only).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from entprobe.pipeline.api import left_as_it_was
from entprobe.pipeline.in_memory import probe_context
from entprobe.pipeline.stages.accumulate import prepare_x
from entprobe.pipeline.stages.rollout_passes import PromptGrads, copies_fit, prompt_grads, zero_y_prompts
from entprobe.rollouts import objectives as ob
from entprobe.rollouts.logprobs import autocast_dtype
from entprobe.rollouts.sampling import RolloutBatch

# rollouts/grad_residual at most this on a checked probe: the objective is the trainer's loss to fp32 rounding
# (one batched backward against per-prompt ones: ~1 eps measured; a bf16 model's gradient is far above it)
FUSE_RESIDUAL = 1e3 * torch.finfo(torch.float32).eps


@dataclass
class FusedPasses:
    """The step's per-prompt passes made inside the trainer's ``compute_loss`` (``units`` by prompt), the
    batch they were made on, and what they took (wall and CPU seconds)."""
    step: int
    batch: RolloutBatch
    units: dict[int, PromptGrads]
    wall_s: float
    cpu_s: float


def fits(params: list[torch.nn.Parameter], B: int, budget_mb: float) -> bool:
    """Whether B prompts' X_n and Y_n (2 B parameter-sized buffers in the parameters' dtypes) fit ``budget_mb``."""
    return copies_fit(params, 2 * B, budget_mb)


def per_prompt_passes(probe, batch: RolloutBatch) -> dict[int, PromptGrads]:
    """Every prompt's forward, X and Y backward at theta (``prompt_grads``), the objective bound to the
    batch and token_mean's constant prepared as ``rollouts_prediction`` does; then each trainable
    parameter's ``.grad`` set to ``-(1/B) sum_n Y_n``, the trainer's gradient of the batch. Modes, RNG and
    the optimizer are as ``OnlineProbe.before_step`` leaves them (``left_as_it_was``)."""
    cfg, model = probe.cfg, probe.model
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    with left_as_it_was(model, probe.optimizer, None):
        ctx = probe_context(cfg, model, device, autocast_dtype(cfg.model, device))
        ctx.objective = ob.bind(cfg.objective, batch.rewards, batch.gen_lengths, cfg.sampling.max_new_tokens)
        prepare_x(ctx, batch)
        zero_y = zero_y_prompts(ctx, batch, None)
        with torch.enable_grad():
            units = {n: prompt_grads(ctx, batch, n, zero_y[n], ctx.x.entropy) for n in range(batch.B)}
    grads = [torch.zeros_like(p) for p in params]
    for u in units.values():
        if u.Y is not None:
            for g, y in zip(grads, u.Y):
                g.sub_(y.to(g.dtype))
    for p, g in zip(params, grads):
        p.grad = g.div_(batch.B)
    return units


class FusedBackward:
    """Wraps the trainer's ``compute_loss`` (on the instance) so that a step the callback fuses
    (``callback.fusable(step)``) takes its gradient from ``per_prompt_passes`` (module docstring), TRL's
    own forward then run without a graph (its loss value and metrics are all it gives there);
    ``take(step)`` hands the passes to the probe. ``uninstall()`` puts the method back."""

    def __init__(self, callback):
        self.callback = callback
        self.pending: FusedPasses | None = None
        self._trainer = None

    def install(self, trainer) -> None:
        self.uninstall()
        self._trainer, self._own = trainer, trainer.__dict__.get("compute_loss")
        own = trainer.compute_loss

        def compute_loss(model, inputs, *args, **kwargs):
            step = trainer.state.global_step + 1
            if not self.callback.fusable(step):
                return own(model, inputs, *args, **kwargs)
            with torch.no_grad():  # TRL's forward for its loss value and its metrics only: no graph kept
                loss = own(model, inputs, *args, **kwargs)
            t0, c0 = time.perf_counter(), time.process_time()
            batch = self.callback.step_batch_now()  # after TRL's forward: its logged entropy is this step's
            units = per_prompt_passes(self.callback.probe, batch)
            self.pending = FusedPasses(step, batch, units, time.perf_counter() - t0, time.process_time() - c0)
            return loss.detach().requires_grad_()  # the trainer's backward() reaches no parameter
        trainer.compute_loss = compute_loss

    def take(self, step: int) -> FusedPasses | None:
        """The passes made for ``step`` (None when it was not fused), handed over once."""
        out, self.pending = self.pending, None
        return out if out is not None and out.step == step else None

    def uninstall(self) -> None:
        tr, self.pending = self._trainer, None
        if tr is None:
            return
        if self._own is None:
            tr.__dict__.pop("compute_loss", None)
        else:
            tr.compute_loss = self._own
        self._trainer = None
