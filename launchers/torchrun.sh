#!/usr/bin/env bash
# entprobe on one node with torchrun: one process per GPU (gloo on CPU), one run directory for all.
#
#   launchers/torchrun.sh 4 model=hf model.path=/ckpt/checkpoint-500 batch.B_E=64 batch.B_U=64
#   launchers/torchrun.sh 2 -m optimizer.lr=1e-6,1e-5       # a sweep; every job uses both processes
#   NPROC=8 ENTPROBE_RUN_DIR=outputs/probe-step500 launchers/torchrun.sh batch.B_E=256 batch.B_U=256
#
# Arguments: an optional process count (default: $NPROC, else the number of visible GPUs, else 1),
# then the arguments of entprobe.main (Hydra overrides, -m). Environment:
#   ENTPROBE_RUN_DIR / ENTPROBE_SWEEP_DIR  Hydra's run / sweep directory (conf/config.yaml reads
#                        them; default outputs|multirun/<date>/<time>), fixed here once for all ranks.
#   TORCHRUN_ARGS        extra torchrun flags; when set, --standalone is not added (multi-node:
#                        TORCHRUN_ARGS="--nnodes 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint host:29400"
#                        on every node, with the same ENTPROBE_RUN_DIR).
#   PYTHON               the interpreter with entprobe installed (default: the project's .venv made by
#                        scripts/setup.sh when it exists, else the active venv's or PATH's python).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$HERE/.venv/bin/python" ]]; then PYTHON=$HERE/.venv/bin/python
  elif [[ -n "${VIRTUAL_ENV:-}" ]]; then PYTHON=$VIRTUAL_ENV/bin/python
  else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import entprobe, torch' 2>/dev/null; then
  echo "launchers/torchrun.sh: $PYTHON cannot import entprobe and torch; run ./scripts/setup.sh (it makes .venv)" \
       "or set PYTHON=/path/to/python" >&2
  exit 2
fi
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
  NPROC=$1
  shift
fi
NPROC=${NPROC:-$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
STAMP=$(date +%Y-%m-%d/%H-%M-%S)
export ENTPROBE_RUN_DIR=${ENTPROBE_RUN_DIR:-outputs/$STAMP}
export ENTPROBE_SWEEP_DIR=${ENTPROBE_SWEEP_DIR:-multirun/$STAMP}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ -n "${TORCHRUN_ARGS:-}" ]]; then
  read -r -a RDZV <<< "$TORCHRUN_ARGS"
else
  RDZV=(--standalone)
fi

exec "$PYTHON" -m torch.distributed.run "${RDZV[@]}" --nproc_per_node "$NPROC" -m entprobe.main "$@"
