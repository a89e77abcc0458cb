"""Saved E/U batches: a reloaded run reproduces the original bit for bit whatever the seeds say."""
from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from conftest import compose_cfg
from entprobe.config import ConfigError
from entprobe.cli.probe_job import run
from entprobe.rollouts.sampling import RolloutBatch

KEYS = ("deltaH1", "SE_deltaH1", "deltaH_true", "deltaH1_step", "H_orig", "bars_dot")


def test_loaded_batches_reproduce_the_run_bit_for_bit(tmp_path):
    saved = tmp_path / "batches"
    first = run(compose_cfg(tmp_path / "a", f"batch.save='{saved}'"))
    assert (saved / "E.pt").is_file() and (saved / "U.pt").is_file()
    other_seeds = ("batch.seed_E=11", "batch.seed_U=12", "seed=13")
    again = run(compose_cfg(tmp_path / "b", f"batch.load='{saved}'", *other_seeds))
    for k in KEYS:
        assert again[k] == first[k], k  # bit-identical, not approximately equal
    for k in ("batch_E/reward_mean", "batch_U/reward_mean", "batch_E/mean_gen_length"):
        assert again[k] == first[k], k
    # The seeds do matter when sampling: the identity above comes from the loaded batches.
    fresh = run(compose_cfg(tmp_path / "c", *other_seeds, "importance.enabled=false",
                            "probe.variance_enabled=false"))  # deltaH1 is all this needs
    assert fresh["deltaH1"] != first["deltaH1"]


def _batch(seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    B, G, T = 3, 2, 7
    resp = torch.zeros(B, G, T, dtype=torch.long)
    resp[..., 4:] = (torch.rand(B, G, 3, generator=g) < 0.8).long()
    return RolloutBatch(
        input_ids=torch.randint(0, 18, (B, G, T), generator=g),
        attention_mask=torch.ones(B, G, T, dtype=torch.long),
        response_mask=resp,
        sampler_logprobs=-torch.rand(B, G, T, generator=g) * resp,
        rewards=torch.rand(B, G, generator=g).round(),
        advantages=torch.randn(B, G, generator=g),
        prompt_index=torch.tensor([5, 0, 2]),
        temperature=0.7,
    )


def test_rollout_batch_save_load_round_trip(tmp_path):
    b = _batch(0)
    b.save(tmp_path / "sub" / "E.pt")  # creates the folder, writes atomically
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["E.pt"]
    c = RolloutBatch.load(tmp_path / "sub" / "E.pt")
    for f in fields(RolloutBatch):
        x, y = getattr(b, f.name), getattr(c, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name
    assert torch.equal(c.Lmax, b.Lmax) and torch.equal(c.S_sampler, b.S_sampler)


def test_loading_with_a_different_G_is_refused(tmp_path):
    saved = tmp_path / "batches"
    _batch(1).save(saved / "E.pt")
    _batch(2).save(saved / "U.pt")
    with pytest.raises(ConfigError, match=r"the saved E has G=2 responses per prompt, the config batch\.G=4; set batch\.G=2"):
        run(compose_cfg(tmp_path / "run", f"batch.load='{saved}'"))
    assert not (tmp_path / "run" / "results.json").exists()
