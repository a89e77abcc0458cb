"""README.md is a page a newcomer reads in ten minutes: at most 200 lines, and each of its Python
snippets (the TRL callback, the plain loop with forecast and guard) runs verbatim, as a user runs
it: in its own process, from a folder that holds the committed ``tests/data/default_model`` it
names. (Its shell commands: tests/test_docs_commands.py; its example verdict:
tests/test_readme_example.py.)"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 200


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines, the limit is {MAX_LINES}: move detail to docs/"


def snippet(marker: str) -> str:
    """The README's one ```python block that contains ``marker``."""
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M) if marker in b]
    assert len(blocks) == 1, (marker, len(blocks))
    return blocks[0]


def run_verbatim(code: str, tmp_path: Path) -> list[list[str]]:
    """Run ``code`` as a script in ``tmp_path`` (with ``tests/data`` linked there, the folder the
    snippets name from the repository root); the whitespace-split lines it printed that start with
    a step number (the snippets' own prints; the trainer logs its metrics to stdout too)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "data").symlink_to(ROOT / "tests" / "data")
    (tmp_path / "snippet.py").write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line.split() for line in proc.stdout.splitlines() if re.match(r"\d+ ", line)]


def test_trl_snippet_runs_verbatim(tmp_path):
    """Use 2: a GRPOTrainer run of 20 steps with EntropyProbeCallback every 10: two probes, each
    printed with its step, a prediction with a positive SE, a measurement and the paired verdict."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    rows = run_verbatim(snippet("EntropyProbeCallback"), tmp_path)
    assert [r[0] for r in rows] == ["10", "20"], rows
    for step, pred, se, true, consistent in rows:
        assert math.isfinite(float(pred)) and float(se) > 0 and math.isfinite(float(true))
        assert consistent in ("True", "False")
    assert (tmp_path / "outputs" / "trl_probed" / "entprobe_over_steps.csv").is_file()


def test_loop_snippet_runs_verbatim(tmp_path):
    """Use 3: 8 steps of a plain loop, the rollouts probe every 2 steps (steps 2, 4, 6, 8), each
    with its forecast of H 5 steps ahead and the guard's lr factor in its range."""
    rows = run_verbatim(snippet("EntropyGuard"), tmp_path)
    assert [r[0] for r in rows] == ["2", "4", "6", "8"], rows
    for step, pred, se, forecast, factor in rows:
        assert math.isfinite(float(pred)) and float(se) > 0
        assert float(forecast) >= 0  # an entropy, in nats
        assert 0.05 <= float(factor) <= 1.0  # EntropyGuard's default [min_factor, max_factor]


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_from_readme_and_the_pages_it_moved_to_resolve():
    """Every relative link of README.md and of the docs pages that took its sections points to a
    file of the repository, and its #anchor to a heading of that file (a section moved between
    pages breaks no link)."""
    pages = [README, *(ROOT / "docs" / f"{n}.md" for n in ("results", "outputs", "probing", "trl", "online",
                                                            "training"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.is_file() and ROOT in file.parents, (page.name, target)
            if anchor:
                headings = re.findall(r"^#+ (.*)$", file.read_text(), re.M)
                assert anchor in {_slug(h) for h in headings}, (page.name, target)
