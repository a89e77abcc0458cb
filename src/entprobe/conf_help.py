"""``python -m entprobe.main --help``: every key of the chosen group options with its default and the
comment the YAML gives it (conf/<group>/<option>.yaml is the one place a key is documented).

conf/config.yaml's ``hydra.help.template`` calls the ``entprobe_keys`` resolver (registered by
``config.register_configs``) with ``hydra.runtime.choices``, so ``model=hf --help`` documents the
hf option's keys.
"""
from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

CONF_DIR = Path(str(resources.files("entprobe") / "conf"))
_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w]*):(?P<value>[^#]*?)\s*(?:#\s?(?P<doc>.*))?$")


def documented_keys(yaml_text: str, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, default, comment)`` for every leaf key of a group's YAML (nested mappings
    give dotted keys; the ``defaults`` list and ``@package`` lines are skipped)."""
    out: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    for line in yaml_text.splitlines():
        m = _LINE.match(line)
        if not m or line.lstrip().startswith("#"):
            continue
        indent, key, value = len(m["indent"]), m["key"], m["value"].strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if key == "defaults" and not stack:
            stack.append((indent, key))
            continue
        if stack and stack[0][1] == "defaults":
            continue
        dotted = ".".join([prefix] * bool(prefix) + [k for _, k in stack] + [key])
        if value:
            out.append((dotted, value, (m["doc"] or "").strip()))
        else:
            stack.append((indent, key))
    return out


def all_keys(choices) -> list[tuple[str, str, str]]:
    """The documented keys of the root config and of each chosen group option (``choices``: group
    -> option, as in ``hydra.runtime.choices``; hydra's own groups are left out)."""
    root = (CONF_DIR / "config.yaml").read_text()
    keys = [k for k in documented_keys(root) if not k[0].startswith("hydra.")]
    order = re.findall(r"^\s*-\s*(?:optional\s+)?(\w+):", root, re.M)  # the defaults list's order
    choices = dict(choices or {})
    for group in sorted(choices, key=lambda g: order.index(g) if g in order else len(order)):
        option = choices[group]
        if option is None or group.startswith("hydra") or "/" in group:
            continue
        path = CONF_DIR / group / f"{option}.yaml"
        if not path.is_file():  # a schema node (entprobe_schema) or an absent optional file
            continue
        text = path.read_text()
        package_global = text.lstrip().startswith("# @package _global_")
        keys += documented_keys(text, "" if package_global else group)
    return keys


def help_text(choices) -> str:
    """One line per key: ``  key=default   comment`` (``$`` doubled: Hydra's template substitutes)."""
    keys = all_keys(choices)
    width = min(max((len(k) + len(v) + 1 for k, v, _ in keys), default=0), 48)
    lines = []
    for k, v, doc in keys:
        lines.append(f"  {f'{k}={v}':<{width}}  {doc}".rstrip())
    return "\n".join(lines).replace("$", "$$")
