#!/usr/bin/env bash
# The cost benchmarks at their GPU sizes in one command (benchmarks/device_check.py; --toy: CPU, toy sizes).
# Runs the project's .venv (scripts/setup.sh) when there is one, else $PYTHON, else python3.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py="python3"; fi
fi
cd "$root"
exec "$py" "$here/device_check.py" "$@"
