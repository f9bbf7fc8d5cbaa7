"""The tree is the map (docs/architecture.md): no import cycle inside the package, the
configuration imports nothing of the sinks, and none of the tricks the layout was once bent by."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "sidecar"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every sidecar module ``path`` imports, at the top or inside a function (a cycle hidden in
    a function is still a cycle for the reader)."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("sidecar"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("sidecar"):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _exists(candidate) else base)
    found.discard(module)
    return {m for m in found if _exists(m)}


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules along it, or None. A package's ``__init__``
    imported for a submodule is not an edge back (Python imports it first anyway)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


# The tree from the bottom up (docs/architecture.md): a module imports only from its own level
# or below, so no arrow runs back up. A module not named here is a finding of the test below.
LEVELS: tuple[tuple[str, ...], ...] = (
    ("sidecar", "sidecar.config", "sidecar.option_values", "sidecar.log", "sidecar.signals", "sidecar.urls",
     "sidecar.protocol", "sidecar.app_shared", "sidecar.client", "sidecar.thresholds",
     "sidecar.metrics",  # the metric table, the engine's series included
     "sidecar.layers", "sidecar.codegen", "sidecar.units"),  # the table's records; words
    ("sidecar.samples",),
    ("sidecar.judge",),  # the figures, the one window, the rules and the judge
    ("sidecar.sources", "sidecar.views", "sidecar.summary"),  # what is read; the renderers
    # the alert rules are rendered from the verdict's rules
    ("sidecar.alert_rules", "sidecar.wire", "sidecar.durability", "sidecar.inject",
     "sidecar.simulate"),
    ("sidecar.sinks", "sidecar.recent"),
    ("sidecar.agent", "sidecar.window_socket", "sidecar.store"),
    ("sidecar.status_file", "sidecar.wiring"),
    ("sidecar.commands",),  # diagnose, probe, status, fleet, --dry-run: above the wiring
    ("sidecar.cli", "sidecar.__main__"),
)


def _level(module: str) -> int:
    best = None
    for n, names in enumerate(LEVELS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                    best is None or len(name) > len(best[1])):
                best = (n, name)
    assert best is not None, f"{module} has no level in LEVELS: place it in the tree"
    return best[0]


def test_no_import_runs_back_up_the_tree():
    upward = sorted(f"{a} (level {_level(a)}) imports {b} (level {_level(b)})"
                    for a, imported in _graph().items() for b in imported
                    if _level(b) > _level(a))
    assert upward == []


def test_the_level_check_finds_an_upward_import():
    assert _level("sidecar.views.table") < _level("sidecar.wiring")
    assert _level("sidecar.commands.diagnose") > _level("sidecar.wiring")


def test_the_package_has_no_import_cycle():
    assert _cycle(_graph()) is None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_configuration_imports_nothing_of_the_sinks_sources_or_spool():
    reached, todo = set(), ["sidecar.config"]
    graph = _graph()
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(graph.get(m, ()))
    assert not {m for m in reached if m.startswith(("sidecar.sinks", "sidecar.sources",
                                                     "sidecar.durability", "sidecar.views"))}


@pytest.mark.parametrize("pattern", [r"\bhttp\.client\b", r"sys\.modules\[[^\]]*\]\s*=\s*None",
                                     r"_nvmlGetFunctionPointer", r"tuple\.__new__"])
def test_no_hand_rolled_replacement_for_a_library(pattern):
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in PACKAGE.rglob("*.py")
            for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert hits == []
