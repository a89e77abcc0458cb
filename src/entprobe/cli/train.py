"""``python -m entprobe.train``: the DR-GRPO / GRPO trainer's command line (integrations/grpo_trainer.py),
and ``--build-default`` (``entprobe-build-default``): the built-in default checkpoint
(checkpoints/default_checkpoint.py)."""
from __future__ import annotations

import argparse
import contextlib

from entprobe.checkpoints.default_checkpoint import LOSSES, build_default_checkpoint, ensure_default_checkpoint
from entprobe.checkpoints.trainer_checkpoint import changed_run_args, checkpoint_step
from entprobe.config import ConfigError
from entprobe.integrations.guard import MAX_HORIZON
from entprobe.integrations.grpo_trainer import LR_SCHEDULERS, ROLLOUTS_MIN_B, TrainArgs, check_args, resume_folder
from entprobe.integrations.grpo_trainer import train
from entprobe.cli.user_errors import ArgumentParser, exits_on_user_error


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default (``(default: ...)``, unless the help says it already or
    there is none) and the description as written."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_default_main(argv: list[str] | None = None) -> None:
    """``entprobe-build-default`` / ``python -m entprobe.train --build-default``: the default checkpoint."""
    ap = ArgumentParser(description="Build the built-in default checkpoint", formatter_class=HelpFormatter)
    ap.add_argument("--build-default", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="folder to write (default: the cache)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    path = build_default_checkpoint(a.out, a.seed) if a.out else ensure_default_checkpoint(seed=a.seed)
    print(path)


def parse_train_args(argv: list[str] | None = None):
    """The trainer's command line -> ``grpo_trainer.TrainArgs``."""
    d = TrainArgs(out="")
    ap = ArgumentParser(
        prog="python -m entprobe.train", description=TRAIN_HELP,
        formatter_class=HelpFormatter)
    ap.add_argument("--out", required=True, help="run folder: checkpoint-<step>/ folders are written into it")
    ap.add_argument("--model", default=None, help="HF save_pretrained folder to train (default: the built-in "
                    "default checkpoint's weights, built on first use)")
    ap.add_argument("--task", default=d.task, help="'arithmetic' (built-in) or a .jsonl file of "
                    '{"prompt": ..., "answer": ...} records')
    ap.add_argument("--reward", default=d.reward, choices=("numeric", "boxed"), help="reward of a .jsonl task")
    ap.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    ap.add_argument("--lr", type=float, default=d.lr, help="AdamW peak learning rate")
    ap.add_argument("--lr-scheduler", default=d.lr_scheduler, choices=LR_SCHEDULERS,
                    help="transformers' schedule of the lr over --steps")
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warmup steps of the schedule")
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay,
                    help="on the Trainer's decay group (not biases / norm weights)")
    ap.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="gradient clipping (0: off)")
    ap.add_argument("--B", type=int, default=d.B, help="prompts per step")
    ap.add_argument("--G", type=int, default=d.G, help="responses sampled per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="response length cap")
    ap.add_argument("--loss", default=d.loss, choices=LOSSES, help="policy loss (train.policy_loss)")
    ap.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps and at the end")
    ap.add_argument("--probe-every", type=int, default=d.probe_every,
                    help="online entropy probe every N steps (0: off)")
    ap.add_argument("--probe-B-E", type=int, default=d.probe_B_E, help="held-out prompts per probe (with "
                    "--probe-source rollouts: the fresh prompts the step is measured on; 0: no measurement)")
    ap.add_argument("--probe-source", default=d.probe_source, choices=("held_out", "rollouts"),
                    help="held_out: predict on a fresh E of --probe-B-E prompts; rollouts: predict from the step's "
                    f"own batch (no sampling for the prediction; needs --B >= {ROLLOUTS_MIN_B}; docs/rollouts.md)")
    ap.add_argument("--guard-floor", type=float, default=None, help="EntropyGuard: lowest entropy (nats, the "
                    "H of the batch the probe predicts on: held-out E, or with --probe-source rollouts the step's own) "
                    "the lr is cut to hold (needs --probe-every; docs/guard.md)")
    ap.add_argument("--guard-max-decay", type=float, default=None, help="EntropyGuard: largest entropy decrease "
                    "per step (nats) the lr is cut to hold (needs --probe-every)")
    ap.add_argument("--guard-horizon", type=int, default=None, help="EntropyGuard: cut the lr when the entropy "
                    f"forecast is resolved below --guard-floor within this many steps, 1 to {MAX_HORIZON} (needs --probe-source "
                    "rollouts; docs/guard.md)")
    ap.add_argument("--guard-ceiling", type=float, default=None, help="EntropyGuard: highest entropy (nats, the "
                    "band's upper edge, above --guard-floor): the lr is cut on a resolved rise past it (needs --probe-every; "
                    "docs/guard.md)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ...")
    ap.add_argument("--resume", default=None, help="continue from a checkpoint-<step> folder of this run, or "
                    "'last' (--out's latest); give the run's other options again (one left at another default "
                    "than the checkpoint's is refused)")
    return TrainArgs(**{k.replace("-", "_"): v for k, v in vars(ap.parse_args(argv)).items()})


TRAIN_HELP = """Train a policy with DR-GRPO or GRPO, writing HF Trainer checkpoints probed online.

  python -m entprobe.train --out runs/grpo --steps 20 --save-every 10 --probe-every 5

writes runs/grpo/checkpoint-<step>/ (model.safetensors, config.json, tokenizer, optimizer.pt,
scheduler.pt, trainer_state.json, rng_state.pth) and prints the probe's prediction and measurement.
Probe a checkpoint it wrote with the command line:

  python -m entprobe.main model=hf model.path=runs/grpo/checkpoint-20 optimizer.state_path=runs/grpo/checkpoint-20

(--loss grpo: add objective=trl objective.loss_type=grpo so the probed step is the one trained).
--resume last (or a checkpoint-<step> folder) continues the run in --out with its other options given again.
python -m entprobe.train --build-default [--out DIR] [--seed N] builds the built-in default checkpoint."""


def main(argv: list[str] | None = None) -> None:
    """``python -m entprobe.train``: the trainer (``--help``), or ``--build-default``."""
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--build-default" in argv:
        return build_default_main(argv)
    args = parse_train_args(argv)
    with exits_on_user_error():
        if args.resume is not None:
            check_resumed_options(args, explicit_options(argv))
    with exits_on_user_error(), progress_bar(args.steps) as (log, on_step):
        train(args, log=log, on_step=on_step)


def explicit_options(argv: list[str]) -> set[str]:
    """The TrainArgs fields the command line gives (not left at their defaults); argparse's
    unambiguous prefixes (``--ste`` for ``--steps``) count as the option."""
    from dataclasses import fields

    names = [f.name for f in fields(TrainArgs)]
    given = set()
    for token in argv:
        if token.startswith("--"):
            t = token[2:].split("=", 1)[0].replace("-", "_")
            hits = [t] if t in names else [n for n in names if n.startswith(t)]
            given.update(hits[:1] if len(hits) == 1 else [])
    return given


def check_resumed_options(args, explicit: set[str]) -> None:
    """``--resume`` with an option that shapes the steps (``RUN_KEYS``) other than the checkpoint's:
    refused when it was left at its default (the run would silently change), allowed when given
    explicitly (``train`` prints a notice)."""
    check_args(args)
    folder = resume_folder(args)
    changed, recorded = changed_run_args(folder, vars(args))
    implicit = [(k, was, now) for k, was, now in changed if k not in explicit]
    if implicit:
        k, was, now = implicit[0]
        opt = f"--{k.replace('_', '-')}"
        raise ConfigError(f"--resume={args.resume!r}: the run was trained with {opt} {was} ({recorded}), this "
                          f"command leaves {opt} at its default {now}: give {opt} {was} to resume the run, or "
                          f"{opt} {now} explicitly to change it from step {checkpoint_step(folder) + 1}")


@contextlib.contextmanager
def progress_bar(steps: int):
    """A tqdm bar over the optimizer steps with the last step's loss, reward and entropy, shown from
    the first step on (nothing before, e.g. when the arguments are refused); yields ``(log,
    on_step)`` for ``grpo_trainer.train`` (its lines printed above the bar)."""
    from tqdm.auto import tqdm

    bars = []

    def log(line: str) -> None:
        (bars[0].write if bars else print)(line)

    def on_step(entry: dict) -> None:
        if not bars:  # a resumed run starts at its checkpoint's step
            bars.append(tqdm(total=steps, initial=entry["step"] - 1, desc="train", unit="step", dynamic_ncols=True))
        bar = bars[0]
        bar.set_postfix(loss=f"{entry['loss']:+.4f}", reward=f"{entry['reward']:.3f}",
                        entropy=f"{entry['entropy']:.3f}", refresh=False)
        bar.update(entry["step"] - bar.n)

    try:
        yield log, on_step
    finally:
        for bar in bars:
            bar.close()

if __name__ == "__main__":
    main()
