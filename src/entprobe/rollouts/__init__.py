"""Sampled responses and what is computed on them: E/U sampling with per-response random
streams (sampling.py, ``RolloutBatch``), teacher-forced log-probs (rollouts/logprobs.py), the trainers'
objectives (rollouts/objectives.py: advantages and each response's weight in the update), saved batches
and their fingerprint (saved_batches.py). Imports config, runtime, math and tasks."""
