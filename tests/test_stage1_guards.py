"""Stage 1 guards: every misuse ends in a clear error that says what and where; and
``probe.save_buffers`` writes buffers whose dot reproduces the reported bars_dot."""
from __future__ import annotations

import csv
import json

import pytest
import torch

from entprobe.math import paramvec as pv
from entprobe.pipeline.stages.accumulate import accumulate, x_loss_of, y_loss_of
from entprobe.pipeline.stages.context import ProbeContext
from exact_model import make_setup


@pytest.fixture()
def setup():
    return make_setup()


@pytest.fixture()
def batch(setup):
    return setup.sample(4, 2, seed=1)


def test_inference_mode_is_refused(setup, batch):
    ctx = setup.ctx("sequence", mb_size=2)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        accumulate(ctx, batch, x_loss_of(ctx), "X over E")


def test_no_grad_outside_is_overridden(setup, batch):
    """``torch.no_grad()`` around the probe is harmless: passes re-enable grad (same buffers)."""
    ctx = setup.ctx("sequence", mb_size=2)
    ref = accumulate(ctx, batch, x_loss_of(ctx), "X over E").sum_buf
    with torch.no_grad():
        got = accumulate(ctx, batch, x_loss_of(ctx), "X over E").sum_buf
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_single_response_per_prompt_is_refused(setup):
    ctx = setup.ctx("sequence", mb_size=2)
    one = setup.sample(2, 1, seed=1)
    with pytest.raises(ValueError, match=r"Y over U: G=1; need >= 2"):
        accumulate(ctx, one, y_loss_of(ctx), "Y over U")


def test_empty_batch_is_refused(setup, batch):
    ctx = setup.ctx("sequence", mb_size=2)
    with pytest.raises(ValueError, match="X over E: the batch is empty"):
        accumulate(ctx, batch.select(slice(0, 0)), x_loss_of(ctx), "X over E")


def test_all_parameters_frozen(setup, batch):
    for p in setup.model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        pv.trainable(setup.model)


def test_frozen_after_context_has_no_gradient_path(setup, batch):
    ctx = setup.ctx("sequence", mb_size=2)
    for p in setup.model.parameters():
        p.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"X over E microbatch prompts \[0, 2\).*no gradient path"):
        accumulate(ctx, batch, x_loss_of(ctx), "X over E")


def test_loss_detached_from_S_has_no_gradient_path(setup, batch):
    ctx = setup.ctx("sequence", mb_size=2)
    with pytest.raises(RuntimeError, match="no gradient path"):
        accumulate(ctx, batch, lambda fwd, mb: fwd.S.detach().sum(), "X over E")


def test_loss_reaching_none_of_the_probed_parameters(setup, batch):
    ctx = setup.ctx("sequence", mb_size=2)
    stray = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))  # not in the model
    ctx = ProbeContext(ctx.model, ["stray"], [stray], ctx.device, None, 1.0, "sequence", 2,
                       ctx.buffers_device, ctx.buffers_dtype)
    with pytest.raises(RuntimeError, match="no gradient for any trainable parameter"):
        accumulate(ctx, batch, x_loss_of(ctx), "X over E")


def test_nan_weights_name_the_microbatch(setup, batch):
    with torch.no_grad():
        setup.model.lm_head.weight[0, 0] = float("nan")
    ctx = setup.ctx("sequence", mb_size=2)
    with pytest.raises(FloatingPointError, match=r"non-finite log-probs in X over E microbatch prompts \[0, 2\)"):
        accumulate(ctx, batch, x_loss_of(ctx), "X over E")


def test_nan_in_a_later_microbatch_is_located(setup, batch):
    """NaN that appears only in the second microbatch is reported there, not in the first."""
    calls = {"n": 0}

    def poison_second_call(module, inputs, output):
        calls["n"] += 1
        return output * float("nan") if calls["n"] == 2 else output

    setup.model.model.norm.register_forward_hook(poison_second_call)
    ctx = setup.ctx("sequence", mb_size=2)
    with pytest.raises(FloatingPointError, match=r"Y over U microbatch prompts \[2, 4\)"):
        accumulate(ctx, batch, y_loss_of(ctx), "Y over U")
    assert calls["n"] == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_names_the_parameter(setup, batch, bad):
    name = "model.layers.0.mlp.down_proj.weight"
    dict(setup.model.named_parameters())[name].register_hook(lambda g: g * bad)
    ctx = setup.ctx("sequence", mb_size=2)
    with pytest.raises(FloatingPointError, match=r"X over E microbatch prompts \[0, 2\): NaN/Inf gradient in "
                                                 r"\['model\.layers\.0\.mlp\.down_proj\.weight'\]"):
        accumulate(ctx, batch, x_loss_of(ctx), "X over E")


@pytest.mark.parametrize("path", ["keep_unit_grads", "directions", "keep+directions"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_unit_gradient_is_located_on_the_per_unit_paths(setup, batch, path, bad):
    """The per-unit paths check a unit through a cheaper witness (the kept units' sum, or the
    unit's projections); a bad second unit is still named, with its parameter."""
    from entprobe.math import paramvec as pv

    name = "model.layers.0.mlp.down_proj.weight"
    calls = {"n": 0}

    def poison_second(g):
        calls["n"] += 1
        return g * bad if calls["n"] == 2 else g
    dict(setup.model.named_parameters())[name].register_hook(poison_second)
    ctx = setup.ctx("sequence", mb_size=2)
    dirs = None
    if "directions" in path:
        dirs = pv.empty_directions(2, ctx.params, ctx.device, torch.float32)
        dirs.mat.copy_(torch.randn_like(dirs.mat))
    with pytest.raises(FloatingPointError, match=r"Y over U microbatch prompts \[1, 2\): NaN/Inf gradient in "
                                                 r"\['model\.layers\.0\.mlp\.down_proj\.weight'\]"):
        accumulate(ctx, batch, y_loss_of(ctx), "Y over U", directions=dirs,
                   keep_unit_grads="keep" in path)


def test_non_finite_direction_is_blamed_when_the_gradient_is_finite(setup, batch):
    from entprobe.math import paramvec as pv

    ctx = setup.ctx("sequence", mb_size=2)
    dirs = pv.empty_directions(2, ctx.params, ctx.device, torch.float32)
    dirs.mat.zero_()
    dirs.mat[1, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="a projection direction holds NaN/Inf"):
        accumulate(ctx, batch, x_loss_of(ctx), "X over E", directions=dirs)


# ---------------------------------------------------------------- save_buffers through run(cfg)
def test_save_buffers_reproduce_bars_dot(cfg, tmp_path):
    """run(cfg) on the built-in checkpoint (conftest's shrunk composed config: B_E = B_U = G = 4)."""
    from safetensors.torch import load_file

    from entprobe.cli.probe_job import run

    cfg.importance.enabled = False
    cfg.probe.variance_enabled = False
    cfg.probe.save_buffers = True
    res = run(cfg)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["bars_dot"] == res["bars_dot"] and res["bars_dot"] != 0
    tensors = load_file(str(tmp_path / "buffers.safetensors"))
    names = sorted({k.split("/", 1)[1] for k in tensors})
    assert set(tensors) == {f"{kind}/{n}" for kind in ("Xbar", "Ybar_raw", "P") for n in names}
    with (tmp_path / "attribution.csv").open() as f:
        rows = {r["parameter"]: float(r["bars_dot_term"]) for r in csv.DictReader(f)}
    assert sorted(rows) == names  # one entry per trainable parameter
    terms = {n: float((tensors[f"Xbar/{n}"].double() * tensors[f"P/{n}"].double()
                       * tensors[f"Ybar_raw/{n}"].double()).sum()) for n in names}
    for n in names:
        assert tensors[f"Xbar/{n}"].shape == tensors[f"P/{n}"].shape == tensors[f"Ybar_raw/{n}"].shape
        # the probe rounds P * Ybar to fp32 before the fp64 dot: agreement to ~1e-7 relative
        assert terms[n] == pytest.approx(rows[n], rel=1e-6, abs=1e-9 * abs(res["bars_dot"]))
    dot = sum(terms.values())
    assert dot == pytest.approx(res["bars_dot"], rel=1e-6)
    assert res["deltaH1"] == pytest.approx(-res["lr"] * dot, rel=1e-6)
