"""Which parameters drive the prediction: bars_dot split by parameter, layer and module kind; for a
PEFT adapter also by adapted module (a LoRA module's lora_A and lora_B terms summed)."""
from __future__ import annotations

import csv
import re
from collections import defaultdict
from pathlib import Path

from entprobe.runtime.atomic_io import atomic_open
from entprobe.checkpoints.peft import adapter_module

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def module_kind(name: str) -> str:
    """attention / mlp / embeddings / norms / lm_head / other, from a parameter name."""
    n = name.lower()
    if "lm_head" in n or n.startswith("output."):
        return "lm_head"
    if "embed" in n or "wte" in n or "wpe" in n:
        return "embeddings"
    if "norm" in n or n.endswith("ln_f.weight") or ".ln_" in n:
        return "norms"
    if any(k in n for k in ("attn", "attention", "q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention"
    if any(k in n for k in ("mlp", "ffn", "gate_proj", "up_proj", "down_proj", "fc")):
        return "mlp"
    return "other"


def layer_of(name: str) -> str:
    m = _LAYER.search(name)
    return f"layer_{int(m.group(1)):03d}" if m else "non_layer"


def module_of(name: str) -> str:
    """The module a parameter belongs to: the adapted module for a PEFT adapter's parameter
    (``model.layers.0.self_attn.q_proj`` for its ``...q_proj.lora_A.default.weight``), else the
    name without its last part."""
    return adapter_module(name) or name.rpartition(".")[0] or name


def summarize(names: list[str], terms: list[float], top_k: int = 10) -> tuple[dict[str, float], list[dict]]:
    """Flat results (top-k by |term| per parameter, per layer, per kind; with adapter parameters
    also top-k by |term| per adapted module) and the full table rows (with each row's module and
    its module's summed term).

    ``terms[i] = Xbar_i . P_i . Ybar_i``; they sum to bars_dot. Shares are term / bars_dot.
    """
    total = sum(terms)
    by_kind, by_layer, by_module = defaultdict(float), defaultdict(float), defaultdict(float)
    rows = []
    for n, t in zip(names, terms):
        by_kind[module_kind(n)] += t
        by_layer[layer_of(n)] += t
        by_module[module_of(n)] += t
        rows.append({"parameter": n, "module": module_of(n), "layer": layer_of(n), "kind": module_kind(n),
                     "bars_dot_term": t, "share": t / total if total else float("nan")})
    for r in rows:
        r["module_bars_dot_term"] = by_module[r["module"]]
    flat = {f"attr/kind/{k}": v for k, v in sorted(by_kind.items())}
    flat.update({f"attr/layer/{k}": v for k, v in sorted(by_layer.items())})
    flat.update(_top("top", [(r["parameter"], r["bars_dot_term"]) for r in rows], top_k))
    if any(adapter_module(n) for n in names):
        flat.update(_top("module_top", list(by_module.items()), top_k))
    return flat, rows


def _top(label: str, items: list[tuple[str, float]], top_k: int) -> dict:
    """``attr/<label>NN/name`` and ``/bars_dot_term`` of the top_k items by |term|."""
    out = {}
    for i, (name, t) in enumerate(sorted(items, key=lambda it: -abs(it[1]))[:top_k]):
        out[f"attr/{label}{i + 1:02d}/name"] = name
        out[f"attr/{label}{i + 1:02d}/bars_dot_term"] = t
    return out


def write_csv(rows: list[dict], path: str | Path) -> None:
    with atomic_open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
