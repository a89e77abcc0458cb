"""The package layout stays a picture of the architecture (docs/architecture.md): the import graph,
read from the source's AST (imports inside functions included), has no circle, and every import
points to the importing module's own package or to a layer below it.

Layers, bottom up: config (the typed schema) < runtime < math < tasks < rollouts < checkpoints <
reporting < pipeline < integrations < cli < the entry points (``entprobe``, ``entprobe.main``,
``entprobe.plan``, ``entprobe.train``, ``entprobe.probe_run``).
"""
from __future__ import annotations

import ast
from pathlib import Path

import entprobe

ROOT = Path(entprobe.__file__).resolve().parent
LAYERS = [("config", "conf_help", "conf"), ("runtime",), ("math",), ("tasks",), ("rollouts",), ("checkpoints",),
          ("reporting",), ("pipeline",), ("integrations",), ("cli",), ("", "main", "plan", "train", "probe_run")]
MAX_LOOSE = 12


def modules() -> dict[str, Path]:
    out = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(("entprobe",) + parts)
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the entprobe modules it imports, anywhere in the file (inside functions too)."""
    mods = modules()

    def owner(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.startswith("entprobe")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("entprobe") and not node.level:
                deps |= {owner(f"{node.module}.{a.name}") for a in node.names}
        graph[name] = deps - {name}
    return graph


def layer(name: str) -> int:
    top = name.split(".")[1] if "." in name else ""
    return next(i for i, members in enumerate(LAYERS) if top in members)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_imports_point_down_the_layers():
    upward = sorted(f"{a} -> {b}" for a, deps in import_graph().items() for b in deps if layer(b) > layer(a))
    assert upward == []


def test_the_checks_can_fail():
    """The graph and the layers see what they are meant to: a circle and the layer order built by
    hand are found, and a real edge is read."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert layer("entprobe.cli.probe_job") > layer("entprobe.pipeline.api") > layer("entprobe.math.estimators")
    assert "entprobe.math.estimators" in import_graph()["entprobe.math.importance"]


def test_few_modules_loose_at_the_top_and_every_package_says_what_it_holds():
    loose = [f.name for f in ROOT.glob("*.py")]
    assert len(loose) <= MAX_LOOSE, loose
    for pkg in [d for d in ROOT.iterdir() if d.is_dir() and (d / "__init__.py").exists() and d.name != "conf"]:
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), f"{pkg.name}/__init__.py: say what lives here and what it may import"


def test_every_error_class_meant_for_users_prints_as_one_line():
    """Each entprobe error class (``class XxxError``/``XxxTimeout`` under src/) is in
    cli/user_errors.USER_ERRORS, or the commands print its message buried in a traceback."""
    import re

    from entprobe.cli.user_errors import USER_ERRORS

    listed = {c.__name__ for c in USER_ERRORS}
    found = set()
    for p in ROOT.rglob("*.py"):
        found.update(re.findall(r"^class (\w+(?:Error|Timeout))\(", p.read_text(), re.M))
    assert found - {"OneLineError"} <= listed, sorted(found - listed - {"OneLineError"})
