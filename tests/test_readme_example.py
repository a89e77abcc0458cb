"""The README's example verdict is the run of the README's example command on the committed model
and batches (tests/data/default_model, tests/data/batches/readme): the same draws on every machine,
so the same numbers up to rounding. This test runs the command it finds in the README and checks
each number of the README's block against the run's results.json.

After a change of an estimator (or of the committed model or batches) regenerate the block with
one command, from the repository root:

    PYTHONPATH=src .venv/bin/python tests/test_readme_example.py

which runs the same command and rewrites the block's four lines in README.md (what was probed,
then the three rows). (The batches
themselves: ``python -m entprobe.main model=hf model.path=tests/data/default_model
batch.save=tests/data/batches/readme``.)
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_BLOCK_START = "prints (± is 1 SE, [ ] a 95% t interval; nats):\n\n```\n"
COMMAND = re.compile(r"`(python -m entprobe\.main [^`]*batch\.load=tests/data/batches/readme[^`]*)`")
LINE = re.compile(r"^(predicted|measured|difference)\s+(\S+) ± (\S+)\s+\[(\S+), (\S+)\]\s+(.*)$")
KEYS = {"predicted": ("deltaH_pred", "pred"), "measured": ("deltaH_true", "true"),
        "difference": ("deltaH_true_minus_pred", "true_minus_pred")}
# Another machine computes the same draws with other kernels: fp32 reductions in another order,
# a relative 1e-5 at most on these numbers (tests/test_fsdp.py bounds the like); a printed digit
# may then round the other way at a boundary, which this allowance accepts.
MACHINE_REL = 1e-5


def _command() -> list[str]:
    found = COMMAND.findall(README.read_text())
    assert len(found) == 1, f"README.md names the example command once, found {found}"
    return shlex.split(found[0])


def _block_lines(text: str) -> list[str]:
    """The block's lines: what was probed (the verdict's first line), then the three rows."""
    block = text.split(README_BLOCK_START, 1)[1].split("```", 1)[0].strip("\n").splitlines()
    lines = [x for x in block if LINE.match(x)]
    assert [LINE.match(x)[1] for x in lines] == ["predicted", "measured", "difference"], lines
    assert len(block) == 4 and block[1:] == lines, block
    return block


def run_example(run_dir: Path) -> tuple[dict, str]:
    """Run the README's example command (cwd: the repository root) into ``run_dir``."""
    cmd = _command()
    env = {**os.environ, "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, *cmd[1:], f"hydra.run.dir='{run_dir}'", "logging.wandb.mode=disabled"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "results.json").read_text()), proc.stdout


def _matches(text: str, value: float) -> bool:
    """``text`` is ``value`` printed to the digits it shows (within MACHINE_REL of the value)."""
    x = float(text)
    digits = re.sub(r"[^0-9]", "", text.split("e")[0]).lstrip("0") or "0"
    last = math.floor(math.log10(abs(x))) - len(digits) + 1 if x != 0 else -len(digits)
    return abs(x - value) <= 0.5 * 10.0 ** last * (1 + 1e-9) + MACHINE_REL * abs(value)


def readme_lines(res: dict) -> list[str]:
    """The block's four lines from a run's results (what ``main`` writes into the README): the
    verdict's first line and its rows, their notes as the verdict prints them (the predicted row's
    cut after its first two parts)."""
    from entprobe.reporting.verdict import setup_line, verdict_lines

    notes = {row[0]: row[3] for row in verdict_lines(res)}
    def cols(label: str) -> str:
        key, ci = KEYS[label]
        # columns at 30 and 50 characters, with at least one space before each (a long number)
        return (f"{label:<11} {res[key]:+.4g} ± {res['SE_' + key]:.2g}".ljust(29) + " "
                + f"[{res[f'ci95_{ci}_low']:.3g}, {res[f'ci95_{ci}_high']:.3g}]").ljust(49) + " "
    predicted = notes["predicted"].split(", weight decay", 1)[0] + ", ..."
    return [setup_line(res), cols("predicted") + predicted, cols("measured") + notes["measured"],
            cols("difference") + notes["difference"]]


def test_readme_example_verdict_is_the_committed_batches_run(tmp_path):
    res, out = run_example(tmp_path / "run")
    assert res["batch_source"] == "load" and (res["B_E"], res["B_U"], res["G"]) == (8, 8, 4)
    block = _block_lines(README.read_text())
    want = readme_lines(res)
    # the verdict's first line, what was probed: as the run printed it, before the rows
    assert block[0] == want[0] and want[0] in out.splitlines() and out.index(want[0]) < out.index("predicted")
    for line, new in zip(block[1:], want[1:]):
        label, val, se, lo, hi, note = LINE.match(line).groups()
        key, ci = KEYS[label]
        for text, k in ((val, key), (se, "SE_" + key), (lo, f"ci95_{ci}_low"), (hi, f"ci95_{ci}_high")):
            assert _matches(text, res[k]), (label, k, text, res[k])
        assert label in out  # the run printed its verdict
        if label == "predicted":
            g, m = re.search(r"gradient (\S+), momentum (\S+),", note).groups()
            assert _matches(g, res["deltaH_pred_gradient"]) and _matches(m, res["deltaH_pred_momentum"])
            assert note.split(": gradient")[0] == LINE.match(new)[6].split(": gradient")[0]
        if label == "measured":
            mode, ess = re.search(r"\((\w+), ESS/N (\S+)\)", note).groups()
            assert mode == res["is_mode"] and _matches(ess, res["ESS_frac"])
        if label == "difference":  # the verdict's words, the paired t test with its degrees of freedom
            assert ("NOT consistent" in note) == (not res["pred_consistent"])
            t, crit, df = re.search(r"\|t\| (\S+) [<>] (\S+) \((\d+) df\)", note).groups()
            assert _matches(t, abs(res["z_true_minus_pred"])) and int(df) == res["df_true_minus_pred"] == 7
            assert crit == "2.36"  # t_7's 97.5% quantile, 2.3646
            shown = re.compile(r"\|t\| \S+")  # |t| to the digits printed: _matches above
            assert shown.sub("|t|", note) == shown.sub("|t|", LINE.match(new)[6])


def main() -> None:
    """Rewrite the README's block from a fresh run of its example command."""
    with tempfile.TemporaryDirectory() as tmp:
        res, _ = run_example(Path(tmp) / "run")
    text = README.read_text()
    old = _block_lines(text)
    new = readme_lines(res)
    for a, b in zip(old, new):
        text = text.replace(a, b, 1)
    README.write_text(text)
    print("\n".join(new))


if __name__ == "__main__":
    main()
