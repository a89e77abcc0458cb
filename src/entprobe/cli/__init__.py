"""The commands: the probe job ``python -m entprobe.main`` (probe_job.py), the planner
``python -m entprobe.plan`` (reporting/planning.py), the trainer ``python -m entprobe.train`` (cli/train.py). The
top layer: imports anything below it; the modules entprobe.main / plan / train are shims onto it."""
