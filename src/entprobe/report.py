"""Results: atomic JSON, a console table, and a wandb logger that is a no-op when disabled."""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path


def write_json_atomic(obj, path: str | Path) -> Path:
    """Write JSON to a temp file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True, default=_jsonable)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "value"):
        return x.value
    return str(x)


def fmt(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return "nan" if math.isnan(v) else f"{v:.10g}"


HEADLINE = ["deltaH1", "SE_deltaH1", "ci95_low", "ci95_high", "deltaH_true", "deltaH1_step",
            "deltaH_cov", "ESS_frac", "psis_khat", "H_orig", "H_upd", "U_cross", "SE_plugin", "SE_jack"]


def console_table(results: dict, title: str = "entprobe results", extra_headline=()) -> None:
    """Headline numbers first, then every scalar (10 significant digits)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    table.add_column("key", style="cyan")
    table.add_column("value", justify="right")
    head = list(HEADLINE) + [k for k in extra_headline if k not in HEADLINE]
    keys = [k for k in head if k in results] + sorted(k for k in results if k not in head)
    for k in keys:
        if k.startswith("attr/layer/"):
            continue
        table.add_row(k, fmt(results[k]))
    Console(width=120).print(table)


class WandbLogger:
    """wandb run on rank 0 (offline by default, files under the run directory); no-op otherwise."""

    def __init__(self, mode: str, project: str, run_dir: Path, config: dict, enabled_rank: bool,
                 entity=None, name=None, tags=None):
        self.run = None
        if mode == "disabled" or not enabled_rank:
            return
        import wandb

        self.run = wandb.init(mode=mode, project=project, entity=entity, name=name, tags=list(tags or []),
                              dir=str(run_dir), config=config, reinit="finish_previous")

    def log(self, metrics: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float, str))})
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.run.summary[k] = v

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
