"""``python -m entprobe.plan``: the batch-size planner (cli/plan.py)."""
import sys

from entprobe.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
