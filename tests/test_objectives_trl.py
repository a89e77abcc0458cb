"""objective=trl against TRL's GRPOTrainer itself (trl installed: ``pip install -e ".[trl]"``).

On the built-in tiny Llama, TRL's own ``_generate_and_score_completions`` samples a generation
batch, scores it with a reward function and computes its advantages; the same prompts, completions
and rewards become an entprobe ``RolloutBatch``. For every loss type and reward scaling TRL offers,
our advantages equal TRL's, and our Ybar (the probe's Y accumulation with the preset's weights)
equals minus the gradient of ``GRPOTrainer.compute_loss`` on that batch (fp32, 1e-5 relative).
The ground-truth step (``reuse_probe_gradient``, AdamW) equals TRL's own ``training_step`` followed
by the same optimizer's step from the same state.
"""
from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from entprobe.math import paramvec as pv  # noqa: E402
from entprobe.checkpoints.builtin import build_char_tokenizer, build_tiny_llama  # noqa: E402
from entprobe.config import ObjectiveConfig, ObjectivePreset  # noqa: E402
from entprobe.rollouts.objectives import TRL_LOSS_TYPES, prepare  # noqa: E402
from entprobe.rollouts.sampling import RolloutBatch  # noqa: E402
from entprobe.pipeline.stages.accumulate import accumulate, y_loss_of  # noqa: E402
from entprobe.pipeline.stages.context import ProbeContext  # noqa: E402

B, G, MAX_NEW = 3, 4, 5
PROMPTS = ["1+2=", "13+4=", "5+16="]  # of different lengths: left padding in the batch


def flat(buf) -> torch.Tensor:
    return torch.cat([b.reshape(-1) for b in buf])


class Recorder:
    """A TRL reward function ``(prompts, completions, **columns) -> list[float]`` that keeps its calls."""

    __name__ = "length_mod_3"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, **columns):
        out = [float(len(c) % 3) for c in completions]
        self.calls.append(out)
        return out


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = build_char_tokenizer()
    model = build_tiny_llama(len(tok), seed=0)
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=B * G,
                      num_generations=G, max_completion_length=MAX_NEW, use_cpu=True, report_to=[], bf16=False,
                      save_strategy="no", seed=0, temperature=1.0, learning_rate=1e-2, weight_decay=0.1,
                      max_grad_norm=None)
    reward = Recorder()
    tr = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                     train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    tr.current_gradient_accumulation_steps = 1  # set by the training loop; one microbatch per step here
    tr.recorder = reward
    return tr


def generation_batch(tr, scale_rewards: str) -> tuple[dict, RolloutBatch]:
    """TRL's inputs for one step (its sampling, rewards and advantages) and the same batch as a
    RolloutBatch (prompt left-padded, completion right-padded: the layout both use)."""
    tr.scale_rewards = scale_rewards
    torch.manual_seed(11)
    tr.model.train()
    inputs = tr._generate_and_score_completions(next(iter(tr.get_train_dataloader())))
    rewards = torch.tensor(tr.recorder.calls[-1]).view(B, G)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    resp = torch.cat([torch.zeros_like(inputs["prompt_mask"]), inputs["completion_mask"]], 1)
    T = ids.shape[1]
    batch = RolloutBatch(ids.view(B, G, T), att.view(B, G, T).long(), resp.view(B, G, T).long(),
                         torch.zeros(B, G, T), rewards, torch.zeros(B, G), torch.arange(B))
    assert batch.gen_lengths.unique().numel() > 1, "the check needs responses of different lengths"
    assert not bool(inputs["prompt_mask"].all()), "the check needs left-padded prompts"
    return inputs, batch


def trl_objective(loss_type: str, scale_rewards: str, epsilon_high=None) -> ObjectiveConfig:
    return ObjectiveConfig(preset=ObjectivePreset.trl, loss_type=loss_type, scale_rewards=scale_rewards,
                           max_completion_length=MAX_NEW, beta=0.0, num_iterations=1, epsilon=0.2,
                           epsilon_high=epsilon_high)


def probe_ybar(tr, batch: RolloutBatch, ocfg: ObjectiveConfig) -> tuple[list, RolloutBatch, ProbeContext]:
    """Ybar (a buffer per parameter) from the probe's Y accumulation, the batch with the preset's
    advantages and the context bound to the objective."""
    U, objective = prepare(ocfg, batch, MAX_NEW)
    names, params = pv.trainable(tr.model)
    ctx = ProbeContext(tr.model, names, params, torch.device("cpu"), None, 1.0, "dr_grpo", 2,
                       torch.device("cpu"), torch.float32, objective=objective)
    acc = accumulate(ctx, U, y_loss_of(ctx), "Y over U")
    return pv.scale_(acc.sum_buf, 1.0 / U.B), U, ctx


def trl_minus_grad(tr, inputs) -> torch.Tensor:
    params = [p for p in tr.model.parameters() if p.requires_grad]
    loss = tr.compute_loss(tr.model, inputs)
    return -torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_ybar_is_minus_the_gradient_of_grpo_trainers_loss(trainer, scale_rewards):
    inputs, batch = generation_batch(trainer, scale_rewards)
    checked = 0
    for loss_type in TRL_LOSS_TYPES:
        for level in ("token", "sequence"):
            if level == "sequence" and loss_type not in ("grpo", "luspo"):
                continue  # TRL warns against the others with sequence-level ratios (same gradient at ratio 1)
            for eps_high in ([0.2, 5.0] if loss_type == "cispo" else [None]):
                trainer.loss_type, trainer.importance_sampling_level = loss_type, level
                trainer.epsilon_high = eps_high if eps_high is not None else trainer.epsilon_low
                Ybar, U, _ = probe_ybar(trainer, batch, trl_objective(loss_type, scale_rewards, eps_high))
                ours = flat(Ybar)
                torch.testing.assert_close(U.advantages.reshape(-1), inputs["advantages"], rtol=1e-6, atol=1e-6)
                theirs = trl_minus_grad(trainer, inputs)
                assert theirs.norm() > 0
                rel = float((ours - theirs).norm() / theirs.norm())
                assert rel < 1e-5, f"{loss_type} ({level}, scale_rewards={scale_rewards}): relative error {rel:.2e}"
                checked += 1
    assert checked == len(TRL_LOSS_TYPES) + 3


def test_loss_types_are_told_apart(trainer):
    """The check above has the power to fail: the aggregations give different gradients here."""
    inputs, batch = generation_batch(trainer, "none")
    grads = {}
    for loss_type in ("grpo", "dr_grpo", "dapo", "luspo"):
        trainer.loss_type, trainer.importance_sampling_level = loss_type, "token"
        grads[loss_type] = trl_minus_grad(trainer, inputs)
    ours = flat(probe_ybar(trainer, batch, trl_objective("grpo", "none"))[0])
    for loss_type in ("dr_grpo", "dapo", "luspo"):
        rel = float((ours - grads[loss_type]).norm() / grads[loss_type].norm())
        assert rel > 1e-2, f"grpo's Ybar is within {rel:.1e} of {loss_type}'s gradient"


def test_ground_truth_step_is_trls_training_step(trainer):
    """``run_ground_truth``'s step (the reused -Ybar, AdamW) lands where TRL's ``training_step`` plus
    the same AdamW's step lands, from the same weights and optimizer state."""
    from entprobe.pipeline.stages.ground_truth import StepInputs, run_ground_truth
    from omegaconf import OmegaConf
    from entprobe.config import ImportanceConfig

    inputs, batch = generation_batch(trainer, "group")
    trainer.loss_type, trainer.importance_sampling_level = "dr_grpo", "token"
    model = trainer.model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    # a state with history (Adam's first step from zero moments is g / (|g| + eps): it turns
    # gradients that agree to 1e-6 on near-zero coordinates into different steps)
    gen = torch.Generator().manual_seed(0)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    opt.step()
    model.zero_grad(set_to_none=True)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    Yb, U, ctx = probe_ybar(trainer, batch, trl_objective("dr_grpo", "group"))
    icfg = OmegaConf.to_object(OmegaConf.structured(ImportanceConfig(resample_on_low_ess=False)))
    theta_plus = {}

    def grab():
        theta_plus.update({k: v.detach().clone() for k, v in model.state_dict().items()})

    inp = StepInputs(opt, 1e-2, [torch.zeros_like(p) for p in ctx.params], Yb, None, U.B,
                     torch.zeros(B, G), torch.zeros_like(U.sampler_logprobs), None)
    run_ground_truth(ctx, U, U, inp, icfg, fail_after_step=grab)
    for k, v in model.state_dict().items():
        assert torch.equal(v, start[k]), f"{k} not restored"
    # TRL's own step from the same state
    trainer.optimizer = opt
    model.zero_grad(set_to_none=True)
    generate = trainer._prepare_inputs  # training_step generates from a dataset batch: hand it this one
    trainer._prepare_inputs = lambda _batch: inputs
    try:
        trainer.training_step(model, None, num_items_in_batch=inputs["num_items_in_batch"])
    finally:
        trainer._prepare_inputs = generate
    opt.step()
    moved = 0.0
    for k, v in model.state_dict().items():
        torch.testing.assert_close(theta_plus[k], v, rtol=1e-5, atol=1e-7)
        moved = max(moved, float((v - start[k]).abs().max()))
    assert moved > 1e-4  # the step moved the weights
    with torch.no_grad():
        model.load_state_dict(start)
