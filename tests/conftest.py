"""Shared test helpers: compose the real Hydra config shipped inside the package, shrunk for tests.

    cfg = compose_cfg(tmp_path, "importance.is_mode=clip")   # a DictConfig, exactly as the CLI sees it
    results = run(cfg)

The config directory is the *installed* package's ``entprobe/conf`` (what a wheel ships), so tests
fail when a YAML is missing from the package. ``ENTPROBE_CACHE`` points at a session-wide temporary
folder unless the caller already set it (CI sets it to reuse the built default checkpoint).
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from entprobe.config import register_configs

# Under pytest-xdist (pyproject's ``-n 2``: one worker per core) each worker computes on one thread, and
# so do the commands it launches: two workers of two threads each on two cores would only contend.
# The second pass of .ci/run (``-m numerics``, one process) keeps torch's several threads, on the
# portable kernels: between the two passes the bounds meet both reduction orders and both code paths.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

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
    if not os.environ.get("ENTPROBE_CACHE"):  # xdist's workers share one (the build is locked: one builds it)
        root = tmp_path_factory.getbasetemp()
        root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
        (root / "entprobe_cache").mkdir(exist_ok=True)
        os.environ["ENTPROBE_CACHE"] = str(root / "entprobe_cache")
    return Path(os.environ["ENTPROBE_CACHE"])


@pytest.fixture(autouse=True)
def no_leaked_log_files():
    """A job run in-process (the CLI's ``main()``) leaves Hydra's ``main.log`` handler on the root
    logger; once the test's folder is gone, the next test in this process that logs fails on it. Close
    and drop the file handlers a test added (which tests share a process depends on xdist's split)."""
    import logging
    root = logging.getLogger()
    before = set(root.handlers)
    yield
    for h in [h for h in root.handlers if h not in before and isinstance(h, logging.FileHandler)]:
        root.removeHandler(h)
        h.close()


@pytest.fixture
def cfg(tmp_path) -> DictConfig:
    """The shrunk default config writing into this test's tmp_path."""
    return compose_cfg(tmp_path)


U32 = 2.0 ** -24  # fp32 unit roundoff (half of torch.finfo(torch.float32).eps)


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


# ---------------------------------------------------------------- floating-point tolerances
# Every tolerance below is ``k * eps(dtype) * magnitude * g(n)``: eps the dtype's machine epsilon
# (2u, u the unit roundoff: two computations each within u of a value differ by up to 2u of it),
# ``magnitude`` the sum of the absolute values of the terms that are summed (never the result,
# which cancellation can make arbitrarily smaller), n their number. A wrong formula moves a
# result by 1e-2 of itself or more; each test says what its bound is next to the bound.

def fp_tol(dtype: torch.dtype, magnitude: float, n_terms: int = 1, k: float = 1.0,
           worst_case: bool = False) -> float:
    """Bound on ``|a - b|`` for two computations, in ``dtype``, of one sum of ``n_terms`` terms
    whose absolute values sum to ``magnitude`` (or a bound on it: ``n max|x_i|``; ``|x| |y|`` for
    a dot, by Cauchy-Schwarz), in other orders or by other kernels, each term carrying its own
    rounding: ``k * eps * magnitude * g(n)``.

    ``worst_case=True``: g(n) = n, the deterministic bound (Higham, *Accuracy and Stability of
    Numerical Algorithms*, 2nd ed., eq. (4.4): any order of summation errs by at most
    ``gamma_{n-1} sum |x_i|``, ``gamma_m = m u / (1 - m u)``); use it for short sums (the units of a
    batch, a few steps of arithmetic). Default: g(n) = sqrt(n), the same bound when the rounding
    errors are independent with mean zero (Higham & Mary, SIAM J. Sci. Comput. 41 (2019) A2815:
    ``lambda sqrt(n) u sum |x_i|``, holding with probability at least ``1 - 2n exp(-lambda^2 / 2)``
    per sum); for the long sums (over a model's parameters: the worst case, n u, would be a bound
    of ~1e-2 relative on 76k fp32 terms, too loose to catch anything), where k = 1 stands for
    ``lambda = 2`` per computation. torch's kernels sum in blocks (SIMD lanes, pairwise
    reductions), which grows slower still: the probe's fp32 dots were measured within
    ``8 eps magnitude`` on the built-in model's 76k parameters, ``sqrt(76k) = 276``.
    ``k``: the number of such roundings chained (a product of two rounded factors: 2), or the
    number of sums whose errors add."""
    g = float(n_terms) if worst_case else math.sqrt(max(n_terms, 1))
    return k * torch.finfo(dtype).eps * magnitude * g


def se_tol(unit_tol) -> float:
    """Bound on ``|SE(v) - SE(w)|`` for two sets of B per-unit values with ``|v_n - w_n| <=
    unit_tol[n]``, where ``SE(v) = sd(v) / sqrt(B) = ||v - mean v|| / sqrt(B (B - 1))``: a seminorm
    of v, so ``|SE(v) - SE(w)| <= SE(v - w)`` (triangle inequality), and centring only shortens a
    vector: ``SE(v - w) <= ||unit_tol|| / sqrt(B (B - 1))``. No rounding assumption: exact."""
    t = torch.as_tensor(unit_tol, dtype=torch.float64).reshape(-1)
    B = t.numel()
    return float(t.norm()) / math.sqrt(B * (B - 1))


def welch_interval_tol(center_tol: float, sides: list[tuple[float, int, float]]) -> dict:
    """Bounds on an interval ``center -+ t(df) sqrt(sum V_k)`` (``estimators.interval`` with
    Welch-Satterthwaite df) when its center moves by ``center_tol`` and each side's SE
    ``sqrt(V_k)`` (of B_k units) by at most ``dse_k`` (``sides``: ``[(V_k, B_k, dse_k)]``):
    ``{"SE", "df", "ci"}``. V_k moves by ``dse (2 SE + dse)``; df and t(df) are smooth in the V_k,
    so their extremes over the small box the V_k stay in are at its corners (evaluated, not
    linearised); the SE of the sum moves by at most ``hypot(dse_k)`` (a norm)."""
    import itertools

    from entprobe.math import estimators as est

    V = [v for v, _, _ in sides]
    dV = [d * (2 * math.sqrt(max(v, 0.0)) + d) for v, _, d in sides]
    df = est.welch_df([(v, b) for v, b, _ in sides])
    corners = [est.welch_df([(v + s * d, b) for (v, b, _), d, s in zip(sides, dV, signs)])
               for signs in itertools.product((-1, 1), repeat=len(sides))]
    q = est.t_quantile(df)
    dq = max(abs(est.t_quantile(c) - q) for c in corners)
    dse = math.hypot(*(d for _, _, d in sides))
    se = math.sqrt(sum(max(v, 0.0) for v in V))
    return {"SE": dse, "df": max(abs(c - df) for c in corners), "ci": center_tol + q * dse + dq * (se + dse)}


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


@dataclass
class UnitMagnitudes:
    """Per-unit magnitudes of the probe's per-unit projections (``recording_units``):
    ``E[n, j] = sum_i |X_n,i d_j,i|`` over E's units and the E-side directions (``P Ybar``, then
    the update's parts: ``a`` and ``e`` of per_unit.json), ``U[n, j]`` likewise over U's units and
    the U-side directions (``P Xbar``, then ``J Xbar``: ``b`` and ``u``); ``N`` parameters."""
    E: torch.Tensor
    U: torch.Tensor
    N: int

    def tol(self, side: str, j: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-unit bound on two computations of the projections ``V_n . d_j``: each is a sum over
        the N parameters of terms ``V_n,i d_j,i`` that two paths (forward or reverse mode, other
        kernels, another order or sharding) compute with their own rounding (of the unit's gradient
        coordinate and of the direction's): ``fp_tol`` of ``sum_i |V_n,i d_j,i|`` and N terms."""
        M = self.E if side == "E" else self.U
        return torch.tensor([fp_tol(dtype, float(m), self.N) for m in M[:, j]], dtype=torch.float64)


class UnitRecord:
    """What ``recording_units`` saw: one row of magnitudes per unit, in the order of the passes."""

    def __init__(self):
        self.rows: list[torch.Tensor] = []
        self.N = 0

    def all(self) -> torch.Tensor:
        """Every recorded unit's magnitudes [units, directions], in the order of the passes."""
        return torch.stack(self.rows)

    def split(self, B_E: int) -> UnitMagnitudes:
        """E's units come first (``two_batch.compute_stage12`` projects E, then U)."""
        E, U = self.rows[:B_E], self.rows[B_E:]
        return UnitMagnitudes(torch.stack(E), torch.stack(U) if U else torch.zeros(0, 0, dtype=torch.float64), self.N)


@contextlib.contextmanager
def dot_set_spy(module, record):
    """Inside the block, ``module.pv`` is paramvec with a ``dot_set(a, dset)`` that first calls
    ``record(a, dset)`` (it sees the same tensors the stage dots) and then returns paramvec's."""
    from entprobe.math import paramvec as pv

    class Spy:
        def __getattr__(self, name):
            return getattr(pv, name)

        @staticmethod
        def dot_set(a, dset):
            record(a, dset)
            return pv.dot_set(a, dset)

    module.pv = Spy()
    try:
        yield
    finally:
        module.pv = pv


@contextlib.contextmanager
def recording_units():
    """Inside the block, a two-batch run with ``probe.projection=backward`` on one process records
    the magnitudes of its per-unit projections (``UnitRecord.split(B_E)`` after the run): each
    unit's gradient meets the directions in ``variance.project_backward``'s ``pv.dot_set``, where
    the recorder sees the same tensors and also sums ``|V_n,i| |d_j,i|`` (in fp64)."""
    from entprobe.pipeline.stages import variance

    rec = UnitRecord()

    def record(a, dset):
        rec.rows.append(torch.tensor([sum(float((x.detach().double().reshape(-1).abs()
                                                 * dset.block(i)[j].double().abs()).sum()) for i, x in enumerate(a))
                                      for j in range(dset.k)], dtype=torch.float64))
        rec.N = sum(x.numel() for x in a)

    with dot_set_spy(variance, record):
        yield rec


@pytest.fixture
def step_lrs():
    """``(optimizer, the lr of each param group)`` at every ``optimizer.step()`` (a global pre-hook)."""
    seen: list[tuple[torch.optim.Optimizer, list[float]]] = []
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: seen.append((opt, [g["lr"] for g in opt.param_groups])))
    yield seen
    handle.remove()


def rollout_loop_parts(make_optimizer=None):
    """The built-in model and task with an AdamW one step in (HF Trainer's groups, lr 1e-3, decay 0.01,
    or ``make_optimizer(model)``), and ``step_batch(seed)``: a batch of 8 prompts x 4 responses whose
    DR-GRPO gradient is left in ``.grad``, as a training loop's step has it before ``optimizer.step()``."""
    from entprobe.checkpoints.default_checkpoint import policy_loss, trainer_adamw
    from entprobe.config import SamplingConfig
    from entprobe.integrations.grpo_trainer import TrainArgs, load_policy, load_task
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch

    a = TrainArgs(out="")
    model, tok = load_policy(a)
    task = load_task(a)
    opt = make_optimizer(model) if make_optimizer is not None else trainer_adamw(model, 1e-3, 0.01)

    def step_batch(seed: int):
        batch = sample_batch(model, tok, task, draw_prompt_indices(len(task.prompts), 8, seed), 4,
                             SamplingConfig(max_new_tokens=4), seed, "dr_grpo", 1e-6)
        opt.zero_grad()
        policy_loss(model, batch, "dr_grpo").backward()
        return batch
    step_batch(0)
    opt.step()
    return model, tok, task, opt, step_batch


# the command line's quiet run (no logger, no progress bars)
QUIET_CLI = ["logging.logger=none", "logging.progress=false"]


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    """An empty working folder (where Hydra would make outputs/ and multirun/), no HYDRA_FULL_ERROR."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    return tmp_path


def run_documented_benchmark(tmp_path: Path, doc: str, cmd: str, more: str = ""):
    """A benchmark command that ``doc`` (docs/<doc>) shows, run verbatim plus ``more`` (a shorter run)
    from ``tmp_path``, whose ``benchmarks`` links the repository's (so a figure the command writes
    under docs/ lands in the scratch folder, not over the committed one); it must exit 0."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    assert cmd in (root / "docs" / doc).read_text(), f"not in docs/{doc}: {cmd}"
    if not (tmp_path / "benchmarks").exists():
        (tmp_path / "benchmarks").symlink_to(root / "benchmarks")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd.replace("python ", f"{sys.executable} ", 1) + more, shell=True, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
