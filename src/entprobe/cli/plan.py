"""``python -m entprobe.plan RUN_DIR target_se=...``: the batch-size planner's command line
(the planning itself: reporting/planning.py, math/planning.py)."""
from __future__ import annotations

import sys
from pathlib import Path

from entprobe.cli.user_errors import USER_ERRORS, ArgumentParser, full_error, one_line
from entprobe.reporting.planning import plan_directory


def parse_args(argv: list[str]) -> tuple[Path, float]:
    ap = ArgumentParser(prog="python -m entprobe.plan", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a run directory (results.json, per_unit.json) or a sweep directory")
    ap.add_argument("overrides", nargs="*", help="target_se=VALUE: the standard error wanted (nats)")
    ap.add_argument("--target-se", type=float, default=None, help="the standard error wanted (nats)")
    args = ap.parse_args(argv)
    target = args.target_se
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or key != "target_se":
            ap.error(f"unknown argument {item!r}: the planner takes target_se=VALUE (or --target-se VALUE)")
        try:
            target = float(value)
        except ValueError:
            ap.error(f"target_se={value!r} is not a number")
    if target is None:
        ap.error("give the standard error wanted: target_se=VALUE (or --target-se VALUE)")
    return args.run_dir, target


def main(argv: list[str] | None = None) -> int:
    run_dir, target = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        lines = plan_directory(run_dir, target)
    except USER_ERRORS as exc:  # one line, exit 2 (cli/user_errors.py)
        if full_error():
            raise
        print(one_line(exc), file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
