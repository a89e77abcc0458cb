"""What every stage needs to run forward passes: the model, its trainable parameters, settings,
pass counters and per-phase timings."""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field

import torch

from entprobe.runtime import distributed as D
from entprobe.runtime import sharding
from entprobe.rollouts.logprobs import check_finite, token_logprobs
from entprobe.rollouts.objectives import ENTPROBE, Objective
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.pipeline.stages.x_spec import Forward, XSpec


@dataclass
class PhaseStats:
    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # this process's CPU time (all threads)
    peak_mem_mb: dict[str, float] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=dict)  # forward / backward / jvp (sequences x passes)

    def count(self, kind: str, n: int = 1) -> None:
        self.passes[kind] = self.passes.get(kind, 0) + n

    def flat(self) -> dict[str, float]:
        out = {f"time/{k}_s": v for k, v in self.seconds.items()}
        out.update({f"mem/{k}_peak_mb": v for k, v in self.peak_mem_mb.items()})
        out.update({f"passes/{k}": v for k, v in self.passes.items()})
        return out


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process high-water mark
    except Exception:
        return float("nan")


DEVICE_SHARE = 0.25  # what an ``auto`` placement may take of a CUDA device's free memory
PROBE_BUFFERS = 5  # parameter-sized buffers of Stages 1-2: P, the Xbar and Ybar sums, P Ybar, P Xbar


def device_budget_bytes(device: torch.device, reserved: float = 0.0) -> float:
    """Bytes an ``auto`` placement may take on ``device``: ``DEVICE_SHARE`` of its free memory
    less ``reserved`` (placements already decided but not yet allocated). Unbounded off CUDA,
    where the model's memory is the host's and nothing is moved."""
    if device.type != "cuda":
        return float("inf")
    return max(torch.cuda.mem_get_info(device)[0] - reserved, 0.0) * DEVICE_SHARE


def resolve_buffers_device(spec: str, params, dtype: torch.dtype) -> torch.device:
    """Where the parameter-sized buffers live (``probe.buffers_device``).

    ``auto``: on the model's device when ``PROBE_BUFFERS`` buffers of ``dtype`` fit
    ``device_budget_bytes`` on every rank (one collective decides for all), else on the CPU,
    where every gradient sum is a device-to-host copy (about 15x slower on an H100 with
    SmolLM2, benchmarks/README.md). ``model``: the model's device; else a torch device string."""
    dev = params[0].device
    if spec == "model":
        return dev
    if spec != "auto":
        return torch.device(spec)
    if dev.type != "cuda":
        return dev
    need = PROBE_BUFFERS * sum(sharding.local(p).numel() for p in params) * dtype.itemsize
    fits = need <= device_budget_bytes(dev)
    return dev if D.reduce_scalars(float(fits))[0] == D.world() else torch.device("cpu")


def model_dims(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(vocab, hidden, intermediate) from an HF-style ``model.config``; None when unknown."""
    conf = getattr(getattr(model, "module", model), "config", None)
    conf = getattr(conf, "get_text_config", lambda: conf)() if conf is not None else None
    V, h = getattr(conf, "vocab_size", None), getattr(conf, "hidden_size", None)
    if not V or not h:
        return None
    return int(V), int(h), int(getattr(conf, "intermediate_size", None) or 4 * h)


def nograd_prompts(G: int, T: int, T_logits: int, dims: tuple[int, int, int], budget_mb: float,
                   tangent: bool) -> int:
    """Prompts per microbatch of a pass that keeps no graph, within ``budget_mb``.

    Such a pass holds the fp32 logits over the vocabulary for the kept positions -- with their
    log-softmax temporaries, and a tangent for each in forward mode: ``k = 3`` (eval) or ``6``
    (jvp) tensors of ``[G, T_logits, V]`` per prompt -- plus one layer's activations at a time,
    ``~2 (h + ff)`` floats per token (doubled with a tangent). Bytes per prompt:
    ``4 G (k T_logits V + c T (h + ff))``; the result is ``floor(budget / that)`` (>= 0).
    """
    V, h, ff = dims
    k, c = (6, 4) if tangent else (3, 2)
    per_prompt = 4.0 * G * (k * T_logits * V + c * T * (h + ff))
    return int(budget_mb * 2**20 // per_prompt)


@dataclass
class ProbeContext:
    model: torch.nn.Module  # the (possibly DDP-wrapped) module whose forward is called
    names: list[str]  # trainable parameter names, in order
    params: list[torch.nn.Parameter]
    device: torch.device
    autocast_dtype: torch.dtype | None
    temperature: float
    weighting_mode: str
    mb_size: int
    buffers_device: torch.device
    buffers_dtype: torch.dtype
    progress: bool = False
    nograd_memory_mb: float = 1024.0
    stats: PhaseStats = field(default_factory=PhaseStats)
    objective: Objective = ENTPROBE  # the update objective bound to U (objectives.bind)
    x: XSpec | None = None  # X's functional and estimator (None: the weighting mode's score form)

    def __post_init__(self):
        if self.x is None:
            self.x = XSpec(getattr(self.weighting_mode, "value", self.weighting_mode), "score")

    def y_loss(self, S: torch.Tensor, mb: RolloutBatch) -> torch.Tensor:
        """The objective's ``sum_n sum_g w[n,g] S[n,g]`` on microbatch ``mb``: gradient ``sum_n Y_n``."""
        return self.objective.y_loss(S, mb.advantages.to(S.device), mb.gen_lengths.to(S.device),
                                     mb.Lmax.to(S.device))

    def y_weights(self, mb: RolloutBatch, device) -> torch.Tensor:
        """The objective's per-unit weights ``w[n,g]`` of ``Y_n = sum_g w grad S`` on ``mb``."""
        return self.objective.unit_weights(mb.advantages.to(device), mb.gen_lengths.to(device), mb.Lmax.to(device))

    def nograd_mb(self, batch: RolloutBatch, tangent: bool, fixed: int | None = None) -> int:
        """Prompts per microbatch for a pass without a graph over ``batch``: ``fixed`` when set,
        else as many as fit ``nograd_memory_mb`` (``nograd_prompts``), never fewer than the
        gradient passes' ``mb_size`` (a no-graph pass needs less than a training microbatch)
        and never more than the batch."""
        if fixed is not None:
            return fixed
        dims = model_dims(self.model)
        if dims is None or batch.B == 0:
            return self.mb_size
        T = batch.input_ids.shape[-1]
        cols = batch.response_mask.reshape(-1, T).bool().any(0).nonzero()
        T_logits = T - int(cols[0]) + 1 if cols.numel() else T
        fit = nograd_prompts(batch.G, T, T_logits, dims, self.nograd_memory_mb, tangent)
        return max(self.mb_size, min(fit, batch.B))

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a phase (wall clock and process CPU time) and record the peak memory reached inside it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.stats.seconds[name] = self.stats.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.stats.cpu_seconds[name] = self.stats.cpu_seconds.get(name, 0.0) + time.process_time() - c0
            self.stats.peak_mem_mb[name] = _peak_mb(self.device)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def forward_S(self, mb: RolloutBatch, what: str, with_entropy: bool | str = False, model=None) -> Forward:
        """Sequence log-probs S [b, G] (with graph when grad is enabled), token log-probs and
        token entropies [b, G, T] (``with_entropy="grad"``: differentiable too). ``model``
        overrides the callable (forward-mode AD)."""
        ids, att, resp = mb.flat(self.device)
        tl = token_logprobs(model or self.model, ids, att, resp, self.temperature,
                            with_entropy=with_entropy, autocast_dtype=self.autocast_dtype)
        shape = (mb.B, mb.G, ids.shape[-1])
        S = tl.logp.sum(-1).view(mb.B, mb.G)
        check_finite(S.detach(), what)
        if is_filler(mb):  # a collective pass only: no gradient, no count (runtime/sharding.py)
            zero = tl.entropy.view(shape) * 0.0 if tl.entropy is not None and tl.entropy.requires_grad else None
            return Forward(S * 0.0, tl.logp.view(shape) * 0.0, zero)
        self.stats.count("forward", mb.B * mb.G)
        ent = tl.entropy.view(shape) if tl.entropy is not None else None
        return Forward(S, tl.logp.view(shape), ent)

    def iterate(self, batch: RolloutBatch, size: int, desc: str):
        """Microbatches of ``size`` prompts with an optional progress bar. Under FSDP2 ranks with
        fewer microbatches than the busiest rank end with filler microbatches (``is_filler``:
        a pass whose log-probs are multiplied by 0; callers drop its outputs)."""
        n = (batch.B + size - 1) // size
        it = batch.microbatches(size)
        if sharding.sharded():
            missing = sharding.max_over_ranks(n) - n
            it = itertools.chain(it, ((batch.B, filler(batch)) for _ in range(missing)))
        if self.progress:
            from tqdm.auto import tqdm
            it = tqdm(it, total=n, desc=desc, leave=False)
        return it


def filler(batch: RolloutBatch) -> RolloutBatch:
    """A one-prompt microbatch that only keeps the ranks' collective passes in step (FSDP2)."""
    mb = batch.select(0)
    mb.filler = True
    return mb


def is_filler(mb: RolloutBatch) -> bool:
    return getattr(mb, "filler", False)
