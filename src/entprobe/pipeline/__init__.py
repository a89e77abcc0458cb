"""The probe's orchestration, top to bottom: the config's range checks (pipeline/config_checks.py),
the optimizer's geometry (pipeline/geometry.py), the run's E and U (run_batches.py), the two modes over
the shared stages (pipeline/modes/, pipeline/stages/), Stages 1-2 shared across an lr sweep (lr_share.py), the probe
of what is in memory (in_memory.py) and the Python API ``entprobe.probe`` (pipeline/api.py). Imports every
package below it; nothing above (integrations, cli)."""
