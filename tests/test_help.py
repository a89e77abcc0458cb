"""``python -m entprobe.main --help``: the config groups with their options, and every key of the
chosen options with its default and its documentation (the YAML comment beside it)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import yaml
from omegaconf import OmegaConf

from conftest import CONF_DIR, SHRINK, compose_cfg


def _help(*overrides: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "entprobe.main", *overrides, "--help"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _leaves(node, prefix=""):
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _leaves(v, key + ".")
        else:
            yield key


def test_help_lists_groups_and_documents_every_key(tmp_path):
    out = _help()
    groups = out[out.index("== Config groups"):out.index("== Keys")]
    for group in sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__")):
        options = ", ".join(sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml")))
        assert f"{group}: {options}" in groups, group
    documented = {m[1]: (m[2], m[3]) for m in re.finditer(r"^  (\S+?)=(\S+)\s+(.*)$", out[out.index("== Keys"):], re.M)}
    cfg = OmegaConf.to_container(compose_cfg(tmp_path), enum_to_str=True)
    keys = set(_leaves(cfg))
    assert keys == set(documented), (keys ^ set(documented))
    shrunk = {o.split("=")[0] for o in SHRINK} | {"run_dir"}
    for key in keys:
        assert documented[key][1].strip(), f"{key} has no comment in its YAML"
        if key not in shrunk:  # the default shown is the composed one
            value = cfg
            for part in key.split("."):
                value = value[part]
            assert yaml.safe_load(documented[key][0]) == value, key
    assert "$ENTPROBE_CACHE" in out  # a literal $ in a comment survives Hydra's template


def test_help_documents_the_chosen_option():
    out = _help("model=hf")
    assert re.search(r"^  model\.path=\?\?\?\s+required: the checkpoint folder", out, re.M)
