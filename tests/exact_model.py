"""An exactly enumerable policy for testing estimators (DESIGN.md §6).

Vocabulary: pad, bos, eos, 'a', 'b', 'c' (6 tokens; the policy may emit any of them). Responses
have at most 3 generated tokens and EOS ends one early, so each prompt has 1 + 5 + 25 + 125 = 156
possible responses. Everything
the estimators target can then be computed exactly: H(theta), grad H, H(theta_plus), and the
probability of every response.

    setup = make_setup()
    E = setup.sample(B=8, G=4, seed=1)              # a RolloutBatch from pi_theta
    H = setup.exact_entropy()                      # mean over the prompt pool of -sum_t p(t) log p(t)
    gH = setup.exact_grad_entropy()                # list aligned with setup.params
"""
from __future__ import annotations

from pathlib import Path

import contextlib
import itertools
from dataclasses import dataclass, field

import torch

from entprobe.math import paramvec as pv
from entprobe.checkpoints.builtin import build_char_tokenizer, build_tiny_llama
from entprobe.config import SamplingConfig
from entprobe.rollouts.logprobs import token_logprobs
from entprobe.rollouts.sampling import RolloutBatch, encode_prompts, sample_batch
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.tasks.base import Prompt

CONTENT = ["a", "b", "c"]
MAX_NEW = 3


class ExactTask:
    """Three prompts; reward 1 when the response starts with the prompt's last character."""

    def __init__(self):
        self.prompts = [Prompt("ab", "b"), Prompt("ba", "a"), Prompt("cc", "c")]

    def reward(self, response: str, prompt: Prompt) -> float:
        return float(response.startswith(prompt.answer))


@dataclass
class ExactSetup:
    model: torch.nn.Module
    tokenizer: object
    task: ExactTask
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=MAX_NEW))
    key: str = ""  # which committed training batches build its AdamW state (``adamw_with_state``)

    @property
    def names(self):
        return pv.trainable(self.model)[0]

    @property
    def params(self):
        return pv.trainable(self.model)[1]

    def sample(self, B: int, G: int, seed: int, advantage: str = "dr_grpo",
               prompt_index: torch.Tensor | None = None) -> RolloutBatch:
        """B prompts drawn uniformly from the pool (with replacement), G responses each."""
        if prompt_index is None:
            gen = torch.Generator().manual_seed(seed + 17)
            prompt_index = torch.randint(len(self.task.prompts), (B,), generator=gen)
        return sample_batch(self.model, self.tokenizer, self.task, prompt_index, G, self.sampling, seed,
                            advantage, 1e-6, "never")

    def ctx(self, weighting_mode: str = "sequence", mb_size: int = 2) -> ProbeContext:
        names, params = pv.trainable(self.model)
        return ProbeContext(self.model, names, params, torch.device("cpu"), None, 1.0, weighting_mode,
                            mb_size, torch.device("cpu"), torch.float64)

    # ------------------------------------------------------------------ exact enumeration
    def all_responses(self) -> list[list[int]]:
        eos = self.tokenizer.eos_token_id
        ids = [i for i in range(len(self.tokenizer)) if i != eos]  # pad and bos can be sampled too
        out = [[eos]]
        for k in range(1, MAX_NEW):
            out += [list(t) + [eos] for t in itertools.product(ids, repeat=k)]
        out += [list(t) for t in itertools.product(ids, repeat=MAX_NEW)]
        return out

    def _tensors(self, prompt: str):
        p = encode_prompts(self.tokenizer, [prompt], "never")[0]
        resp = self.all_responses()
        T = len(p) + MAX_NEW
        ids = torch.zeros((len(resp), T), dtype=torch.long)
        att = torch.zeros_like(ids)
        rm = torch.zeros_like(ids)
        for i, r in enumerate(resp):
            ids[i, :len(p)] = torch.tensor(p)
            ids[i, len(p):len(p) + len(r)] = torch.tensor(r)
            att[i, :len(p) + len(r)] = 1
            rm[i, len(p):len(p) + len(r)] = 1
        return ids, att, rm

    def response_logprobs(self, prompt: str) -> torch.Tensor:
        """log pi(t | prompt) for every enumerated response [156] (differentiable)."""
        ids, att, rm = self._tensors(prompt)
        return token_logprobs(self.model, ids, att, rm).logp.sum(-1)

    def exact_entropy(self) -> torch.Tensor:
        """H(theta) = mean_prompts -sum_t p(t) log p(t) (sequence level, nats), differentiable."""
        Hs = []
        for pr in self.task.prompts:
            S = self.response_logprobs(pr.text)
            Hs.append(-(S.exp() * S).sum())
        return torch.stack(Hs).mean()

    def exact_grad_entropy(self) -> list[torch.Tensor]:
        H = self.exact_entropy()
        gs = torch.autograd.grad(H, self.params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(gs, self.params)]

    def exact_expected_reward(self) -> torch.Tensor:
        """J(theta) = mean_prompts sum_t p(t) r(t), differentiable."""
        Js = []
        for pr in self.task.prompts:
            S = self.response_logprobs(pr.text)
            r = torch.tensor([self.task.reward(self.tokenizer.decode(t, skip_special_tokens=True), pr)
                              for t in self.all_responses()])
            Js.append((S.exp() * r).sum())
        return torch.stack(Js).mean()


TRAINING_DATA = Path(__file__).resolve().parent / "data" / "exact_training"

# The LoRA variant's adapter, rank 2: peft's default Llama targets (q_proj, v_proj) and the head.
LORA_TARGETS = ["q_proj", "v_proj", "lm_head"]


def make_setup(seed: int = 0, hidden: int = 16, lora: bool = False) -> ExactSetup:
    """A tiny random Llama (fp64 for tight comparisons) over the 6-token vocabulary. ``lora``: the
    same model frozen under a peft LoRA adapter (``LORA_TARGETS``, rank 2, B initialised to zero
    as peft does), whose parameters are then the only trainable ones."""
    tok = build_char_tokenizer(CONTENT)
    model = build_tiny_llama(len(tok), seed=seed, hidden=hidden, layers=1, heads=2, max_positions=16)
    with torch.no_grad():  # sharpen the policy a little so that entropy gradients are sizeable
        model.lm_head.weight.mul_(4.0)
    if lora:
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                     target_modules=LORA_TARGETS))
    model.double()
    model.train()
    return ExactSetup(model, tok, ExactTask(), key=f"seed{seed}{'-lora' if lora else ''}" if hidden == 16 else "")


def fixed_batch(setup: ExactSetup, B: int, G: int, seed: int, state: str = "") -> RolloutBatch:
    """``setup.sample(B, G, seed)`` as the exact tests were calibrated on it: the committed draw
    (tests/data/exact_training/<key>[-<state>]-U<B>x<G>-s<seed>.pt; ``state`` "untrained" for a
    setup without ``adamw_with_state``) where there is one, else sampled now."""
    path = TRAINING_DATA / f"{setup.key}{'-' + state if state else ''}-U{B}x{G}-s{seed}.pt"
    if setup.key and path.is_file():
        return RolloutBatch(**torch.load(path, weights_only=True))
    return setup.sample(B, G, seed)


def adamw_with_state(setup: ExactSetup, steps: int = 20, lr: float = 1e-2, weight_decay: float = 0.1,
                     seed: int = 100) -> torch.optim.AdamW:
    """An AdamW whose state comes from real DR-GRPO steps (momentum, second moments, step count).

    With the defaults, each step's batch is the committed one (tests/data/exact_training/<key>.pt,
    drawn by the sampler the exact tests were calibrated with): the state is the same on every
    machine and under any sampler, and the documented coverages refer to it. Otherwise (or for a
    setup without a key) the batches are sampled on-policy as the state is built."""
    from entprobe.math.estimators import y_loss

    recorded = TRAINING_DATA / f"{setup.key}.pt"
    replay = None
    if setup.key and (steps, lr, weight_decay, seed) == (20, 1e-2, 0.1, 100) and recorded.is_file():
        replay = [RolloutBatch(**b) for b in torch.load(recorded, weights_only=True)]
    opt = torch.optim.AdamW(setup.params, lr=lr, weight_decay=weight_decay)
    for s in range(steps):
        U = replay[s] if replay is not None else setup.sample(4, 4, seed + s)
        ids, att, rm = U.flat("cpu")
        S = token_logprobs(setup.model, ids, att, rm).logp.sum(-1).view(U.B, U.G)
        loss = -y_loss(S, U.advantages.double(), U.Lmax) / U.B
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


# ------------------------------------------------------------------ every response's gradient
@dataclass
class Enumerated:
    """Every response of every prompt at the current parameters, prompt-major ([3 K] rows)."""
    J: torch.Tensor  # [3K, D] grad S of every response (flat over setup.params)
    S: torch.Tensor  # [3K] log-prob of every response
    R: torch.Tensor  # [3K] reward
    L: torch.Tensor  # [3K] generated length (EOS counts)
    K: int  # responses per prompt (156)


def enumerate_responses(setup: ExactSetup, with_grad: bool = True) -> Enumerated:
    tok, resp = setup.tokenizer, setup.all_responses()
    K = len(resp)
    Js, Ss, Rs = [], [], []
    for pr in setup.task.prompts:
        if with_grad:
            S = setup.response_logprobs(pr.text)  # [K]
            g = torch.autograd.grad(S, setup.params, torch.eye(K, dtype=S.dtype), is_grads_batched=True,
                                    allow_unused=True)
            Js.append(torch.cat([(x if x is not None else torch.zeros(K, *q.shape, dtype=S.dtype)).reshape(K, -1)
                                 for x, q in zip(g, setup.params)], 1))
        else:
            with torch.no_grad():
                S = setup.response_logprobs(pr.text)
        Ss.append(S.detach())
        Rs.append(torch.tensor([setup.task.reward(tok.decode(t, skip_special_tokens=True), pr) for t in resp],
                               dtype=torch.float64))
    L = torch.tensor([len(r) for r in resp], dtype=torch.float64).repeat(len(setup.task.prompts))
    return Enumerated(torch.cat(Js) if with_grad else torch.empty(0), torch.cat(Ss), torch.cat(Rs), L, K)


@contextlib.contextmanager
def params_set_to(setup: ExactSetup, theta: torch.Tensor):
    """Inside the block the setup's parameters are the flat vector ``theta``; restored after."""
    ps = setup.params
    saved = [p.detach().clone() for p in ps]
    with torch.no_grad():
        off = 0
        for p in ps:
            p.copy_(theta[off:off + p.numel()].view_as(p))
            off += p.numel()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(ps, saved):
                p.copy_(s)
