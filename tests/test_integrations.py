"""The online probe inside TRL's GRPOTrainer (``EntropyProbeCallback``) on the built-in default model.

Two runs of 4 steps from the same seed, one with the callback probing every 2 steps: the weights,
the optimizer state and every metric the trainer logs are identical (the probe does not change the
trajectory), and the probed run's logs carry the prediction, its SE and the measured change at
steps 2 and 4. The closed-form update the prediction projects on is the step the trainer took.
"""
from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from grpo_setup import build_trainer  # noqa: E402

from conftest import U32, dot_set_spy, fp_tol, se_tol  # noqa: E402
from entprobe.config import ConfigError  # noqa: E402
from entprobe.integrations import EntropyProbeCallback, OnlineProbe  # noqa: E402

STEPS = 4


def train(tmp_path, probe: bool):
    """A run of STEPS steps; ``tr.reward_calls`` counts the completions its reward function scored."""
    tr = build_trainer(str(tmp_path), STEPS, prompts_per_step=4)
    tr.reward_calls = []
    reward = tr.reward_funcs[0]

    def counted(*args, **kwargs):
        tr.reward_calls.append(len(kwargs["completions"]))
        return reward(*args, **kwargs)
    tr.reward_funcs[0] = counted
    cb = None
    if probe:
        cb = EntropyProbeCallback(tr, every_n_steps=2, batch={"B_E": 6})
        tr.add_callback(cb)
    tr.train()
    return tr, cb


def watch_steps(monkeypatch) -> list[dict]:
    """Per probe, from copies the test keeps (the probe keeps none): the exact first-order change of
    the step taken, ``-Xbar . (theta_plus - theta)`` with every difference and product in fp64, and
    the magnitudes the fp32 rounding of the step moves it by: ``sum_i |Xbar_i theta_i|`` (the
    rounding of ``theta + Delta``) and ``sum_i |Xbar_i| sum_parts |Delta_part,i|`` (AdamW's
    closed-form parts, in fp64 from the optimizer's state before the step)."""
    from entprobe.math.adamw import AdamWHyper, adamw_update

    seen = []
    before, after = OnlineProbe.before_step, OnlineProbe.after_step

    def watched_before(self, step):
        predicted = before(self, step)
        if predicted:
            Xbar = [x.double() for x in self._pending.pred.Xbar]
            theta = [p.detach().double() for p in self._ctx.params]
            group = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
            parts_mag = 0.0
            for x, p in zip(Xbar, self._ctx.params):
                g, st = group[id(p)], self.optimizer.state[p]
                h = AdamWHyper(g["lr"], g["weight_decay"], *g["betas"], g["eps"], float(st["step"]))
                parts = adamw_update(-p.grad.double(), st["exp_avg"].double(), st["exp_avg_sq"].double(),
                                     p.detach().double(), h)
                parts_mag += float((x.abs() * sum(d.abs() for d in parts.values())).sum())
            seen.append({"Xbar": Xbar, "theta": theta, "N": sum(t.numel() for t in theta),
                         "theta_mag": sum(float((x * t).abs().sum()) for x, t in zip(Xbar, theta)),
                         "parts_mag": parts_mag})
        return predicted

    def watched_after(self):
        if self._pending is not None:
            w = seen[-1]
            w["exact"] = -sum(float(x.flatten() @ (p.detach().double() - t).flatten())
                              for x, p, t in zip(w.pop("Xbar"), self._ctx.params, w.pop("theta")))
        return after(self)
    monkeypatch.setattr(OnlineProbe, "before_step", watched_before)
    monkeypatch.setattr(OnlineProbe, "after_step", watched_after)
    return seen


@pytest.mark.numerics
def test_callback_logs_every_n_steps_and_leaves_the_trajectory_alone(tmp_path, monkeypatch):
    plain, _ = train(tmp_path / "plain", probe=False)
    seen = watch_steps(monkeypatch)
    probed, cb = train(tmp_path / "probed", probe=True)

    for (n, a), b in zip(plain.model.named_parameters(), probed.model.parameters()):
        assert torch.equal(a, b), f"{n} differs: the probe changed the trajectory"
    opt_a, opt_b = plain.optimizer.optimizer, probed.optimizer.optimizer
    for pa, pb in zip(opt_a.param_groups[0]["params"], opt_b.param_groups[0]["params"]):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_a.state[pa][k], opt_b.state[pb][k])
    logs_a = [h for h in plain.state.log_history if "loss" in h]
    logs_b = [h for h in probed.state.log_history if "loss" in h]
    assert len(logs_a) == len(logs_b) == STEPS
    for a, b in zip(logs_a, logs_b):
        ours = {k for k in b if k.startswith("entprobe/")}
        timing = {"step_time"}
        assert {k: v for k, v in a.items() if k not in timing} == \
               {k: v for k, v in b.items() if k not in ours | timing}

    assert probed.reward_calls == plain.reward_calls == [4 * 4] * STEPS  # E is generated, never scored

    probed_steps = [h["step"] for h in logs_b if "entprobe/deltaH_pred" in h]
    assert probed_steps == [2, 4]
    for h in logs_b:
        if h["step"] in probed_steps:
            for k in ("deltaH_pred", "SE_deltaH_pred"):
                assert math.isfinite(h[f"entprobe/{k}"]), k
            assert h["entprobe/SE_deltaH_pred"] > 0
    assert len(cb.history) == 2
    # this run's lr moves the tiny policy far: a probe whose weights are degenerate (ESS/N below the
    # threshold; measured 0.25 at step 2) is unmeasurable -- NaN and the reason, never a number
    for r in cb.history:
        measured = [r[k] for k in ("deltaH_true", "SE_deltaH_true", "deltaH_true_minus_pred", "SE_deltaH_true_minus_pred")]
        if r["measurable"]:
            assert all(math.isfinite(x) for x in measured) and r["ESS_frac"] >= 0.3
        else:
            assert all(math.isnan(x) for x in measured) and r["ESS_frac"] < 0.3
            assert "ESS/N" in r["unmeasurable_reason"] and r["pred_consistent"] is None
    assert any(r["measurable"] for r in cb.history)  # the measured path is exercised too
    assert len(seen) == 2
    for r, w in zip(cb.history, seen):
        # deltaH1_step is the step's own dot: Xbar . theta_plus - Xbar . theta summed in fp32 was off
        # by 5.6e-8 here (3e-4 on larger models), in fp64 it is the fp64 dot of the difference
        assert r["deltaH1_step"] == pytest.approx(w["exact"], rel=1e-12, abs=1e-15)
        # the closed-form update is the step the trainer took, up to fp32 rounding: the trainer's
        # theta (1 - lr wd) and theta + Delta each round by half an ulp of theta_i (u |theta_i|), and
        # each side's Delta_i carries the roundings of its chain of about 8 elementwise operations
        # (moments, root, denominator, quotient, scale, the parts' sum) relative to the parts it
        # adds, 16 for the two; the prediction's fp32 dot Xbar . Delta sums N such terms (fp_tol).
        # Worst case over the coordinates (absolute values summed), not the random-sign estimate
        # of the L2 norm, which this bound replaced (measured 4e-7 against it on an AMD EPYC).
        bound = (2 * U32 * w["theta_mag"] + fp_tol(torch.float32, w["parts_mag"], 8, k=2, worst_case=True)
                 + fp_tol(torch.float32, w["parts_mag"], w["N"]))
        assert abs(r["deltaH1_step"] - r["deltaH_pred"]) <= bound, (r["deltaH1_step"], r["deltaH_pred"], bound)
        assert bound < 1e-2 * abs(r["deltaH_pred"])  # a wrong update (a part lost) is off by more
        assert r["B_E"] == 6 and r["G"] == 4


def test_a_step_at_lr_0_is_not_probed_and_training_goes_on(tmp_path):
    """A schedule at its end (lr 0 from step 3 on): step 4 is due but a step at lr 0 changes
    nothing, so it is skipped with the command line's reason as a warning; step 2 is probed."""
    from grpo_setup import trainer_parts
    from trl import GRPOTrainer

    p = trainer_parts(str(tmp_path), STEPS, prompts_per_step=4)
    opt = torch.optim.AdamW(p["model"].parameters(), lr=1e-3, weight_decay=0.01)
    ended = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 2 else 0.0)  # steps 3 and 4 at lr 0
    tr = GRPOTrainer(model=p["model"], reward_funcs=p["reward_fn"], args=p["grpo_config"],
                     processing_class=p["tokenizer"], train_dataset=p["dataset"], optimizers=(opt, ended))
    cb = EntropyProbeCallback(tr, every_n_steps=2, batch={"B_E": 4})
    tr.add_callback(cb)
    with pytest.warns(UserWarning, match=r"the next step's lr is 0 \(the optimizer's param groups\)\. .* step 4 is not"):
        tr.train()
    assert tr.state.global_step == STEPS
    assert [r["step"] for r in cb.history] == [2] and [s for s, _ in cb.probe.skipped] == [4]
    assert [h["step"] for h in tr.state.log_history if "entprobe/deltaH_pred" in h] == [2]


def test_held_out_rows_read_at_once_or_one_by_one_give_the_same_batch(tmp_path):
    """``sample_held_out`` reads E's rows with the dataset's ``__getitems__`` (one read, as torch's
    DataLoader does) when it has one, else row by row: the same prompts, the same E."""
    tr = build_trainer(str(tmp_path), 1, prompts_per_step=4)
    cb = EntropyProbeCallback(tr, batch={"B_E": 3})
    batches = []
    for ds in (tr.train_dataset, [tr.train_dataset[i] for i in range(len(tr.train_dataset))]):
        tr.train_dataset = ds
        torch.manual_seed(0)
        batches.append(cb.sample_held_out(5))
    a, b = batches
    assert a.B == 3 and a.G == 4
    for k in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k


def test_callback_refuses_what_it_cannot_probe(tmp_path):
    tr = build_trainer(str(tmp_path), 1)
    with pytest.raises(ConfigError, match="objective.loss_type: does not apply to the online probe"):
        EntropyProbeCallback(tr, **{"objective.loss_type": "grpo"})
    with pytest.raises(ConfigError, match="batch.G: is your trainer's"):
        EntropyProbeCallback(tr, batch={"G": 8})
    with pytest.raises(ConfigError, match="sampling.coupling: the online probe draws its held-out E independently"):
        EntropyProbeCallback(tr, sampling={"coupling": "stratified"})  # else ignored in silence
    with pytest.raises(TypeError, match="pass config .* or overrides"):  # the callback's config is made once
        OnlineProbe(tr.model, tr.optimizer, None, lambda step: None, config=EntropyProbeCallback(tr).cfg,
                    batch={"B_E": 4})
    tr.num_iterations = 2
    with pytest.raises(ConfigError, match="num_iterations=2"):
        EntropyProbeCallback(tr)


def readme_snippets() -> list[str]:
    """The ```python blocks of docs/online.md's "Probe inside your training loop" section, in order."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "online.md").read_text()
    section = text[text.index("## Probe inside your training loop"):]
    section = section[:section.index("\n## ", 3)]
    return re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)


def test_readme_snippets_run(tmp_path):
    """The section's three snippets, verbatim, with the names they use bound to the built-in default:
    its model and AdamW (loaded as the command line loads them), tokenizer, arithmetic task, a
    DR-GRPO ``compute_loss`` and, for TRL, ``trainer_parts``."""
    from grpo_setup import trainer_parts

    from conftest import compose_cfg
    from entprobe.config import SamplingConfig
    from entprobe.math.estimators import y_loss
    from entprobe.rollouts.logprobs import token_logprobs
    from entprobe.cli.probe_job import to_typed
    from entprobe.checkpoints.models import load_model
    from entprobe.checkpoints.optim_state import load_optimizer
    from entprobe.checkpoints.preflight import check_inputs
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch
    from entprobe.tasks.arithmetic import ArithmeticTask

    api, trl_cb, loop = readme_snippets()
    cfg = to_typed(compose_cfg(tmp_path))
    lm = load_model(cfg.model)
    optimizer = load_optimizer(lm.model, check_inputs(cfg).optimizer_state).optimizer
    task = ArithmeticTask(512, 9, seed=0)
    calls = iter(range(1000))

    def compute_loss(model):
        b = sample_batch(model, lm.tokenizer, task, draw_prompt_indices(512, 8, next(calls)), 4,
                         SamplingConfig(), 0, "dr_grpo", 1e-6)
        S = token_logprobs(model, *b.flat("cpu")).logp.sum(-1).view(b.B, b.G)
        return -y_loss(S, b.advantages, b.Lmax) / b.B

    ns = {"model": lm.model, "optimizer": optimizer, "tokenizer": lm.tokenizer, "task": task,
          "compute_loss": compute_loss, "num_steps": 10}
    exec(api, ns)
    assert math.isfinite(ns["results"]["deltaH_pred"]) and ns["results"]["B_E"] == 8
    exec(loop, ns)
    assert [r["step"] for r in ns["probe"].history] == [10]

    ns = trainer_parts(str(tmp_path / "trl"), 10, prompts_per_step=4)
    exec(trl_cb, ns)
    logged = [h for h in ns["trainer"].state.log_history if "entprobe/deltaH_true" in h]
    assert [h["step"] for h in logged] == [10]


@contextlib.contextmanager
def loop_magnitudes():
    """Inside the block, the per-prompt backward's projections (``accumulate`` with
    ``probe.unit_backward=loop``: the running gradient sum dotted with the directions after each
    prompt, the prompt's projection the difference of two such dots) record, per prompt and
    direction, ``sum_i |X_n,i d_i|`` (``unit``: the prompt's own gradient, the difference of the
    running sums) and the running sums' ``sum_i |G_n,i d_i| + |G_n-1,i d_i|`` (``running``)."""
    from entprobe.pipeline.stages import accumulate

    out = {"unit": [], "running": [], "N": 0}
    prev = [None, None]

    def record(a, dset):
        g = torch.cat([x.detach().double().reshape(-1) for x in a])
        d = torch.stack([torch.cat([dset.block(i)[j].double().reshape(-1) for i in range(len(a))])
                         for j in range(dset.k)]).abs()
        run = d @ g.abs()
        last, last_run = (prev[0], prev[1]) if prev[0] is not None else (torch.zeros_like(g), 0.0)
        out["unit"].append(d @ (g - last).abs())  # one backward's gradient: the running sum's increase
        out["running"].append(run + last_run)
        prev[0], prev[1], out["N"] = g, run, g.numel()

    try:
        with dot_set_spy(accumulate, record):
            yield out
    finally:
        out["unit"], out["running"] = torch.stack(out["unit"]), torch.stack(out["running"])


def test_online_probe_paths_give_the_same_numbers(tmp_path, monkeypatch):
    """On one E and one step, the online probe's results do not depend on how E's per-prompt
    projections are taken (``probe.projection=ghost``: layer hooks in one backward; the default
    batched backward; a backward per prompt), and projecting onto the whole update alone (the
    online default) gives the SE of projecting onto each part and summing; the parts' values stay."""
    from grpo_setup import trainer_parts

    import entprobe.integrations.online as online
    from entprobe.tasks.arithmetic import ArithmeticTask

    p = trainer_parts(str(tmp_path), 1)
    model, tok, task = p["model"], p["tokenizer"], ArithmeticTask(512, 9, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ids = tok(["12+34=46", "5*6=30"], return_tensors="pt", padding=True).input_ids

    def gradient():
        opt.zero_grad()
        model(input_ids=ids).logits.square().mean().backward()
    gradient()
    opt.step()
    gradient()
    # "parts": each part projected separately, as entprobe.probe does, by a backward per prompt,
    # whose dots the recorder below reads (the magnitudes of the per-prompt sums)
    kinds = {"default": {}, "ghost": {"probe": {"projection": "ghost"}},
             "loop": {"probe": {"unit_backward": "loop"}}, "parts": {"probe": {"unit_backward": "loop"}}}
    probes = {k: OnlineProbe(model, opt, tok, task, every=1, batch={"B_E": 4}, **kw) for k, kw in kinds.items()}
    pending = {}
    for k, probe in probes.items():
        if k == "parts":
            predict = online.predict_on_held_out
            monkeypatch.setattr(online, "predict_on_held_out", lambda *a, **kw: predict(*a, **{**kw, "total_only": False}))
            with loop_magnitudes() as mags:
                assert probe.before_step(2)
        else:
            assert probe.before_step(2)
        pending[k] = probe._pending.pred.e
    opt.step()
    res = {k: (probe.after_step(), probe.history[-1]) for k, probe in probes.items()}
    ref, ref_full = res["default"]
    assert pending["default"].shape == (4, 1) and pending["parts"].shape == (4, 3)
    assert "SE_deltaH_pred_gradient" in res["parts"][1] and "SE_deltaH_pred_gradient" not in ref_full
    # the paths round each prompt's projection X_n . Delta (a sum over the N parameters) on their
    # own: fp_tol of its terms' magnitudes, per part, and of the running sums the per-prompt
    # backward differences (two_batch_bounds.py's argument); the prediction is their mean, its SE
    # their se_tol; the measured change a difference of entropy estimates whose terms sum to
    # 2 |H_orig| (N-term functions of the parameters), per prompt on the scale of B_E |H_orig|
    # (the prediction is one dot Xbar . Delta: the prompts' own magnitudes; their projections, by the
    # per-prompt backward a difference of running dots, also carry the running sums')
    N, B = mags["N"], pending["default"].shape[0]

    def tols(M):
        return {j: torch.tensor([fp_tol(torch.float32, float(m), N) for m in M[:, j]]) for j in range(3)}
    unit_tol, proj_tol = tols(mags["unit"]), tols(mags["unit"] + mags["running"])
    e_tol = sum(proj_tol.values())
    H = abs(ref_full["H_orig"])
    psi_tol = fp_tol(torch.float32, 2 * B * H, N)
    tol = {"deltaH_pred": float(sum(unit_tol.values()).mean()), "SE_deltaH_pred": se_tol(e_tol),
           "deltaH_pred_gradient": float(unit_tol[0].mean()), "deltaH_pred_momentum": float(unit_tol[1].mean()),
           "deltaH_true": fp_tol(torch.float32, 2 * H, N), "SE_deltaH_true_minus_pred": se_tol(e_tol + psi_tol)}
    assert tol["deltaH_pred"] < 1e-2 * abs(ref_full["deltaH_pred"])  # a lost part or prompt is off by more
    for k, (logged, full) in res.items():
        assert set(logged) == set(ref)
        e = pending[k].sum(1)
        assert ((e - pending["default"][:, 0]).abs() <= e_tol).all(), k
        for key, t in tol.items():
            assert abs(full[key] - ref_full[key]) <= t, (k, key, full[key], ref_full[key], t)
    assert ref_full["SE_deltaH_pred"] > 0 and ref_full["deltaH_pred_momentum"] != 0
