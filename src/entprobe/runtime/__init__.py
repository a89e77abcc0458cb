"""Processes and files: torch.distributed reductions (runtime/distributed.py), FSDP2 sharding (runtime/sharding.py),
atomic writes (runtime/atomic_io.py), file locks (runtime/locks.py), run folders (runtime/rundir.py), input files read safely
(runtime/input_files.py), files' sha256 remembered while unchanged (runtime/file_digest.py).
Imports nothing of entprobe but the typed config."""
