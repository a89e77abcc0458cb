"""A small DR-GRPO / GRPO trainer that writes HF Trainer checkpoints with the online probe attached
(the command line is ``python -m entprobe.train``; ``train.main``).

Each step: B prompts drawn from the task, G responses each sampled from the current policy
(``rollout.sample_batch``, temperature 1), rewards and group advantages, the policy loss
(``train.policy_loss``: ``dr_grpo`` or ``grpo``), backward, gradient clipping, AdamW over HF Trainer's
decay / no-decay groups, transformers' lr scheduler (``get_scheduler``: constant, linear, cosine, with
warmup). ``resume`` continues a run from one of its checkpoints: the weights, AdamW state, scheduler
and log history are read back, and since each step's sampling is seeded by its step number the
resumed run takes the steps the uninterrupted one would have. Every ``probe_every`` steps ``OnlineProbe``
predicts the step's entropy change before ``optimizer.step()`` and measures it after; its
``entprobe/*`` metrics join that step's entry of the log history; with ``guard_floor`` /
``guard_max_decay`` an ``EntropyGuard`` on that probe sets each step's lr (docs/guard.md; a resumed
run continues with the factor its checkpoint's last step logged). Every ``save_every`` steps, and at
the last step, ``out/checkpoint-<step>/`` is written (``trainer_checkpoint``).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from entprobe.config import ConfigError, SamplingConfig
from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch
from entprobe.tasks.base import check_encodable
from entprobe.checkpoints.trainer_checkpoint import (CHECKPOINT_RE, changed_run_args, check_resume_files, checkpoint_step,
                                         existing_checkpoints, read_trainer_checkpoint, trainer_state,
                                         write_trainer_checkpoint)
from entprobe.checkpoints.default_checkpoint import LOSSES
from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint
from entprobe.tasks.arithmetic import ArithmeticTask
from entprobe.tasks.jsonl import JsonlTask
from entprobe.tasks.lengths import model_context, refuse_long_prompts
from entprobe.integrations.online import OnlineProbe
from entprobe.integrations.guard import EntropyGuard, param_error
from entprobe.integrations.step_lines import probe_line
from entprobe.reporting.over_steps import merged_history, write_history
from entprobe.checkpoints.default_checkpoint import policy_loss, trainer_adamw

ADV_EPS = 1e-6  # grpo advantages: (r - mean) / (std + ADV_EPS)


@dataclass
class TrainArgs:
    """What ``python -m entprobe.train`` takes (its ``--help`` describes each)."""
    out: str
    model: str | None = None  # an HF save_pretrained folder; None: the built-in default checkpoint
    task: str = "arithmetic"  # or a .jsonl file of {"prompt", "answer"} records
    reward: str = "numeric"
    steps: int = 20
    lr: float = 1e-3
    lr_scheduler: str = "constant"  # transformers.get_scheduler's name: constant, linear, cosine, ...
    warmup_steps: int = 0
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    B: int = 16
    G: int = 4
    max_new_tokens: int = 4
    loss: str = "dr_grpo"
    save_every: int = 10
    probe_every: int = 0
    probe_B_E: int = 8
    probe_source: str = "held_out"  # or "rollouts": the step's own batch (integrations/online.py)
    seed: int = 0
    device: str = "cpu"
    resume: str | None = None  # a checkpoint-<step> folder of this run, or "last": --out's latest
    guard_floor: float | None = None  # EntropyGuard (integrations/guard.py) on the probe: None, off
    guard_max_decay: float | None = None
    guard_horizon: int | None = None  # the guard acts on the forecast this many steps ahead (--probe-source rollouts)
    guard_ceiling: float | None = None  # the band's upper edge: a resolved rise past it is cut


LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
# --probe-source rollouts: the fewest prompts a step its prediction takes (rollout_passes refuses fewer: the
# jackknife of the cross-prompt U-statistic over B prompts leaves one out and needs a pair of the rest)
ROLLOUTS_MIN_B = 3


def guarded(a: TrainArgs) -> bool:
    """Whether the run's lr is set by EntropyGuard (a floor, a rate limit or a ceiling given)."""
    return a.guard_floor is not None or a.guard_max_decay is not None or a.guard_ceiling is not None


def check_args(a: TrainArgs) -> None:
    """Clear errors naming the option before anything is loaded."""
    if a.probe_source not in ("held_out", "rollouts"):
        raise ConfigError(f"--probe-source={a.probe_source!r}: held_out or rollouts")
    if a.probe_B_E == 0 and a.probe_source == "rollouts":  # rollouts without a measurement
        pass
    elif a.probe_B_E < 1:
        raise ConfigError(f"--probe-B-E={a.probe_B_E}: must be >= 1 (0 with --probe-source rollouts: measure nothing)")
    for name in ("steps", "B", "G", "max_new_tokens", "save_every"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(a, name)}: must be >= 1")
    if a.G < 2:
        raise ConfigError(f"--G={a.G}: group advantages need >= 2 responses per prompt")
    if not 0 <= a.seed < 2**32:
        raise ConfigError(f"--seed={a.seed}: seeds must be in [0, 2^32)")
    if a.probe_every < 0:
        raise ConfigError(f"--probe-every={a.probe_every}: must be >= 0 (N: probe every N steps; 0: no probe)")
    if not (math.isfinite(a.lr) and a.lr > 0):  # at lr 0 no step changes the policy (nor its entropy)
        raise ConfigError(f"--lr={a.lr}: the AdamW peak learning rate must be a finite number > 0")
    if not (math.isfinite(a.max_grad_norm) and a.max_grad_norm >= 0):
        raise ConfigError(f"--max-grad-norm={a.max_grad_norm}: must be a finite number >= 0 (0: no clipping)")
    if a.probe_every and a.probe_source == "rollouts" and a.B < ROLLOUTS_MIN_B:
        raise ConfigError(f"--B={a.B}: --probe-source rollouts needs --B >= {ROLLOUTS_MIN_B} prompts a step (its "
                          "cross-prompt U-statistic's jackknife SE leaves one prompt out and needs a pair of others); "
                          f"give --B {ROLLOUTS_MIN_B} or more, or --probe-source held_out")
    if guarded(a) and not a.probe_every:
        raise ConfigError("--guard-floor / --guard-max-decay / --guard-ceiling set the lr from the online probe's "
                          "prediction: give --probe-every N too (1: every step)")
    if a.guard_horizon is not None and (a.guard_floor is None or a.probe_source != "rollouts"):
        raise ConfigError(f"--guard-horizon={a.guard_horizon}: keeps the entropy forecast above --guard-floor, which the "
                          "probe makes from the step's own batch: give --guard-floor and --probe-source rollouts")
    for opt, name, v in (("--guard-floor", "floor", a.guard_floor), ("--guard-max-decay", "max_decay", a.guard_max_decay),
                         ("--guard-horizon", "horizon", a.guard_horizon), ("--guard-ceiling", "ceiling", a.guard_ceiling)):
        error = param_error(name, v, "leave the option out")  # the guard's own ranges (EntropyGuard would refuse it after the model loads)
        if error:
            raise ConfigError(f"{opt}={v}: {error}")
    if a.guard_ceiling is not None and a.guard_floor is not None and not a.guard_ceiling > a.guard_floor:
        raise ConfigError(f"--guard-ceiling={a.guard_ceiling} --guard-floor={a.guard_floor}: the ceiling is the band's "
                          "upper edge and must be above the floor")
    if a.loss not in LOSSES:
        raise ConfigError(f"--loss={a.loss!r}: one of {', '.join(LOSSES)}")
    if a.model is not None and not (Path(a.model).expanduser() / "config.json").is_file():
        raise ConfigError(f"--model={a.model!r}: not a save_pretrained folder (no config.json); leave it out "
                          "to train the built-in model")
    if a.lr_scheduler not in LR_SCHEDULERS or a.warmup_steps < 0:
        raise ConfigError(f"--lr-scheduler={a.lr_scheduler!r} --warmup-steps={a.warmup_steps}: one of "
                          f"{', '.join(LR_SCHEDULERS)}, warmup >= 0")
    if a.resume is None:
        if existing_checkpoints(a.out):
            raise ConfigError(f"--out={a.out!r} already holds {existing_checkpoints(a.out)[0].name}: "
                              "write the run to a new folder, or --resume it")
        return
    if a.model is not None:
        raise ConfigError("--resume reads the weights from the checkpoint: leave --model out")
    step = checkpoint_step(resume_folder(a))
    later = [p.name for p in existing_checkpoints(a.out) if checkpoint_step(p) > step]
    if later:
        raise ConfigError(f"--resume={a.resume!r}: --out already holds {later[0]}, which the resumed run would "
                          "write again; resume from the latest checkpoint or into a new --out")
    if a.steps <= step:
        raise ConfigError(f"--steps={a.steps}: the checkpoint is at step {step}; ask for more steps")
    check_resume_files(resume_folder(a))  # before the model loads: each bad file named


def resume_folder(a: TrainArgs) -> Path:
    """The checkpoint ``--resume`` names (``last``: the highest-numbered one in ``--out``)."""
    if a.resume == "last":
        found = existing_checkpoints(a.out)
        if not found:
            raise ConfigError(f"--resume=last: --out={a.out!r} holds no checkpoint-<step> folder")
        return found[-1]
    folder = Path(a.resume).expanduser()
    if not (folder.is_dir() and CHECKPOINT_RE.match(folder.name)):
        raise ConfigError(f"--resume={a.resume!r}: not a checkpoint-<step> folder (or 'last')")
    return folder


@contextlib.contextmanager
def no_progress_bars():
    """transformers' (and huggingface_hub's) tqdm bars off inside the block, as they were after it:
    ``save_pretrained``'s "Writing model shards" and ``from_pretrained``'s "Loading weights" bars,
    which would print between the trainer's lines. Warnings and errors are logged as before (the
    bars are not the logger)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_policy(a: TrainArgs):
    """(model, tokenizer) on ``a.device`` in fp32, train mode: ``--model`` or the built-in default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resume_folder(a) if a.resume else (
        Path(a.model).expanduser() if a.model else ensure_default_checkpoint(seed=a.seed))
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                                     attn_implementation="eager")
    return model.to(torch.device(a.device)).train(), tok


def rollout_source(a: TrainArgs) -> dict:
    """``OnlineProbe``'s keywords for ``--probe-source``: for ``rollouts`` the loss as entprobe's objective
    (``dr_grpo``: entprobe's own, ``A / (G Lmax)``; ``grpo``: TRL's ``grpo``, ``A / (G L)``, with the
    batch's advantages) and the clipping."""
    if a.probe_source != "rollouts":
        return {}
    objective = {} if a.loss == "dr_grpo" else {"objective": "trl", "objective.loss_type": "grpo",
                                                 "objective.scale_rewards": "group"}
    return {"source": "rollouts", "max_grad_norm": a.max_grad_norm if a.max_grad_norm > 0 else None, **objective}


def load_task(a: TrainArgs):
    return ArithmeticTask(512, 9, seed=a.seed) if a.task == "arithmetic" else JsonlTask(a.task, a.reward)


def logged_entropy(batch) -> float:
    """The step's logged ``entropy`` as TRL logs it: the mean over the batch's generated tokens of the
    full-vocabulary entropy of each sampling distribution (``sampler_entropy``; token_mean's
    functional at theta on this batch); the mean surprisal ``-log p`` of the sampled tokens (the same
    expectation, noisier) for a batch without it."""
    L = batch.gen_lengths.sum().clamp(min=1)
    if batch.sampler_entropy is not None:
        return float((batch.sampler_entropy.double() * batch.response_mask).sum() / L)
    return float(-batch.sampler_logprobs.sum() / L)


PROBE_STATE_KEY = "entprobe.OnlineProbe"  # the probe's state (its forecast's filter) in trainer_state.json


def saved_probe_state(folder: Path) -> dict | None:
    """The probe's state a checkpoint's ``trainer_state.json`` holds (None: a checkpoint without one)."""
    import json

    saved = json.loads((Path(folder) / "trainer_state.json").read_text()).get("stateful_callbacks") or {}
    return saved.get(PROBE_STATE_KEY)


def train(a: TrainArgs, log=print, on_step=None) -> list[Path]:
    """Run the trainer (module docstring); returns the checkpoint folders written. ``on_step``, when
    given, is called with each step's log-history entry (step, loss, reward, entropy, ...)."""
    check_args(a)
    model, tok = load_policy(a)
    task = load_task(a)
    check_encodable(task, tok, f"--task={a.task!r}")
    refuse_long_prompts(task, tok, model_context(tok, [], model.config.to_dict()), a.max_new_tokens,
                        f"--task={a.task!r}", new_key="--max-new-tokens")
    opt = trainer_adamw(model, a.lr, a.weight_decay)
    from transformers import get_scheduler

    sched = get_scheduler(a.lr_scheduler, opt, num_warmup_steps=a.warmup_steps, num_training_steps=a.steps)
    sampling = SamplingConfig(max_new_tokens=a.max_new_tokens)
    advantage = "dr_grpo" if a.loss == "dr_grpo" else "grpo"
    probe = (OnlineProbe(model, opt, tok, task if a.probe_B_E else None, every=a.probe_every, seed=a.seed,
                         sampling={"max_new_tokens": a.max_new_tokens}, batch={"B_E": max(a.probe_B_E, 2), "G": a.G},
                         **rollout_source(a)) if a.probe_every else None)
    stepper = EntropyGuard(probe, floor=a.guard_floor, max_decay=a.guard_max_decay, horizon=a.guard_horizon,
                           ceiling=a.guard_ceiling) if guarded(a) else probe
    history, written, start = [], [], 0
    if a.resume:
        folder = resume_folder(a)
        start, history = read_trainer_checkpoint(folder, opt, sched, a.B * a.G)
        log(f"[entprobe] resumed from {folder} at step {start}")
        saved = saved_probe_state(folder) if probe is not None and a.probe_source == "rollouts" else None
        if saved is not None:  # the forecast's filter goes on from the history it had
            probe.load_state_dict(saved)
        if guarded(a) and history and "entprobe/guard_lr_factor" in history[-1]:  # every step logs the factor in force
            stepper.load_state_dict({"factor": history[-1]["entprobe/guard_lr_factor"]})
            log(f"[entprobe] guard resumed with lr factor {stepper.factor:.4g}")
        changed, recorded = changed_run_args(folder, vars(a))
        for key, was, now in changed:
            log(f"[entprobe] --{key.replace('_', '-')} {now} replaces the checkpoint's {was} ({recorded}): "
                f"steps {start + 1}.. are not those of the run that wrote it")
    torch.manual_seed(a.seed)
    for step in range(start + 1, a.steps + 1):
        t0 = time.perf_counter()
        seed = a.seed * 100003 + step
        batch = sample_batch(model, tok, task, draw_prompt_indices(len(task.prompts), a.B, seed), a.G, sampling,
                             seed, advantage, ADV_EPS)
        loss = policy_loss(model, batch, a.loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_grad_norm).item()
                     if a.max_grad_norm > 0 else None)
        lr = sched.get_last_lr()[0]  # the lr of this step (logged as HF Trainer logs it)
        if stepper is not None:
            stepper.before_step(step, **({"rollouts": batch, "grad_norm": grad_norm} if a.probe_source == "rollouts"
                                         else {}))
        opt.step()
        metrics = stepper.after_step() if stepper is not None else None  # (the guard puts back the scheduler's lr)
        sched.step()
        entry = {"step": step, "loss": loss.item(), "learning_rate": lr, "reward": batch.rewards.mean().item(),
                 "reward_std": batch.rewards.std().item(),
                 "entropy": logged_entropy(batch),
                 "completion_length": batch.gen_lengths.float().mean().item(),
                 "step_time_s": time.perf_counter() - t0}
        if grad_norm is not None:
            entry["grad_norm"] = grad_norm
        if probe is not None and a.probe_source == "rollouts":  # the logged entropy joins the run's forecast
            probe.observe_entropy(step, entry["entropy"])
        if metrics:
            entry.update(metrics)
        if metrics and "entprobe/deltaH_pred" in metrics:  # one line a probed step, at the lr it used
            decided = guarded(a) and stepper.decisions and stepper.decisions[-1].step == step
            log("[entprobe] " + probe_line(step, metrics, a.probe_source, metrics.get("entprobe/H_rollouts"),
                                           *((stepper.decisions[-1], stepper.rule) if decided else ())))
        history.append(entry)
        if on_step is not None:
            on_step(entry)
        if step % a.save_every == 0 or step == a.steps:
            state = trainer_state(step, a.steps, a.save_every, a.B * a.G, history)
            if probe is not None and a.probe_source == "rollouts":
                state.stateful_callbacks[PROBE_STATE_KEY] = probe.state_dict()
            with no_progress_bars():  # save_pretrained's "Writing model shards" bar would cut into the trainer's
                written.append(write_trainer_checkpoint(a.out, step, model, tok, opt, sched, state, vars(a)))
            log(f"[entprobe] step {step}: loss {entry['loss']:+.4f} reward {entry['reward']:.3f} "
                f"entropy {entry['entropy']:.3f} -> {written[-1]}")
    if probe is not None:  # the online probe's steps, plotted as entprobe.probe_run plots a run's checkpoints
        for path in write_history(merged_history(history, probe.history), a.out, log_history=history):  # a resumed run's too
            log(f"[entprobe] over steps: {path}")
    return written
