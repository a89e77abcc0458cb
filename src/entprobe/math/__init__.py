"""Pure functions on tensors, each docstring stating its formula: the probe's estimators
(math/estimators.py), importance sampling paired with the prediction (importance.py), the single-batch
U-statistic (ustat.py), AdamW's update and Jacobian in closed form (adamw.py), batch-size planning
(planning.py), parameter-sized buffers and dots (math/paramvec.py). No config, no I/O; imports runtime
(sharding's local views) and nothing above it."""
