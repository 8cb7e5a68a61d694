"""The project's first-party import graph, read from its source."""

import ast
from pathlib import Path

from tests.support.paths import ROOT

PACKAGES = ("agent", "collector", "dashboard", "trainer", "rankwatch")


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
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
