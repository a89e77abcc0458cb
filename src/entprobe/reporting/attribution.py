"""Which parameters drive the prediction, split by parameter, layer and module kind (for a PEFT
adapter also by adapted module: a LoRA module's lora_A and lora_B terms summed).

Two breakdowns:
- the headline's, ``attr_pred/*``: each parameter tensor's part of ``deltaH_pred = -Xbar . Delta
  theta`` (the AdamW step the optimizer will take), ``-Xbar_i . Delta theta_i`` in nats with the
  sign of the entropy change (negative: entropy falls); they sum to ``deltaH_pred``. This is what
  attribution.png draws;
- deltaH1's, ``attr/*``: the terms ``Xbar_i . P_i . Ybar_i`` of ``bars_dot`` (the Adam-preconditioned
  gradient step, not the one AdamW takes; ``deltaH1 = -lr bars_dot``), raw, positive = entropy
  falls. attribution.csv gives both per parameter, and deltaH1's also in nats (``deltaH1_term``).
"""
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


def summarize(names: list[str], terms: list[float], top_k: int = 10, step_terms: list[float] | None = None,
              lr: float = float("nan")) -> tuple[dict[str, float], list[dict]]:
    """Flat results (top-k by |term| per parameter, per layer, per kind; with adapter parameters
    also top-k by |term| per adapted module) and the full table rows (with each row's module and
    its module's summed term).

    ``terms[i] = Xbar_i . P_i . Ybar_i``; they sum to bars_dot. Shares are term / bars_dot.
    ``step_terms[i] = Xbar_i . Delta theta_i`` (the whole update, every part), when given: the
    headline's breakdown ``attr_pred/*`` (``headline``) and the rows' ``deltaH_pred_term``
    (``-step_terms[i]``, nats) and ``pred_share``; ``lr`` gives the rows' ``deltaH1_term``
    (``-lr terms[i]``, nats).
    """
    total = sum(terms)
    by_kind, by_layer, by_module = defaultdict(float), defaultdict(float), defaultdict(float)
    rows = []
    for n, t in zip(names, terms):
        by_kind[module_kind(n)] += t
        by_layer[layer_of(n)] += t
        by_module[module_of(n)] += t
        rows.append({"parameter": n, "module": module_of(n), "layer": layer_of(n), "kind": module_kind(n),
                     "bars_dot_term": t, "share": t / total if total else float("nan"), "deltaH1_term": -lr * t})
    for r in rows:
        r["module_bars_dot_term"] = by_module[r["module"]]
    flat = {}
    if step_terms is not None:
        contrib = [-float(t) for t in step_terms]
        pred = sum(contrib)
        for r, c in zip(rows, contrib):
            r.update(deltaH_pred_term=c, pred_share=c / pred if pred else float("nan"))
        flat.update(headline(names, contrib, top_k))
    flat.update({f"attr/kind/{k}": v for k, v in sorted(by_kind.items())})
    flat.update({f"attr/layer/{k}": v for k, v in sorted(by_layer.items())})
    flat.update(_top("top", [(r["parameter"], r["bars_dot_term"]) for r in rows], top_k))
    if any(adapter_module(n) for n in names):
        flat.update(_top("module_top", list(by_module.items()), top_k))
    return flat, rows


def headline(names: list[str], contrib: list[float], top_k: int = 10) -> dict:
    """``attr_pred/kind/<kind>``, ``attr_pred/layer/<layer>`` (sums of ``contrib``, each parameter's
    part of ``deltaH_pred`` in nats) and ``attr_pred/topNN/{name,deltaH_pred}`` by |part|. Every
    kind of ``KINDS`` appears (0 when the model has none), so runs compare key by key."""
    by_kind, by_layer = dict.fromkeys(KINDS, 0.0), defaultdict(float)
    for n, c in zip(names, contrib):
        by_kind[module_kind(n)] += c
        by_layer[layer_of(n)] += c
    out = {f"attr_pred/kind/{k}": v for k, v in by_kind.items() if k != "other" or v}
    out.update({f"attr_pred/layer/{k}": v for k, v in sorted(by_layer.items())})
    out.update(_top("top", list(zip(names, contrib)), top_k, "attr_pred", "deltaH_pred"))
    return out


KINDS = ("attention", "mlp", "embeddings", "norms", "lm_head", "other")  # module_kind's, in plot order


def _top(label: str, items: list[tuple[str, float]], top_k: int, prefix: str = "attr",
         value: str = "bars_dot_term") -> dict:
    """``<prefix>/<label>NN/name`` and ``/<value>`` of the top_k items by |term|."""
    out = {}
    for i, (name, t) in enumerate(sorted(items, key=lambda it: -abs(it[1]))[:top_k]):
        out[f"{prefix}/{label}{i + 1:02d}/name"] = name
        out[f"{prefix}/{label}{i + 1:02d}/{value}"] = t
    return out


CSV_FIRST = ("parameter", "module", "layer", "kind", "deltaH_pred_term", "pred_share", "deltaH1_term")


def write_csv(rows: list[dict], path: str | Path) -> None:
    """attribution.csv: one row per parameter tensor, the headline's part (nats) first."""
    first = [c for c in CSV_FIRST if c in rows[0]]
    with atomic_open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=first + [c for c in rows[0] if c not in first])
        w.writeheader()
        w.writerows(rows)
