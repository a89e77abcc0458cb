"""``python -m entprobe.probe_run RUN_DIR [overrides]`` / ``entprobe-run``: probe every checkpoint of a
training run (cli/probe_run.py)."""
import sys

from entprobe.cli.probe_run import main

if __name__ == "__main__":
    sys.exit(main())
