"""The project's packages import one another without cycles, so each module can be read, tested and
changed from the bottom up. Counted: every import statement in a module, at module level or inside a
function (a lazy import is still a dependency), resolved to the project module it names; not the
implicit import of a module's parent package (`import agent.semconv` runs rankwatch/agent/__init__.py, which
every module of the package would otherwise "import"). Packages too: no two import each other, and the
analysis knows what consumes its findings only through what it publishes (collector/findings.py)."""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "collector", "dashboard", "trainer", "rankwatch")


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules one module imports."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            named.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    found = set()
    for module in named:
        while module and module not in modules:
            module = module.rpartition(".")[0]
        if module and module != name:
            found.add(module)
    return found


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
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > len(modules)  # the graph was read at all
    assert _cycles(graph) == []


def test_a_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


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
