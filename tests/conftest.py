"""Shared test helpers: compose the real Hydra config shipped inside the package, shrunk for tests.

    cfg = compose_cfg(tmp_path, "importance.is_mode=clip")   # a DictConfig, exactly as the CLI sees it
    results = run(cfg)

The config directory is the *installed* package's ``entprobe/conf`` (what a wheel ships), so tests
fail when a YAML is missing from the package. ``ENTPROBE_CACHE`` points at a session-wide temporary
folder unless the caller already set it (CI sets it to reuse the built default checkpoint).
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from entprobe.config import register_configs

CONF_DIR = Path(str(resources.files("entprobe") / "conf"))

# Small and quiet: what every test run shares unless it overrides a key itself (later overrides win).
# On the CPU on every machine: the suite checks estimators to 1e-5 and more, which fp32 CPU
# arithmetic meets and bf16 autocast on a GPU does not (tests/test_cuda.py covers CUDA).
SHRINK = ("batch.B_E=4", "batch.B_U=4", "batch.G=4", "logging.wandb.mode=disabled",
          "logging.progress=false", "logging.verdict=false", "logging.report=false", "model.device=cpu")


# Committed draws (tests/data): a copy of the default checkpoint (``python -m entprobe.train
# --build-default --out tests/data/default_model``) and batches it sampled (``batch.save``). A test
# that asserts on *which* responses were drawn loads these: the sampler's draws may differ on another
# machine (another CPU's kernels round differently, and one flipped token changes a response), the
# committed ones do not. Regenerate a batch folder with the run that wrote it (see its test).
DATA = Path(__file__).parent / "data"
DEFAULT_MODEL = ("model=hf", f"model.path='{DATA / 'default_model'}'")


def committed_batches(name: str) -> tuple[str, ...]:
    """Overrides that run on the committed model and its saved batches ``tests/data/batches/<name>``."""
    return (*DEFAULT_MODEL, f"batch.load='{DATA / 'batches' / name}'")


def compose_cfg(tmp_path: str | Path, *overrides: str, return_hydra_config: bool = False) -> DictConfig:
    """The root config composed from the package's conf/ with SHRINK, run_dir=tmp_path, then ``overrides``
    (``return_hydra_config``: keep the ``hydra`` node, e.g. to read ``hydra.launcher``)."""
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            return compose(config_name="config", return_hydra_config=return_hydra_config,
                           overrides=[*SHRINK, f"run_dir='{Path(tmp_path)}'", *overrides])
    finally:
        GlobalHydra.instance().clear()


@pytest.fixture(scope="session", autouse=True)
def entprobe_cache(tmp_path_factory) -> Path:
    """The default-checkpoint cache: $ENTPROBE_CACHE if set, else one temporary folder per session."""
    if not os.environ.get("ENTPROBE_CACHE"):
        os.environ["ENTPROBE_CACHE"] = str(tmp_path_factory.mktemp("entprobe_cache"))
    return Path(os.environ["ENTPROBE_CACHE"])


@pytest.fixture
def cfg(tmp_path) -> DictConfig:
    """The shrunk default config writing into this test's tmp_path."""
    return compose_cfg(tmp_path)


U32 = 2.0 ** -24  # fp32 unit roundoff


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def fp32_dot_tol(res: dict) -> float:
    """Relative error bound of ``deltaH1 = -lr Xbar . P Ybar`` between two fp32 computations that
    sum the same units in other orders (sharded: units taken in turn over the ranks, each rank's
    dot summed with the other's). Xbar (B_E units) and P Ybar (B_U units) each carry a relative
    error of at most (B - 1) u per coordinate (recursive summation, the units' coordinates taken as
    not cancelling), the dot about u more per term, so ``|err| <= (B_E + B_U) u sum_i |x_i y_i|``,
    and ``sum_i |x_i y_i| <= |x| |y| = |x . y| / |cos(x, y)|`` (Cauchy-Schwarz): relative
    ``(B_E + B_U) u / |cos|``, with cos that of the run itself (on the committed batches
    cos = 0.0069: 7e-5; a lost or doubled unit moves deltaH1 by O(1))."""
    return (res["B_E"] + res["B_U"]) * U32 / abs(res["cos_Xbar_PYbar"])


@pytest.fixture
def step_lrs():
    """``(optimizer, the lr of each param group)`` at every ``optimizer.step()`` (a global pre-hook)."""
    seen: list[tuple[torch.optim.Optimizer, list[float]]] = []
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: seen.append((opt, [g["lr"] for g in opt.param_groups])))
    yield seen
    handle.remove()
