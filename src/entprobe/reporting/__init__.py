"""What a person reads: the verdict and its flags (reporting/verdict.py), results tables and per-unit
files (tables.py), report.md and its plots (markdown.py, reporting/plots.py), loggers (reporting/loggers.py), the
attribution by parameter (reporting/attribution.py), TRL / verl metric names (trainer_metrics.py), sweep
summaries (reporting/sweep.py) and the batch-size planner (planning.py). Imports the packages below it:
config, runtime, math, tasks, rollouts, checkpoints."""
