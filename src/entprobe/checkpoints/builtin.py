"""The built-in default: a character-level tokenizer and a tiny Llama built in code (no download).

The vocabulary covers the arithmetic task (digits, operators, '=' and a space) plus the three
special tokens. Everything here is deterministic given a seed.
"""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHARS = list("0123456789+-*= ")


def build_char_tokenizer(chars: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer that splits text into single characters; ids 0/1/2 = pad/bos/eos."""
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS] + list(chars or CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS,
                                   eos_token=EOS, unk_token=PAD)
    fast.padding_side = "left"
    return fast


def tiny_llama_config(vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                      max_positions: int = 64) -> LlamaConfig:
    """A Llama-architecture config small enough to train and probe on 2 CPU cores in seconds."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager",
    )


def build_tiny_llama(vocab_size: int, seed: int = 0, **kwargs) -> LlamaForCausalLM:
    """A freshly initialised tiny Llama (fp32, eager attention so forward-mode AD works)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(vocab_size, **kwargs))
    return model
