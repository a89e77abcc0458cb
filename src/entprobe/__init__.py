"""entprobe: predict, with error bars, the entropy change of the next RL optimizer step, then take
it and measure it. ``entprobe.probe(model, optimizer, tokenizer, task_or_batches, **overrides)``
probes what is in memory (pipeline/api.py); ``python -m entprobe.main`` a checkpoint on disk (cli/probe_job.py)."""

__all__ = ["probe"]


def __getattr__(name: str):
    """``entprobe.probe`` is ``entprobe.pipeline.api.probe``, imported on first use (``import entprobe`` stays light)."""
    if name == "probe":
        from entprobe.pipeline.api import probe

        return probe
    raise AttributeError(f"module 'entprobe' has no attribute {name!r}")
