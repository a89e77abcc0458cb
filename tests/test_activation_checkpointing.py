"""``model.activation_checkpointing=true``: the gradient passes recompute each decoder layer in
the backward (the layers run twice per gradient pass) and every number is the same as without it,
on every projection path."""
from __future__ import annotations

import pytest
import torch

from conftest import compose_cfg, recording_units
from entprobe.checkpoints import models
from entprobe.cli.probe_job import run
from two_batch_bounds import assert_runs_agree, per_unit

KEYS = ("deltaH1", "SE_deltaH1", "deltaH_pred", "SE_deltaH_pred", "deltaH_true", "SE_deltaH_true")


def _layer_calls(monkeypatch) -> list[int]:
    """Counts the first decoder layer's MLP calls while gradients are enabled (a recomputation
    runs the layer's submodules again; the checkpointed layer's own hooks fire once)."""
    calls = [0]
    load = models.load_model

    def counting(cfg, check_tokenizer=None):
        lm = load(cfg, check_tokenizer)
        layer = next(m for n, m in lm.model.named_modules() if n.endswith("layers.0.mlp"))

        def hook(*_):
            calls[0] += torch.is_grad_enabled()
        layer.register_forward_pre_hook(hook)
        return lm

    monkeypatch.setattr("entprobe.cli.probe_job.load_model", counting)
    return calls


@pytest.mark.parametrize("projection", ["stored", "fused", "backward"])
def test_same_numbers_and_layers_recomputed(tmp_path, monkeypatch, projection):
    res, calls = {}, {}
    for on in (False, True):
        n = _layer_calls(monkeypatch)
        res[on] = run(compose_cfg(tmp_path / str(on), f"probe.projection={projection}",
                                  f"model.activation_checkpointing={str(on).lower()}"))
        calls[on] = n[0]
    assert calls[True] > calls[False] > 0  # the backward re-ran the layer's forward
    # the recomputed layers are the same operations on the same inputs: equal up to the rounding
    # of the per-unit sums (two_batch_bounds.py; the magnitudes from a per-unit backward run)
    with recording_units() as rec:
        ref = run(compose_cfg(tmp_path / "ref", "probe.projection=backward"))
    assert_runs_agree(res[True], per_unit(tmp_path / "True"), res[False], per_unit(tmp_path / "False"),
                      rec.split(ref["B_E"]), projection, KEYS)


def test_a_model_without_support_is_refused():
    class Plain(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(models.ConfigError, match="activation_checkpointing"):
        models.enable_activation_checkpointing(Plain())
