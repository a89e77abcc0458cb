"""A non-editable install runs the default job from another directory: the Hydra configs ship inside
the package (pyproject package-data), not only in the source tree; the `entprobe` console script too."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def build_target(tmp: Path) -> Path:
    """``pip install --no-deps --target`` from a clean copy of the project (no egg-info, no caches)."""
    src = tmp / "project"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    target = tmp / "target"
    # The venv's setuptools builds it offline; without one, pip fetches it into an isolated build env.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    *isolation, "--target", str(target), str(src)], check=True, timeout=300)
    return target


def test_non_editable_install_runs_from_another_directory(tmp_path):
    target = build_target(tmp_path)
    def yamls(conf: Path) -> set[Path]:
        return {p.relative_to(conf) for p in conf.rglob("*.yaml")}

    shipped = yamls(target / "entprobe" / "conf")
    assert shipped == yamls(ROOT / "src" / "entprobe" / "conf") and Path("config.yaml") in shipped

    elsewhere, run_dir = tmp_path / "elsewhere", tmp_path / "run"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "entprobe.main", "batch.B_E=4", "batch.B_U=4", "batch.G=4",
         "logging.wandb.mode=disabled", "logging.progress=false", "logging.console_table=false",
         f"hydra.run.dir={run_dir}"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # Hydra records where it read the primary config from: the installed copy, not the source tree.
    sources = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"]["config_sources"]
    main_src = [s["path"] for s in sources if s["provider"] == "main"]
    assert main_src == [str(target / "entprobe" / "conf")]

    res = json.loads((run_dir / "results.json").read_text())
    for key in ("deltaH1", "SE_deltaH1", "deltaH_true"):
        assert isinstance(res[key], float) and math.isfinite(res[key]), (key, res.get(key))
    assert res["SE_deltaH1"] > 0
    assert (res["B_E"], res["B_U"], res["G"]) == (4, 4, 4)
    assert list(elsewhere.iterdir()) == []  # nothing written into the working directory

    # The console script pyproject.toml declares (`entprobe`, the same main) finds the shipped configs too.
    script = target / "bin" / "entprobe"
    assert script.is_file()
    run_dir2 = tmp_path / "run2"
    proc = subprocess.run(
        [str(script), "batch.B_E=4", "batch.B_U=4", "batch.G=4", "importance.enabled=false",
         "logging.wandb.mode=disabled", "logging.progress=false", f"hydra.run.dir={run_dir2}"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res2 = json.loads((run_dir2 / "results.json").read_text())
    assert math.isfinite(res2["deltaH_pred"]) and res2["SE_deltaH_pred"] > 0
    assert "entropy change of the next step" in proc.stdout  # the verdict, printed by default


# Declared but never imported by entprobe: what needs them at runtime (pyproject.toml says so too).
RUNTIME_ONLY = {"gguf": "transformers reads GGUF checkpoints with it (model.source=gguf)",
                "accelerate": "transformers refuses to load a GGUF checkpoint without it"}
IMPORT_NAME = {"hydra-core": "hydra", "arviz-stats": "arviz_stats"}


def test_every_declared_dependency_is_imported_or_says_why():
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[<>=!~ \[]", d, maxsplit=1)[0] for d in deps]
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "entprobe").rglob("*.py"))
    for name in names:
        module = IMPORT_NAME.get(name, name.replace("-", "_"))
        imported = re.search(rf"^\s*(?:import|from) {module}(?:\.|\s|$)", source, re.M)
        assert bool(imported) != (name in RUNTIME_ONLY), (name, "imported" if imported else "never imported")
