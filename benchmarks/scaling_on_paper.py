"""Memory per GPU and bytes communicated per probe under ``ddp.strategy=fsdp2``, computed (not
measured) for 1.5B, 7B and 70B policies on 8 and 64 GPUs. docs/scaling.md prints this table and
says which inputs were measured.

    python benchmarks/scaling_on_paper.py
    python benchmarks/scaling_on_paper.py --tokens 4096 --checkpointing   # G x T per microbatch

Inputs (each a documented assumption; change them on the command line):
- parameters and Adam moments in fp32 (verl's and FSDP's usual master weights), one fp32 copy =
  4 N bytes; the probe's live parameter-sized copies per phase are the ones tests/test_memory.py
  counts on one process (docs/memory.md), sharded 1/W by fsdp2: 10 at the end of the X pass with
  the ``backward`` projection fsdp2 uses (weights, 2 moments, Ybar, Xbar, 4 directions, one unit's
  gradient), 8 during the ground truth plus AdamW's foreach temporaries (~3), against 4 (weights,
  gradients, 2 moments) plus the same temporaries for a training step;
- unsharded at a time: two all-gathered decoder layers in fp32 (the one computing and the one
  prefetched) and one layer's unsharded gradient; the embedding and LM head are gathered with the
  root module (2 V h fp32);
- activations of one microbatch of ``--tokens`` tokens (one prompt's G responses of T tokens), bf16,
  ``34 h`` bytes per token and layer without checkpointing (SDPA/flash attention: no T^2 term), ``2 h``
  per token and layer with ``model.activation_checkpointing=true`` plus one layer's full set; the
  logits and their log-softmax/entropy temporaries, 3 x tokens x V x 4 bytes;
- communication per rank: a gradient pass all-gathers the parameters in the forward and again in
  the backward and reduce-scatters the gradients (3 x 4N x (W-1)/W bytes), a no-grad pass gathers
  once; dots are all-reduces of a few scalars (negligible). Passes per probe with B prompts a side:
  ceil(B/W) microbatch gradient passes over U and over E, then one gradient pass per unit for the
  per-unit projections (every rank takes part in every unit under fsdp2: 2B), the real step's no-
  grad pass over E at theta_plus (ceil(B/W)).
"""
from __future__ import annotations

import argparse
import math

MODELS = {  # N, layers, hidden, vocab (Qwen2.5-1.5B, Qwen2.5-7B, Llama-3-70B)
    "1.5B": (1.54e9, 28, 1536, 151936),
    "7B": (7.62e9, 28, 3584, 152064),
    "70B": (70.6e9, 80, 8192, 128256),
}
GB = 1e9


def per_gpu(N, L, h, V, W, tokens, ckpt):
    copy = 4 * N / W
    gathered = 2 * (N / L) * 4 + (N / L) * 4 + 2 * V * h * 4
    act = tokens * L * (2 * h if ckpt else 34 * h) + (tokens * 34 * h if ckpt else 0)
    logits = 3 * tokens * V * 4
    return {"train": 4 * copy + 3 * copy, "X pass": 10 * copy, "ground truth": 8 * copy + 3 * copy,
            "gathered": gathered, "activations": act, "logits": logits}


def comm_per_probe(N, W, B):
    grad_pass = 3 * 4 * N * (W - 1) / W
    nograd = 4 * N * (W - 1) / W
    mbs = math.ceil(B / W)
    passes = 2 * mbs + 2 * B
    return passes * grad_pass + mbs * nograd, passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8 * 1024, help="tokens per microbatch (G x T)")
    ap.add_argument("--checkpointing", action="store_true", help="model.activation_checkpointing=true")
    ap.add_argument("--B", type=int, default=64, help="prompts per batch (B_E = B_U)")
    a = ap.parse_args()
    print(f"per GPU, GB (fp32 parameters and moments, {a.tokens} tokens a microbatch, activation "
          f"checkpointing {'on' if a.checkpointing else 'off'})")
    print(f"{'model':<6}{'GPUs':>5}{'train state':>12}{'probe X':>9}{'probe GT':>9}{'gathered':>9}"
          f"{'activ.':>8}{'logits':>8}{'probe peak':>11}{'comm/probe TB':>15}")
    for name, (N, L, h, V) in MODELS.items():
        for W in (8, 64):
            m = per_gpu(N, L, h, V, W, a.tokens, a.checkpointing)
            peak = max(m["X pass"], m["ground truth"]) + m["gathered"] + m["activations"] + m["logits"]
            comm, passes = comm_per_probe(N, W, a.B)
            print(f"{name:<6}{W:>5}{m['train'] / GB:>12.1f}{m['X pass'] / GB:>9.1f}{m['ground truth'] / GB:>9.1f}"
                  f"{m['gathered'] / GB:>9.1f}{m['activations'] / GB:>8.1f}{m['logits'] / GB:>8.1f}"
                  f"{peak / GB:>11.1f}{comm / 1e12:>15.2f}")
    print(f"communication: {2 * a.B} per-unit gradient passes dominate (B = {a.B} a side)")


if __name__ == "__main__":
    main()
