"""Sample the E and U batches: B prompts x G responses from pi_theta, with rewards and advantages.

Layout of a ``RolloutBatch`` (all tensors on CPU, indexed [B, G, T]): columns [0, P) hold the
left-padded prompt, columns [P, T) the response, right-padded after EOS. ``response_mask`` is 1 on
generated tokens (EOS counts), ``attention_mask`` on every real token.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from entprobe.runtime import distributed as D
from entprobe.runtime.atomic_io import torch_save_atomic
from entprobe.runtime.input_files import InputFileError, load_torch_file
from entprobe.runtime.progress import TokenRate
from entprobe.rollouts import coupled_uniforms as cu
from entprobe.rollouts.streams import inverse_cdf, keyed_uniforms, row_keys  # noqa: F401 (re-exported)
from entprobe.rollouts.logprobs import position_ids_from_mask
from entprobe.tasks.prompt_ids import encode_prompts
from entprobe.tasks.base import score_rows


ABSURD = 1e6  # |advantage| or |reward| beyond it: a corrupt file, not a reward scale
LOGP_TOL = 1e-5  # a log-probability above it is not one (log_softmax is <= 0 up to rounding)
OPTIONAL_FIELDS = ("temperature", "sampler_entropy", "coupling_blocks", "entropy_mean")  # a saved batch may lack these


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, G, T] long
    attention_mask: torch.Tensor  # [B, G, T] long
    response_mask: torch.Tensor  # [B, G, T] long, 1 on generated tokens (EOS included)
    sampler_logprobs: torch.Tensor  # [B, G, T] fp32 log_softmax(logits/temp)[token], 0 off response
    rewards: torch.Tensor  # [B, G] fp32
    advantages: torch.Tensor  # [B, G] fp32
    prompt_index: torch.Tensor  # [B] long, index into task.prompts
    temperature: float = 1.0
    # [B, G, T] fp32 entropy of the sampling distribution log_softmax(logits/temp) at each generated
    # position, recorded while sampling (None: not recorded, e.g. batches saved before it was)
    sampler_entropy: torch.Tensor | None = None
    # [B, G] long: each response's block under sampling.coupling (coupled_uniforms.py); None: independent
    coupling_blocks: torch.Tensor | None = None
    # sum H / sum L over the batch's generated tokens at the parameters it is probed at, as a trainer's own
    # forward computed it (TRL's logged ``entropy``; token_mean's constant, accumulate.prepare_x); None: not given
    entropy_mean: float | None = None

    @property
    def B(self) -> int:
        return self.input_ids.shape[0]

    @property
    def G(self) -> int:
        return self.input_ids.shape[1]

    @property
    def gen_lengths(self) -> torch.Tensor:  # [B, G] generated tokens per response (EOS counts)
        return self.response_mask.sum(-1)

    @property
    def Lmax(self) -> torch.Tensor:  # [B] longest response of each prompt's group
        return self.gen_lengths.amax(-1)

    @property
    def S_sampler(self) -> torch.Tensor:  # [B, G] sequence log-prob recorded while sampling
        return self.sampler_logprobs.sum(-1)

    def select(self, idx) -> "RolloutBatch":
        """The prompts ``idx`` (a slice, list or tensor) as a new batch; units stay whole."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in kw.items():
            if isinstance(v, torch.Tensor):
                kw[k] = v[idx]
        return RolloutBatch(**kw)

    def microbatches(self, size: int):
        """Yield (start, sub-batch) over consecutive groups of ``size`` prompts."""
        for s in range(0, self.B, size):
            yield s, self.select(slice(s, min(s + size, self.B)))

    def flat(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, response_mask) as [B*G, T] tensors on ``device``."""
        T = self.input_ids.shape[-1]
        return tuple(t.reshape(-1, T).to(device, non_blocking=True)
                     for t in (self.input_ids, self.attention_mask, self.response_mask))

    def save(self, path: str | Path) -> None:
        """Atomically, through a unique temp file (``atomic_io``)."""
        torch_save_atomic(asdict(self), path)

    @classmethod
    def load(cls, path: str | Path, todo: str = "sample anew, or save the batches again") -> "RolloutBatch":
        """A batch written by ``save``; anything else is an ``InputFileError`` naming the file."""
        data = load_torch_file(path, "a saved batch", todo)
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not names >= set(data) or any(
                not isinstance(data.get(f.name), torch.Tensor) for f in fields(cls) if f.name not in OPTIONAL_FIELDS):
            raise InputFileError(f"{path}: not a batch written by entprobe (fields {sorted(names)}); {todo}")
        batch = cls(**data)
        wrong = batch.problem()
        if wrong:
            raise InputFileError(f"{path}: not a usable saved batch: {wrong}; {todo}")
        return batch

    def problem(self) -> str | None:
        """What makes this batch unusable, in words (None: nothing): shapes that do not fit
        ``[B, G, T]`` / ``[B, G]`` / ``[B]``, dtypes, masks other than 0/1, a response without
        tokens, negative token ids, sampler log-probs NaN or positive, advantages non-finite or
        beyond ``ABSURD``, rewards infinite or beyond it (NaN rewards are unscorable responses),
        a temperature that is not a positive number."""
        ids = self.input_ids
        if ids.dim() != 3 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            return f"input_ids must be integer token ids [B, G, T], not {ids.dtype} {tuple(ids.shape)}"
        B, G, T = ids.shape
        for name, want in (("attention_mask", (B, G, T)), ("response_mask", (B, G, T)),
                           ("sampler_logprobs", (B, G, T)), ("rewards", (B, G)), ("advantages", (B, G)),
                           ("prompt_index", (B,))):
            got = tuple(getattr(self, name).shape)
            if got != want:
                return f"{name} has shape {got}, input_ids [B, G, T] = {(B, G, T)} needs {want}"
        for name in ("sampler_logprobs", "rewards", "advantages"):
            if not getattr(self, name).dtype.is_floating_point:
                return f"{name} must be floating point, not {getattr(self, name).dtype}"
        for name in ("attention_mask", "response_mask"):
            if not bool(((getattr(self, name) == 0) | (getattr(self, name) == 1)).all()):
                return f"{name} holds values other than 0 and 1"
        empty = (self.response_mask.sum(-1) == 0).nonzero()
        if len(empty):
            b, g = (int(i) for i in empty[0])
            return f"response {g} of prompt {b} has no response tokens (response_mask all 0)"
        if ids.numel() and int(ids.min()) < 0:
            return f"negative token id {int(ids.min())} in input_ids"
        lp = self.sampler_logprobs
        if bool(lp.isnan().any()) or bool((lp > LOGP_TOL).any()):
            return "sampler_logprobs holds NaN or positive log-probabilities"
        A, r = self.advantages, self.rewards
        if not bool(A.isfinite().all()) or bool((A.abs() > ABSURD).any()):
            return f"advantages hold non-finite values or values beyond +-{ABSURD:g}"
        if bool(r.isinf().any()) or bool((r.abs() > ABSURD).any()):
            return f"rewards hold infinite values or values beyond +-{ABSURD:g}"
        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            return f"temperature {self.temperature!r} is not a positive number"
        h = self.sampler_entropy
        if h is not None and (tuple(h.shape) != (B, G, T) or not h.dtype.is_floating_point
                              or not bool(h.isfinite().all()) or bool((h < -LOGP_TOL).any())):
            return f"sampler_entropy must be finite entropies >= 0 of shape [B, G, T] = {(B, G, T)}"
        return cu.blocks_problem(self.coupling_blocks, B, G)

    def stats(self, prefix: str) -> dict[str, float]:
        """Reward mean/std, fraction of groups with zero reward variance, mean generated length."""
        r = self.rewards  # NaN: unscorable responses (every reward function returned None), left out
        return {
            f"{prefix}/reward_mean": r.nanmean().item(),
            f"{prefix}/reward_std": nan_std(r).item() if r.numel() > 1 else 0.0,
            f"{prefix}/frac_zero_var_groups": (nan_std(r, -1).nan_to_num(0.0) == 0).float().mean().item(),
            f"{prefix}/mean_gen_length": self.gen_lengths.float().mean().item(),
        }


def nan_std(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """Standard deviation with Bessel's correction over the non-NaN entries (TRL's ``nanstd``;
    ``torch.std`` itself when there is no NaN); NaN where fewer than two entries are left."""
    if not bool(x.isnan().any()):
        return x.std() if dim is None else x.std(dim, keepdim=keepdim)
    dims = dim if dim is not None else tuple(range(x.dim()))
    n = (~x.isnan()).sum(dims, keepdim=keepdim)
    var = ((x - x.nanmean(dims, keepdim=True)) ** 2).nansum(dims, keepdim=keepdim) / (n - 1)
    return var.sqrt()


def centred_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """``r - mean_g r`` [B, G], NaN rewards (unscorable responses) left out of the mean and kept NaN."""
    if not bool(rewards.isnan().any()):
        return rewards - rewards.mean(-1, keepdim=True)
    return rewards - rewards.nanmean(-1, keepdim=True)


def finish_advantages(A: torch.Tensor) -> torch.Tensor:
    """Advantages with unscorable responses (NaN reward) at 0: they carry no signal (TRL's rule)."""
    return torch.nan_to_num(A, nan=0.0)


def group_advantages(rewards: torch.Tensor, mode: str, eps: float = 1e-6) -> torch.Tensor:
    """``dr_grpo``: A = r - mean_g r. ``grpo``: A = (r - mean_g r) / (std_g r + eps) (unbiased std).
    NaN rewards (unscorable) are left out of the group's statistics and get A = 0."""
    centred = centred_rewards(rewards)
    if str(mode) in ("grpo", "AdvantageMode.grpo"):
        centred = centred / (nan_std(rewards, -1, keepdim=True) + eps)
    return finish_advantages(centred)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus (top-p) truncation; removed entries set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return logits


def kv_cache_key(model) -> str:
    """The forward's KV-cache argument: ``cache`` (transformers >= 5.2x, where ``past_key_values``
    is deprecated) or ``past_key_values`` (earlier releases)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _kv_cache(out):
    """The KV cache of a forward's output, under its current name or the former one."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def generate(model, prompt_ids: list[list[int]], G: int, max_new_tokens: int, eos_id: int,
             pad_id: int, temperature: float, top_k: int, top_p: float,
             seed: int, device, first_prompt: int = 0, stop_together: bool = False,
             on_tokens=None, coupling=None) -> tuple[list[list[int]], list[list[int]], list[list[float]], list[list[float]]]:
    """Sample G responses per prompt with a KV cache; returns per-row prompt ids, response ids,
    per-token ``log_softmax(logits / temperature)`` of each sampled token and the entropy of that
    distribution at each position (rows = prompt-major).

    Each row draws from its own stream (``row_keys``: seed, prompt position ``first_prompt + i``
    in the whole batch, response index): token t of a row is the inverse-CDF pick of the row's
    t-th uniform on its (filtered) probabilities. A token that flips in one response (an ulp of a
    logit on another machine) changes that response only; B prompts are a prefix of 2B.

    ``stop_together``: every rank of the process group runs as many forward calls (the loop ends
    when every rank's rows are done), as a model sharded with FSDP2 needs (each call all-gathers).
    ``on_tokens(n)``: called after each decoding step with the number of tokens it sampled (a
    progress bar's tokens per second). ``coupling``: a ``coupled_uniforms.Coupling`` (None: every
    response independent, as above): a prompt's responses then take coupled uniforms, each response's
    marginal exact (rollouts/coupled_uniforms.py). Runs under ``no_grad``: no pass here needs a graph, and
    with autograd on every decoding step's graph would stay alive until the loop ends."""
    rows = [p for p in prompt_ids for _ in range(G)]
    N, P = len(rows), max(len(p) for p in rows)
    r = torch.arange(N)
    keys = row_keys(seed, first_prompt + r // G, r % G)
    pkeys = None if coupling is None else cu.perm_keys(seed, first_prompt + r // G, r % G)
    ids = torch.full((N, P), pad_id, dtype=torch.long)
    mask = torch.zeros((N, P), dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                use_cache=True)
    cache_key = kv_cache_key(model)
    past, logits = _kv_cache(out), out.logits[:, -1].float()
    done = torch.zeros(N, dtype=torch.bool, device=device)
    toks, lps, ents = [], [], []
    for step in range(max_new_tokens):
        logp = (logits / temperature).log_softmax(-1)
        ents.append(-(logp.exp() * logp).sum(-1))
        probs = filter_logits(logp, top_k, top_p).softmax(-1)
        nxt = (inverse_cdf(probs, keyed_uniforms(keys, step)) if coupling is None
               else cu.draw(probs, keys, pkeys, step, coupling, G))
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        toks.append(torch.where(done, -1, nxt))
        lps.append(logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1))
        if on_tokens is not None:
            on_tokens(int((~done).sum()))
        done = done | (nxt == eos_id)
        if D.all_true(bool(done.all())) if stop_together else done.all():
            break
        mask = torch.cat([mask, (toks[-1] >= 0).long().unsqueeze(-1)], dim=1)
        out = model(input_ids=nxt.unsqueeze(-1), attention_mask=mask,
                    position_ids=(mask.sum(-1, keepdim=True) - 1), use_cache=True, **{cache_key: past})
        past, logits = _kv_cache(out), out.logits[:, -1].float()
    tok = torch.stack(toks, 1).cpu()
    lp = torch.stack(lps, 1).cpu()
    ent = torch.stack(ents, 1).cpu()
    responses, logprobs, entropies = [], [], []
    for i in range(N):
        keep = tok[i] >= 0
        responses.append(tok[i][keep].tolist())
        logprobs.append(lp[i][keep].tolist())
        entropies.append(ent[i][keep].tolist())
    return rows, responses, logprobs, entropies


def assemble(prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]],
             G: int, pad_id: int, entropies: list[list[float]] | None = None) -> tuple[torch.Tensor, ...]:
    """Pack rows into [B, G, T] tensors: prompts left-padded to P, responses right-padded (ids,
    attention mask, response mask, log-probs, and with ``entropies`` the entropies)."""
    N = len(prompts)
    P, R = max(len(p) for p in prompts), max(1, max(len(r) for r in responses))
    T = P + R
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    att = torch.zeros((N, T), dtype=torch.long)
    resp = torch.zeros((N, T), dtype=torch.long)
    lp = torch.zeros((N, T), dtype=torch.float32)
    ent = torch.zeros((N, T), dtype=torch.float32) if entropies is not None else None
    for i, (p, r, l) in enumerate(zip(prompts, responses, logprobs)):
        ids[i, P - len(p):P] = torch.tensor(p)
        att[i, P - len(p):P + len(r)] = 1
        if r:
            ids[i, P:P + len(r)] = torch.tensor(r)
            resp[i, P:P + len(r)] = 1
            lp[i, P:P + len(r)] = torch.tensor(l)
            if ent is not None:
                ent[i, P:P + len(r)] = torch.tensor(entropies[i])
    return tuple(t.view(N // G, G, T) for t in (ids, att, resp, lp) + ((ent,) if ent is not None else ()))


def sample_batch(model, tokenizer, task, prompt_index: torch.Tensor, G: int, sampling, seed: int,
                 advantage: str, adv_eps: float, chat_template: str = "auto",
                 system_prompt: str | None = None, progress: str | None = None, style: str = "entprobe",
                 template_kwargs: dict | None = None, stop_together: bool = False,
                 coupling=None) -> RolloutBatch:
    """Sample G responses for each prompt in ``prompt_index`` (reproducible from ``seed``; each
    response from its own stream keyed by its prompt's position in ``prompt_index``, see
    ``generate``: the first k prompts draw the same responses whatever follows them), the
    prompts tokenized under the convention ``style`` (``prompt_ids``), the rewards the task's
    (``tasks.score_rows``: its reward functions called once on the whole batch). ``stop_together``:
    see ``generate`` (every rank must then sample the same number of prompts). ``progress``: the
    label of a progress bar over the prompts, with the tokens sampled per second (None: no bar).
    ``coupling``: coupled draws within each prompt (``coupled_uniforms.coupling_spec``; None: independent)."""
    if sampling.top_k or sampling.top_p < 1.0:
        warnings.warn("truncated sampling (top_k/top_p) draws from a distribution other than "
                      "pi_theta: every entropy estimator is biased. Use top_k=0, top_p=1 for "
                      "trustworthy numbers.", stacklevel=2)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    all_p, all_r, all_l, all_h = [], [], [], []
    idx = prompt_index.tolist()
    chunk = sampling.gen_microbatch_prompts
    bar = TokenRate(progress, len(idx), G)
    try:
        for s in range(0, len(idx), chunk):
            texts = [task.prompts[i].source for i in idx[s:s + chunk]]
            ids = encode_prompts(tokenizer, texts, str(getattr(chat_template, "value", chat_template)), system_prompt,
                                 style, template_kwargs)
            p, r, l, h = generate(model, ids, G, sampling.max_new_tokens, eos, pad, sampling.temperature,
                                  sampling.top_k, sampling.top_p, seed, device, first_prompt=s,
                                  stop_together=stop_together, on_tokens=bar.tokens, coupling=coupling)
            all_p += p; all_r += r; all_l += l; all_h += h
            bar.prompts(len(texts))
    finally:
        bar.close()
    model.train(was_training)
    ids, att, resp, lp, ent = assemble(all_p, all_r, all_l, G, pad, all_h)
    rows = [task.prompts[idx[i // G]] for i in range(len(all_r))]
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in all_r]
    rewards = score_rows(task, rows, texts, all_r).to(torch.float32).view(len(idx), G)
    adv = group_advantages(rewards, advantage, adv_eps)
    blocks = None if coupling is None else cu.coupling_blocks(len(idx), G, coupling.block)
    return RolloutBatch(ids, att, resp, lp, rewards, adv, prompt_index.clone(), float(sampling.temperature), ent,
                        blocks)


def draw_prompt_indices(num_prompts: int, B: int, seed: int) -> torch.Tensor:
    """B distinct prompt indices drawn uniformly (with replacement once B exceeds the pool)."""
    gen = torch.Generator().manual_seed(int(seed) + 7919)
    if B <= num_prompts:
        return torch.randperm(num_prompts, generator=gen)[:B]
    return torch.randint(num_prompts, (B,), generator=gen)
