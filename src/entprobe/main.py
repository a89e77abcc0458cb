"""``python -m entprobe.main`` / the ``entprobe`` console script: Hydra's entry point, beside the
package's conf/ (the config folder Hydra records as the source); the job itself is
``cli.probe_job.hydra_job``, and ``run`` the job without Hydra."""
import sys

import hydra
from omegaconf import DictConfig

from entprobe.cli.probe_job import hydra_job, load_from_disk, load_probe, renamed_overrides, run  # noqa: F401
from entprobe.cli.command_line import check_command_line
from entprobe.cli.user_errors import exits_on_user_error, hydra_exit_status, hydra_one_line, multirun_failures_one_line
from entprobe.pipeline.config_checks import to_typed  # noqa: F401


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def hydra_main(cfg: DictConfig) -> float | None:
    """One probe job under Hydra (``cli.probe_job.hydra_job``); returns deltaH1 for sweepers. An
    error meant for the user is printed as one line (``cli/user_errors.py``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    with hydra_one_line(HydraConfig.get().mode == RunMode.MULTIRUN):
        return hydra_job(cfg)


def main() -> float | None:
    """The command line (``entprobe`` / ``python -m entprobe.main``): Hydra's, with former group
    names accepted; exits 2 after an error meant for the user (``entprobe: error: ...``). The
    config of every job is checked before Hydra starts (``cli.command_line``): a mistake in it
    leaves no run folder."""
    sys.argv[1:] = renamed_overrides(sys.argv[1:])
    with exits_on_user_error():
        check_command_line(sys.argv[1:])
    try:
        with multirun_failures_one_line():
            return hydra_main()
    except SystemExit as exc:
        raise SystemExit(hydra_exit_status(exc.code)) from None


if __name__ == "__main__":
    main()
