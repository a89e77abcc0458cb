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

``--one-process``: the probe's time in training-step units and its peak against a training step's, one
process (no sharding), for 1.5B / 7B / 32B at 1k and 4k new tokens, from costs measured on SmolLM2-135M
(bench_long.py, CPU, fp32, SDPA, B 2 x G 4 at 128 / 512 / 1024 tokens; benchmarks/README.md):

- time: ``t = c N / N0 + a (N / N0) n + b (L h / (L h)_0) n T`` for the probe and for a training step
  alike, with n the response tokens of E and U, T the padded length, ``N0 = 134.5M`` and
  ``(L h)_0 = 30 x 576`` SmolLM2's; c (the parameter-sized passes), a (the matmuls, per parameter and
  token) and b (attention, per layer-width and token per position) solved from the three lengths;
  units = t_probe / t_step (B_E = B_U = 64 prompts x G 8);
- memory: 7 fp32 parameter-sized copies for the probe (its X pass with AdamW's update parts held as
  factors: weights, 2 moments, Ybar, Xbar, P Ybar and 1/D', docs/memory.md) against 4 for a step plus AdamW's foreach temporaries (3); activations of
  one microbatch (one prompt's G x T tokens) at the measured bytes per token, layer and hidden unit
  (fp32, no checkpointing): 55 for the probe's passes, 135 for the step's forward+backward (the
  marginal MiB per token bench_long.py printed, over the 8 x T tokens of a microbatch);
  ``--bf16-activations`` halves them.
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


SMOL = (134_515_008, 30, 576)  # N0, layers, hidden of the measured model (SmolLM2-135M)
# seconds = c + a n + b n T on SmolLM2 (CPU s, one core), solved from bench_long.py's three lengths
FIT = {"probe": (17.98, 1.3325e-2, 9.147e-6), "step": (10.05, 1.0342e-2, 7.217e-6)}
ACT_BYTES = {"probe": 55.1, "step": 134.7}  # per token, layer and hidden unit in a microbatch (fp32)
ONE_PROCESS = {"1.5B": (1.54e9, 28, 1536), "7B": (7.62e9, 28, 3584), "32B": (32.8e9, 64, 5120)}  # Qwen2.5


def seconds(kind: str, N: float, L: int, h: int, n: float, T: float) -> float:
    """The fitted cost ``c N/N0 + a (N/N0) n + b (L h/(L h)_0) n T`` (module docstring), CPU seconds."""
    c, a, b = FIT[kind]
    N0, L0, h0 = SMOL
    return c * N / N0 + a * (N / N0) * n + b * (L * h / (L0 * h0)) * n * T


PROBE_COPIES = 7  # the X pass's live parameter-sized copies above 10 M parameters with AdamW (docs/memory.md)


def one_process(N: float, L: int, h: int, T: int, B: int, G: int, bf16_act: bool) -> dict:
    """Probe units and peaks (GB) of one process for a model of N parameters, L layers, width h."""
    n = 2 * B * G * T
    units = seconds("probe", N, L, h, n, T) / seconds("step", N, L, h, n, T)
    scale = 0.5 if bf16_act else 1.0
    mb = G * T
    act = {k: ACT_BYTES[k] * scale * mb * L * h for k in ACT_BYTES}
    probe, step = PROBE_COPIES * 4 * N + act["probe"], (4 + 3) * 4 * N + act["step"]
    return {"units": units, "copies_probe": PROBE_COPIES * 4 * N, "act_probe": act["probe"], "probe": probe,
            "copies_step": 7 * 4 * N, "act_step": act["step"], "step": step}


def main_one_process(a: argparse.Namespace) -> None:
    print(f"one process, B_E = B_U = {a.B} prompts x G {a.G}, a microbatch = one prompt's G x T tokens, "
          f"fp32 parameters and moments, {'bf16' if a.bf16_activations else 'fp32'} activations, no checkpointing; GB")
    print(f"{'model':<6}{'T':>6}{'probe units':>12}{'probe copies':>13}{'probe act.':>11}{'probe peak':>11}"
          f"{'step copies':>12}{'step act.':>10}{'step peak':>10}{'peak ratio':>11}")
    for name, (N, L, h) in ONE_PROCESS.items():
        for T in (1024, 4096):
            m = one_process(N, L, h, T, a.B, a.G, a.bf16_activations)
            print(f"{name:<6}{T:>6}{m['units']:>12.2f}{m['copies_probe'] / GB:>13.1f}{m['act_probe'] / GB:>11.1f}"
                  f"{m['probe'] / GB:>11.1f}{m['copies_step'] / GB:>12.1f}{m['act_step'] / GB:>10.1f}"
                  f"{m['step'] / GB:>10.1f}{m['probe'] / m['step']:>11.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8 * 1024, help="tokens per microbatch (G x T)")
    ap.add_argument("--checkpointing", action="store_true", help="model.activation_checkpointing=true")
    ap.add_argument("--B", type=int, default=64, help="prompts per batch (B_E = B_U)")
    ap.add_argument("--G", type=int, default=8, help="--one-process: responses per prompt")
    ap.add_argument("--one-process", action="store_true", help="units and peaks from the measured costs (docstring)")
    ap.add_argument("--bf16-activations", action="store_true", help="--one-process: activations in bf16")
    a = ap.parse_args()
    if a.one_process:
        return main_one_process(a)
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
