#!/usr/bin/env bash
# Create .venv (if missing) and install entprobe with its test extras.
# torch is installed only when the venv has none: ENTPROBE_TORCH (default 2.13.0, the CPU build on
# this project's machines). On a GPU machine, install your CUDA build of torch into .venv first.
# ENTPROBE_CONSTRAINTS (CI: constraints/ci.txt) pins every package to exact versions; unset, pip
# resolves pyproject.toml's ranges.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIN=()
if [ -n "${ENTPROBE_CONSTRAINTS:-}" ]; then PIN=(-c "$ENTPROBE_CONSTRAINTS"); fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q ${PIN[@]+"${PIN[@]}"} "torch==${ENTPROBE_TORCH:-2.13.0}"
fi
.venv/bin/python -m pip install -q ${PIN[@]+"${PIN[@]}"} -e ".[dev]"
.venv/bin/python -c "import entprobe, torch; print('entprobe ready, torch', torch.__version__)"
