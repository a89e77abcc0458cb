"""What trainers write, read safely: models (HF folder, GGUF, PEFT adapters: checkpoints/models.py,
peft.py), optimizer states (checkpoints/optim_state.py, and the sharded formats of DCP, verl and DeepSpeed in
checkpoints/trainer_states/), HF Trainer checkpoints (checkpoints/trainer_checkpoint.py), the built-in tiny model and its
default checkpoint's recipe (checkpoints/builtin.py, default_checkpoint.py), and every input checked before
the model loads (checkpoints/preflight.py). Imports the packages below it: config, runtime, math, tasks, rollouts."""
