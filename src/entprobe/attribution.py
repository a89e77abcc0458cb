"""Which parameters drive the prediction: bars_dot split by parameter, layer and module kind."""
from __future__ import annotations

import csv
import re
from collections import defaultdict
from pathlib import Path

from entprobe.atomic_io import atomic_open

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


def summarize(names: list[str], terms: list[float], top_k: int = 10) -> tuple[dict[str, float], list[dict]]:
    """Flat results (top-k by |term| per parameter, per layer, per kind) and the full table rows.

    ``terms[i] = Xbar_i . P_i . Ybar_i``; they sum to bars_dot. Shares are term / bars_dot.
    """
    total = sum(terms)
    by_kind, by_layer = defaultdict(float), defaultdict(float)
    rows = []
    for n, t in zip(names, terms):
        by_kind[module_kind(n)] += t
        by_layer[layer_of(n)] += t
        rows.append({"parameter": n, "layer": layer_of(n), "kind": module_kind(n), "bars_dot_term": t,
                     "share": t / total if total else float("nan")})
    flat = {f"attr/kind/{k}": v for k, v in sorted(by_kind.items())}
    flat.update({f"attr/layer/{k}": v for k, v in sorted(by_layer.items())})
    for i, r in enumerate(sorted(rows, key=lambda r: -abs(r["bars_dot_term"]))[:top_k]):
        flat[f"attr/top{i + 1:02d}/name"] = r["parameter"]
        flat[f"attr/top{i + 1:02d}/bars_dot_term"] = r["bars_dot_term"]
    return flat, rows


def write_csv(rows: list[dict], path: str | Path) -> None:
    with atomic_open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
