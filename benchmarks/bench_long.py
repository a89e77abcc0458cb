"""The whole probe at long responses: time and peak memory per token, ESS after the step, the
Rao-Blackwellised X's gain and the paired difference's SE ratio, at several new-token lengths T.

One process loads the model (and, for a model without optimizer state, gives it an AdamW state from
one real step, as ``bench_probe.py`` does); then, per T (``--tokens``, same prompts and seeds), E and
U are sampled once and saved under ``--batches`` (``batch.save``'s format: a rerun loads them, so
sampling is paid once), and each repetition times, as ``bench_probe.py`` does:

- ``train``: a forward+backward of the DR-GRPO loss over E ∪ U (the probe's microbatching);
- ``step``: AdamW's ``step()`` (``train`` + ``step`` = 1 unit, a training step without sampling);
- ``probe``: ``run_two_batch`` as configured (Stages 1-3; ``auto`` projection, Rao-Blackwellised X).

After each T it prints the table so far (and rewrites ``--json``), so a run cut short keeps the
lengths it finished. Per T it prints the probe in units, its CPU (CUDA: wall) seconds and peak rise per response token,
the marginal memory per token between successive T (flat when nothing grows faster than T: the
entropies are taken ``ENTROPY_CHUNK_ROWS`` rows of [rows, V] logits at a time,
``rollouts/logprobs.py``), the per-decision and whole-response ESS/N after the real step, the score
form's SE over the Rao-Blackwellised X's on the same responses (``bench_rao_blackwell.estimator_rows``:
one forward-mode pass along the step, not timed) and ``SE_deltaH_true_minus_pred / SE_deltaH_pred``.

``--eos ignore`` (the default) samples every response to T tokens (EOS does not stop a row): an
instruct model answers arithmetic in tens of tokens, and the point is the cost of long responses;
``--eos stop`` keeps the model's own lengths (the padded T is then the longest response).

    OMP_NUM_THREADS=1 nice python benchmarks/bench_long.py --model smollm2 --tokens 128 512 1024 --B 2 --G 4
    python benchmarks/bench_long.py --tokens 8 16 --B 2 --G 2 --json /tmp/long.json   # toy, built-in, seconds

On CPU the clock is the process's CPU time with ``OMP_NUM_THREADS=1`` (re-executed so); on CUDA the
wall clock with ``torch.cuda.synchronize`` and memory by ``max_memory_allocated``. The first T's
blocks run once unrecorded first (first-call costs). Exits 0 whatever the figures (a measurement).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from _common import compose, reexec_with_bench_env, training_unit

COMMON = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.console_table=false"]
MODELS = {"default": [], "smollm2": ["model=smollm2", "batch.seed_E=2", "batch.seed_U=1"]}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", choices=list(MODELS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 16], help="new-token lengths T")
    ap.add_argument("--B", type=int, default=2, help="prompts in E and in U")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--reps", type=int, default=1, help="timed repetitions per T (medians)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--eos", default="ignore", choices=["ignore", "stop"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--batches", default=None, help="folder for the saved batches (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the figures to this file as one JSON object")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides after --")
    return ap.parse_args()


def overrides(a: argparse.Namespace, T: int) -> list[str]:
    return (COMMON + MODELS[a.model] + [f"batch.B_E={a.B}", f"batch.B_U={a.B}", f"batch.G={a.G}",
                                        f"optimizer.lr={a.lr}", f"sampling.max_new_tokens={T}",
                                        f"model.device={a.device}"] + list(a.overrides))


def ignoring_eos():
    """Make ``sample_batch`` sample every row to ``max_new_tokens``: its ``generate`` gets an EOS id
    no token has (-1), so no row stops; pad ids stay the tokenizer's."""
    from entprobe.rollouts import sampling

    gen = sampling.generate

    def generate(model, prompt_ids, G, max_new_tokens, eos_id, *rest, **kw):
        return gen(model, prompt_ids, G, max_new_tokens, -1, *rest, **kw)
    sampling.generate = generate


def setup(a: argparse.Namespace):
    """(lm, task, ctx, geometry) at the first T's config: ``bench_probe.build``'s set-up without
    its sampling."""
    from bench_probe import adamw_state
    from entprobe.checkpoints.preflight import check_inputs
    from entprobe.cli.probe_job import load_probe
    from entprobe.config import ConfigError
    from entprobe.pipeline.geometry import build_geometry

    cfg = compose(overrides(a, min(a.tokens)))
    try:
        inputs = check_inputs(cfg)
    except ConfigError:  # no optimizer state (SmolLM2's GGUF): an SGD-geometry check, then adamw_state
        inputs = check_inputs(compose(overrides(a, min(a.tokens)) + ["optimizer.preconditioner=identity"]))
    torch.manual_seed(cfg.seed)
    lm, task, ctx = load_probe(cfg)
    geo = (build_geometry(cfg, lm, ctx.params, ctx.buffers_device, inputs.optimizer_state)[0]
           if inputs.optimizer_state is not None else adamw_state(cfg, lm, task, ctx))
    return lm, task, ctx, geo


def batches(a, cfg, lm, task, ctx, folder: Path):
    """E and U at this T: loaded from ``folder`` when saved there, else sampled and saved."""
    from entprobe.pipeline.run_batches import sample_global
    from entprobe.rollouts.saved_batches import load_batches, save_batches

    if (folder / "batches.json").is_file():
        E, U, _ = load_batches(folder, cfg.batch.lock_timeout_s)
        return E, U, "loaded"
    folder.mkdir(parents=True, exist_ok=True)
    E, U = sample_global(cfg, lm, task, ctx)
    save_batches(folder, E, U, {"T": cfg.sampling.max_new_tokens, "eos": a.eos}, cfg.batch.lock_timeout_s)
    return E, U, "sampled"


def per_token_slopes(tokens: list[float], peaks: list[float]) -> list[float]:
    """Marginal MiB per token between successive lengths, ``(p[i+1] - p[i]) / (n[i+1] - n[i])``: equal
    slopes mean memory linear in T (nothing [T, T] or [T, V] grows faster)."""
    return [(p1 - p0) / (n1 - n0) if n1 != n0 else math.nan
            for n0, n1, p0, p1 in zip(tokens, tokens[1:], peaks, peaks[1:])]


def one_length(a, T: int, lm, task, ctx, geo, root: Path, warm: bool) -> dict:
    from bench_probe import optimizer_step_block, timed
    from bench_rao_blackwell import estimator_rows
    from entprobe.pipeline.modes.two_batch import run_two_batch
    from entprobe.pipeline.stages.context import PhaseStats

    cfg = compose(overrides(a, T))
    folder = root / f"{a.model}-T{T}-B{a.B}-G{a.G}-eos_{a.eos}"
    wall_s, cpu_s, (_, samp_abs), (E, U, how) = timed(lambda: batches(a, cfg, lm, task, ctx, folder), lm.device)
    n_tok = float(E.response_mask.sum() + U.response_mask.sum())
    print(f"[long] T={T}: batches {how} ({cpu_s:.0f} CPU s, {wall_s:.0f} wall s); mean response length "
          f"E {float(E.gen_lengths.double().mean()):.1f}, U {float(U.gen_lengths.double().mean()):.1f}; "
          f"{n_tok:.0f} response tokens in E ∪ U", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_long_"))
    clock = {k: [] for k in ("train", "step", "probe")}
    wall = {k: [] for k in clock}
    peak = {k: [] for k in clock}
    res = {}
    for rep in range(a.reps + (1 if warm else 0)):
        for name in clock:
            if name == "train":
                fn = lambda: training_unit(ctx, E, U)  # noqa: E731
            elif name == "step":
                fn, undo = optimizer_step_block(ctx, geo)
            else:
                c = dataclasses.replace(ctx, stats=PhaseStats())
                fn = lambda c=c: run_two_batch(c, E, U, geo, cfg.probe, cfg.importance, tmp)  # noqa: E731
            w, t, (mib, _), out = timed(fn, lm.device)
            if name == "step":
                undo()
                del undo
            if name == "probe":
                res = out
            if warm and rep == 0:
                continue
            clock[name].append(t if lm.device.type == "cpu" else w)
            wall[name].append(w)
            peak[name].append(mib)
    med = {k: statistics.median(v) for k, v in clock.items()}
    unit = med["train"] + med["step"]
    rb = estimator_rows(ctx, E, U, geo, cases=[("token_mean", "score"), ("token_mean", "rao_blackwell")])["rows"]
    ctx.zero_grad()
    se_d, se_p = res.get("SE_deltaH_true_minus_pred", math.nan), res.get("SE_deltaH_pred", math.nan)
    L = torch.cat([E.gen_lengths.flatten(), U.gen_lengths.flatten()]).double()
    return {"T": T, "T_padded": E.input_ids.shape[-1], "mean_length": float(L.mean()),
            "frac_full_length": float((L >= T).double().mean()), "response_tokens": n_tok,
            "sample_s": cpu_s if lm.device.type == "cpu" else wall_s, "sample_peak_abs_mib": samp_abs,
            "unit_s": unit, "train_s": med["train"], "step_s": med["step"], "probe_s": med["probe"],
            "probe_units": med["probe"] / unit, "wall_s": wall,
            "probe_ms_per_token": 1e3 * med["probe"] / n_tok, "unit_ms_per_token": 1e3 * unit / n_tok,
            "peak_mib": {k: max(v) for k, v in peak.items()},
            "probe_peak_kib_per_token": 1024 * max(peak["probe"]) / n_tok,
            "train_peak_kib_per_token": 1024 * max(peak["train"]) / n_tok,
            "ESS_frac_per_decision": res.get("ESS_frac_per_decision", math.nan),
            "ESS_frac_sequence": res.get("ESS_frac_sequence", math.nan),
            "SE_score_token_mean": rb[("token_mean", "score")]["SE"],
            "SE_rb_token_mean": rb[("token_mean", "rao_blackwell")]["SE"],
            "rb_gain": rb[("token_mean", "rao_blackwell")]["SE_ratio"],
            "SE_diff_over_SE_pred": se_d / se_p if se_p and se_p > 0 else math.nan,
            "deltaH_pred": res.get("deltaH_pred", math.nan), "deltaH_true": res.get("deltaH_true", math.nan)}


def report(a, rows: list[dict], info: dict) -> None:
    from entprobe.rollouts.logprobs import ENTROPY_CHUNK_ROWS

    clock = "CPU" if info["device"] == "cpu" else "wall"
    print(f"\n== {a.model} on {info['device']} ({info['n_params']:,} params), B_E = B_U = {a.B}, G = {a.G}, lr "
          f"{a.lr:g}, EOS {a.eos}, median of {a.reps}; {clock} time; ENTROPY_CHUNK_ROWS = {ENTROPY_CHUNK_ROWS}")
    print(f"{'T':>5}{'mean len':>9}{'full':>6}{'1 unit s':>9}{'probe units':>12}{'probe ms/tok':>13}"
          f"{'probe peak MiB':>15}{'KiB/tok':>8}{'train peak MiB':>15}{'ESS/N pd':>9}{'ESS/N seq':>10}"
          f"{'RB gain':>8}{'SE(d)/SE(p)':>12}")
    for r in rows:
        print(f"{r['T']:>5}{r['mean_length']:>9.1f}{r['frac_full_length']:>6.2f}{r['unit_s']:>9.2f}"
              f"{r['probe_units']:>12.2f}{r['probe_ms_per_token']:>13.2f}{r['peak_mib']['probe']:>15.0f}"
              f"{r['probe_peak_kib_per_token']:>8.0f}{r['peak_mib']['train']:>15.0f}"
              f"{r['ESS_frac_per_decision']:>9.4f}{r['ESS_frac_sequence']:>10.4f}{r['rb_gain']:>8.2f}"
              f"{r['SE_diff_over_SE_pred']:>12.2f}")
    n = [r["response_tokens"] for r in rows]
    for k in ("probe", "train"):
        s = per_token_slopes(n, [r["peak_mib"][k] for r in rows])
        print(f"  {k}: marginal KiB per response token between successive T: "
              + ", ".join(f"{1024 * x:.0f}" for x in s))
    print("  units: the probe's time over a training step's (train + step) on the same batches; peaks: the "
          "rise over each block's start; RB gain: SE of token_mean's score form / the Rao-Blackwellised X's")


def main() -> int:
    reexec_with_bench_env()
    a = parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_long.py: error: --device cuda but torch sees no CUDA device; use --device cpu or auto")
    if a.eos == "ignore":
        ignoring_eos()
    lm, task, ctx, geo = setup(a)
    info = {"model": a.model, "device": str(lm.device), "n_params": sum(p.numel() for p in ctx.params),
            "B": a.B, "G": a.G, "lr": a.lr, "eos": a.eos, "reps": a.reps}
    root = Path(a.batches) if a.batches else Path(tempfile.mkdtemp(prefix="bench_long_batches_"))
    rows = []
    for i, T in enumerate(sorted(a.tokens)):
        rows.append(one_length(a, T, lm, task, ctx, geo, root, warm=i == 0))
        report(a, rows, info)  # after every T, so a run cut short keeps the lengths it finished
        if a.json:
            write_json(Path(a.json), {**info, "rows": rows})
    return 0


def write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` to ``path`` atomically (a temporary file in the same folder, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
