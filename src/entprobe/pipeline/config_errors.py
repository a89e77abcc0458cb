"""What a command line's mistake means, in one line: the errors Hydra and OmegaConf raise while an
override is parsed, composed or merged onto the typed schema, turned into a ``ConfigError`` that
names the override and what to write instead.

- an unknown key: the schema's nearest keys (``difflib`` over every dotted key of
  ``EntprobeConfig``, and of Hydra's own config for ``hydra.*``): ``did you mean batch.B_E?``;
- an unknown option of a config group: the group's options;
- a value of the wrong type: the key and the type the schema gives it (an enum's values);
- ``+key=value`` for a key the typed schema does not have (the schema merge in ``to_typed``);
- a sweep without ``-m``, a key that cannot be deleted or appended, an override Hydra cannot parse.

``composition_error`` reads Hydra's exception (``compose_config``, the command line's check before
Hydra starts), ``schema_error`` OmegaConf's (``config_checks.to_typed``). Anything else keeps
Hydra's own words, on one line.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import re
import types
import typing
from typing import Any

from omegaconf.errors import (ConfigAttributeError, ConfigKeyError, ConfigTypeError, OmegaConfBaseException,
                              ValidationError)

from entprobe.config import ConfigError, EntprobeConfig

HELP = "python -m entprobe.main --help lists every key"
_NONE = type(None)


def _hints(cls) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 -- a forward reference that does not resolve: the raw annotations
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _walk(cls, prefix: str) -> dict[str, Any]:
    """``{dotted key: annotation}`` of every leaf of dataclass ``cls`` (nested dataclasses descended)."""
    out = {}
    for name, hint in _hints(cls).items():
        key = f"{prefix}.{name}" if prefix else name
        inner = _unwrap(hint)
        if dataclasses.is_dataclass(inner):
            out.update(_walk(inner, key))
        else:
            out[key] = hint
    return out


def _unwrap(hint):
    """``X`` of ``Optional[X]`` / ``X | None``; ``hint`` otherwise."""
    args = [a for a in typing.get_args(hint) if a is not _NONE]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint


@functools.lru_cache(maxsize=None)
def schema_keys(hydra: bool = False) -> dict[str, Any]:
    """Every dotted key of entprobe's typed config (``hydra=True``: of Hydra's own, ``hydra.*``) and
    its annotation."""
    if hydra:
        from hydra.conf import HydraConf

        return _walk(HydraConf, "hydra")
    return _walk(EntprobeConfig, "")


def _nodes(keys) -> set[str]:
    """Every prefix of the dotted keys: the config's nodes (``batch``, ``probe.what_if``)."""
    return {k.rsplit(".", n)[0] for k in keys for n in range(1, k.count(".") + 1)}


def did_you_mean(key: str) -> str | None:
    """The schema key (or node) nearest ``key``, case ignored: a key of the same node with a like name
    (``batch.BE`` -> ``batch.B_E``), else a key of any node with that name (``batch.temperature`` ->
    ``sampling.temperature``, ``lr`` -> ``optimizer.lr``), else, for a node that does not exist, the
    nearest dotted name (``probe.whatif.lr_factors``)."""
    keys = schema_keys(key.startswith("hydra."))
    pool = sorted(set(keys) | _nodes(keys))
    node, _, leaf = key.rpartition(".")
    passes = [([k for k in pool if k.rpartition(".")[0] == node], True, 0.6), (pool, True, 0.8)]
    if node and node not in pool:  # the node's name is wrong (probe.whatif.lr_factors): the whole dotted name
        passes.append((pool, False, 0.6))
    for scope, by_leaf, cutoff in passes:
        by_name: dict[str, str] = {}
        for k in scope:
            by_name.setdefault((k.rpartition(".")[2] if by_leaf else k).lower(), k)
        near = difflib.get_close_matches((leaf if by_leaf else key).lower(), list(by_name), n=1, cutoff=cutoff)
        if near and by_name[near[0]] != key and not key.startswith(by_name[near[0]] + "."):  # not its own node
            return by_name[near[0]]
    return None


def describe(hint) -> str:
    """What an annotation asks for, in words: ``a number``, ``one of two_batch, single_batch``, ..."""
    if hint is None:
        return "a value of another type"
    args = typing.get_args(hint)
    if _NONE in args:
        return f"{describe(_unwrap(hint))} (or null)"
    origin = typing.get_origin(hint)
    if origin in (list, tuple, typing.List, typing.Tuple):
        return f"a list of {_plural(args[0]) if args else 'values'}, e.g. [{_example(args[0] if args else str)}]"
    if origin in (dict, typing.Dict):
        return "a mapping {key: value}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(m.value if isinstance(m.value, str) else m.name for m in hint)
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, "a value of its type")


def _plural(hint) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "true/false values"}.get(hint, "values")


def _example(hint) -> str:
    return {int: "1,2", float: "0.5,2", str: "a,b", bool: "true,false"}.get(hint, "...")


def _key_of(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0].strip()


def _override_for(key: str, overrides: list[str] | None) -> str:
    """The override that set ``key`` (as typed), else ``key`` itself."""
    for o in overrides or []:
        if _key_of(o) == key:
            return o
    return key


def _unknown_key(key: str, shown: str, appended: bool) -> ConfigError:
    node, _, leaf = key.rpartition(".")
    near = did_you_mean(key)
    where = f"{node} has no key {leaf}" if node else f"the config has no key or group {leaf}"
    hint = f" (did you mean {near}?)" if near else ""
    plus = ", and '+' cannot add one to entprobe's typed config" if appended and not key.startswith("hydra.") else ""
    more = "python -m entprobe.main --hydra-help shows Hydra's" if key.startswith("hydra.") else HELP
    return ConfigError(f"{shown}: {where}{hint}{plus}; {more}")


def _is_mapping(key: str) -> bool:
    """Whether the schema gives ``key`` a free mapping (keys of the user's choosing)."""
    hint = _unwrap(schema_keys(key.startswith("hydra.")).get(key))
    return typing.get_origin(hint) in (dict, typing.Dict) or hint is dict


def _index_free(key: str) -> str:
    return re.sub(r"\[\d+\]$", "", key)


def schema_error(exc: OmegaConfBaseException, overrides: list[str] | None = None) -> ConfigError:
    """A ``ConfigError`` for OmegaConf's error about ``exc.full_key`` (merging onto the schema or
    composing): an unknown key with the nearest ones, a wrong type with the type wanted."""
    key = _index_free(str(getattr(exc, "full_key", "") or getattr(exc, "key", "") or ""))
    shown = _override_for(key, overrides)
    first = (str(getattr(exc, "msg", "") or str(exc)).strip().splitlines() or [""])[0]
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)) and key:
        ref = str(getattr(exc, "ref_type_str", "") or "")
        node, _, leaf = key.rpartition(".")
        if ref.startswith(("Dict", "dict")) or _is_mapping(node):  # task.chat_template_kwargs: '+' adds a key there
            return ConfigError(f"{shown}: {node} has no key {leaf} yet; add it with +{key}=<value>")
        return _unknown_key(key, shown, shown.startswith("+"))
    if isinstance(exc, ConfigTypeError) and "does not support deletion" in first:
        return ConfigError(f"{shown}: a key of entprobe's typed config cannot be deleted; set its value instead "
                           f"({key}=<value>)")
    if isinstance(exc, ValidationError) and key:
        hint = schema_keys(key.startswith("hydra.")).get(key)
        value = getattr(exc, "value", None)
        got = "null" if "is not Optional" in first else (repr(value) if value is not None else "")
        m = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", first)
        if m:
            choices = [c.strip() for c in m.group(2).split(",")]
            near = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            return ConfigError(f"{shown}: {key} takes one of {', '.join(choices)}, not {m.group(1)!r}"
                               + (f"; did you mean {near[0]}?" if near else ""))
        return ConfigError(f"{shown}: {key} takes {describe(hint)}" + (f", not {got}" if got else f" ({first})"))
    return ConfigError(f"{shown}: {first}" if key else first or type(exc).__name__)


def _parse_error(overrides: list[str], exc: Exception) -> ConfigError:
    """The override Hydra cannot parse (each is parsed on its own to find it) and what to write."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    bad, why = " ".join(overrides), (str(exc).strip().splitlines() or [""])[0]
    for o in overrides:
        try:
            parser.parse_override(o)
        except HydraException as e:
            bad, why = o, (str(e).strip().splitlines() or [""])[0]
            break
    return ConfigError(f"{bad}: not an override Hydra reads ({why}); write key=value, a list as key=[a,b], "
                       "and quote a value that holds spaces, brackets or commas: key='a, b'")


def composition_error(exc: Exception, overrides: list[str]) -> ConfigError:
    """A ``ConfigError`` for the exception Hydra raised composing ``overrides`` (module docstring)."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    text = str(exc).strip()
    first = (text.splitlines() or [""])[0]
    if isinstance(exc, OverrideParseException) or (type(exc) is HydraException and "at input" in first):
        return _parse_error(overrides, exc)
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and exc.options is not None:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        near = difflib.get_close_matches(option, list(exc.options), n=1, cutoff=0.5)
        shown = _override_for(group, overrides) if group else exc.missing_cfg_file
        return ConfigError(f"{shown}: {group} has no option {option!r}; choose one of {', '.join(exc.options)}"
                           + (f" (did you mean {group}={near[0]}?)" if near else ""))
    if isinstance(exc.__cause__, OmegaConfBaseException):
        return schema_error(exc.__cause__, overrides)
    m = re.match(r"Ambiguous value for argument '(.*)'", first)
    if m:
        o = m.group(1)
        k, _, v = o.partition("=")
        return ConfigError(f"{o}: a value with commas is a sweep: add -m to run one job per value "
                           f"(python -m entprobe.main -m {o}), or write a list as {k}=[{v}]")
    m = re.match(r"Could not append to config. An item is already at '(.*)'", first)
    if m:
        key = m.group(1)
        return ConfigError(f"{_override_for(key, overrides)}: {key} is a key already; set it without '+' "
                           f"({_override_for(key, overrides).lstrip('+')})")
    m = re.match(r"Multiple values for (\S+)\. To override a value use 'override \S+: (.*)'", first)
    if m:
        return ConfigError(f"+{m.group(1)}={m.group(2)}: {m.group(1)} has an option already; choose with "
                           f"{m.group(1)}={m.group(2)} (no '+')")
    text = text.split("\nConfig search path")[0]
    return ConfigError(f"{' '.join(overrides)}: " + " ".join(line.strip() for line in text.splitlines() if line.strip()))
