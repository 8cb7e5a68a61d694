"""The project's packages import one another without cycles, so each module can be read, tested and
changed from the bottom up. Counted: every import statement in a module, at module level or inside a
function (a lazy import is still a dependency), resolved to the project module it names; not the
implicit import of a module's parent package (`import agent.semconv` runs rankwatch/agent/__init__.py, which
every module of the package would otherwise "import"). Packages too: no two import each other, and the
analysis knows what consumes its findings only through what it publishes (collector/findings.py)."""

import ast
from collections import defaultdict

import pytest

from tests.support.import_graph import module_imports, project_modules
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_import_graph_has_no_cycles():
    modules = project_modules()
    graph = {name: module_imports(name, path, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > len(modules)  # the graph was read at all
    assert _cycles(graph) == []


def test_a_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: module_imports(name, path, modules) for name, path in modules.items()}


def _package(module: str) -> str:
    """A module's package, as the package graph counts them: its first two names (`collector.analysis` holds
    collector/analysis/analyzers/ too); a module of a top package's own stands alone (`collector.server`)."""
    return ".".join(module.split(".")[:2])


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The package graph of a module graph: which packages each package's modules import."""
    packages: dict[str, set[str]] = defaultdict(set)
    for module, imported in graph.items():
        packages[_package(module)].update(_package(m) for m in imported if _package(m) != _package(module))
    return dict(packages)


def _crossings(graph: dict[str, set[str]], importer: str, imported: tuple[str, ...]) -> list[str]:
    """Each import of a module of `importer` (a package, or a module) that names one of `imported`."""

    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted(
        f"{module} -> {name}"
        for module, names in graph.items()
        if within(module, importer)
        for name in names
        if any(within(name, package) for package in imported)
    )


def test_the_packages_import_one_another_without_cycles():
    packages = _packages(_graph())
    assert {"collector.analysis", "collector.alerts", "collector.control", "collector.reports"} <= set(packages)
    assert _cycles(packages) == []


def test_a_package_cycle_is_found():
    graph = {"p.a.x": {"p.b"}, "p.a.y": set(), "p.b": {"p.a.y"}, "p.c": {"p.a.x"}}
    assert _cycles(_packages(graph)) == [["p.a", "p.b"]]


def test_the_analysis_publishes_its_findings_and_its_consumers_subscribe():
    """collector/analysis imports none of what consumes its findings (the alert outbox, rollbacks and stacks
    requests, the reports drawn on it): collector/server.py registers them, and they and the analyzers meet in a
    leaf that imports nothing of the project (collector/findings.py). The dashboard reads the store and the
    leaves, never the analysis."""
    graph = _graph()
    assert _crossings(graph, "collector.analysis", ("collector.alerts", "collector.control", "collector.reports")) == []
    assert _crossings(graph, "dashboard", ("collector.analysis",)) == []
    assert graph["collector.findings"] == set()
    assert _crossings(graph, "collector.alerts.outbox", ("collector.findings",)) == [
        "collector.alerts.outbox -> collector.findings"
    ]  # (the check reads what it is meant to)


def _tests_named(path) -> set[str]:
    """The modules under tests/ that a file's import statements name (`tests.support.paths`, ...)."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            named.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in named if name == "tests" or name.startswith(("tests.", "conftest"))}


def test_tests_share_only_tests_support():
    """No test module imports another (what two share lives in tests/support/), nothing imports conftest by
    name, and the benches import tests/support alone: a test can move or go without breaking another."""
    files = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py")]
    shared = {str(path.relative_to(ROOT)): _tests_named(path) for path in files}
    assert len(files) > 100 and any(shared.values())  # the imports were read at all
    wrong = {path: sorted(n for n in names if not n.startswith("tests.support.")) for path, names in shared.items()}
    assert {path: names for path, names in wrong.items() if names} == {}
