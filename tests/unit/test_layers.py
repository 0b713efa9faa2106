"""The package layering, read from the source with `ast`: every import points down or sideways, never up,
and no two units import each other, directly or round a loop.

    foundation -> net / models / kv / traffic -> serving -> experiments / analysis -> cli

Every first-party module belongs to exactly one unit (`unit_of`); a new top-level module must be placed
in `FOUNDATION` or a unit below, or this test names it. Imports inside functions and under
``TYPE_CHECKING`` count: a lazy import is still a dependency. See docs/architecture.md, "Layers".
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = tuple(sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name not in ("tests", "benchmarks")))

RANK = {"foundation": 0, "net": 1, "models": 1, "kv": 1, "traffic": 1, "serving": 2, "experiments": 3, "analysis": 3, "labs": 3,
        "cli": 4}

# Modules directly under testbed/ and where they sit (a subpackage is placed by PACKAGES below).
FOUNDATION = {"testbed", "testbed.units", "testbed.errors", "testbed.clock", "testbed.interrupts", "testbed.scale", "testbed.validation",
              "testbed.scenario", "testbed.blocks", "testbed.atomic", "testbed.console",
              "testbed.packet"}
TOP_LEVEL = {"testbed.sections": "serving",  # the whole scenario: imports the parser of every section's owner
             "testbed.fidelity": "net",  # how faithfully the host emulates: network probes, process CPU
             "testbed.rundir": "foundation", "testbed.cli": "cli"}
PACKAGES = {"testbed.net": "net", "topologies": "net", "testbed.models": "models", "testbed.kv": "kv", "traffic": "traffic",
            "testbed.serving": "serving", "testbed.runner": "experiments", "experiments": "experiments", "analysis": "analysis",
            "labs": "labs"}  # the teaching labs check a student's runs with the analysis code


def unit_of(module: str) -> str:
    """The unit of a module. Each package's ``commands`` module is its part of the CLI (it parses options
    and calls the library), so it belongs to the cli unit wherever it lives."""
    if module.rsplit(".", 1)[-1] == "commands":
        return "cli"
    if module in FOUNDATION:
        return "foundation"
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    for prefix in sorted(PACKAGES, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return PACKAGES[prefix]
    raise LookupError(f"{module} has no layer: place it in tests/unit/test_layers.py (FOUNDATION, TOP_LEVEL or PACKAGES)")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def first_party_imports() -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import of a first-party module in the first-party packages."""
    out = []
    for top in FIRST_PARTY:
        for path in sorted((REPO / top).rglob("*.py")):
            mod = _module_name(path)
            package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                        base = ".".join(anchor + ([base] if base else []))
                    # ``from testbed.net import shaping`` imports the module testbed.net.shaping
                    names = [f"{base}.{a.name}" if (REPO / Path(*f"{base}.{a.name}".split("."))).with_suffix(".py").exists()
                             or (REPO / Path(*f"{base}.{a.name}".split("."))).is_dir() else base for a in node.names]
                else:
                    continue
                out += [(mod, n, node.lineno) for n in names if n.split(".")[0] in FIRST_PARTY]
    return out


def test_every_first_party_module_has_a_layer() -> None:
    modules = {_module_name(p) for top in FIRST_PARTY for p in (REPO / top).rglob("*.py")}
    unplaced = []
    for m in sorted(modules):
        try:
            unit_of(m)
        except LookupError as exc:
            unplaced.append(str(exc))
    assert not unplaced, "\n".join(unplaced)


def upward(imports: list[tuple[str, str, int]]) -> list[str]:
    return [f"{a} ({unit_of(a)}) imports {b} ({unit_of(b)}), line {line}"
            for a, b, line in imports if RANK[unit_of(b)] > RANK[unit_of(a)]]


def unit_cycle(imports: list[tuple[str, str, int]]) -> list[str]:
    """One loop of units importing each other (one import named per edge), or [] when there is none."""
    edges: dict[str, dict[str, str]] = {}
    for a, b, line in imports:
        ua, ub = unit_of(a), unit_of(b)
        if ua != ub:
            edges.setdefault(ua, {}).setdefault(ub, f"{a} -> {b} (line {line})")
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str]:
        state[u] = 1
        path.append(u)
        for v in sorted(edges.get(u, {})):
            if state.get(v) == 1:
                loop = path[path.index(v):] + [v]
                return [edges[x][y] for x, y in zip(loop, loop[1:])]
            if v not in state and (found := visit(v)):
                return found
        path.pop()
        state[u] = 2
        return []

    for u in sorted(edges):
        if u not in state and (found := visit(u)):
            return found
    return []


def test_no_import_points_up_a_layer() -> None:
    bad = upward(first_party_imports())
    assert not bad, "imports that point up a layer:\n" + "\n".join(bad)


def test_no_two_units_depend_on_each_other() -> None:
    loop = unit_cycle(first_party_imports())
    assert not loop, "units import each other round a loop:\n" + "\n".join(loop)


def test_the_checks_can_fail() -> None:
    """An import of serving from kv points up; kv -> models -> kv is a loop; a new module has no place."""
    assert upward([("testbed.kv.pool", "testbed.serving.router", 3)]) == [
        "testbed.kv.pool (kv) imports testbed.serving.router (serving), line 3"]
    assert unit_cycle([("testbed.kv.pool", "testbed.models.spec", 1), ("testbed.models.layers", "testbed.kv.cache", 2)]) == [
        "testbed.kv.pool -> testbed.models.spec (line 1)", "testbed.models.layers -> testbed.kv.cache (line 2)"]
    assert unit_cycle([("testbed.kv.pool", "testbed.blocks", 1), ("testbed.models.layers", "testbed.kv.cache", 2)]) == []
    assert unit_of("testbed.net.commands") == "cli" and unit_of("topologies.two_dc") == "net"
    with pytest.raises(LookupError, match="no layer"):
        unit_of("testbed.somewhere_new")
