"""``python -m entprobe.train``: the trainer and ``--build-default`` (cli/train.py)."""
from entprobe.cli.train import build_default_main, main  # noqa: F401

if __name__ == "__main__":
    main()
