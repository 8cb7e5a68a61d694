"""The agent's old import path: `import agent` is `rankwatch.agent`, kept for a deprecation window.

The agent runs inside users' training processes, where a package of their own named `agent` (common
in reinforcement learning code) would clash with it: it lives at `rankwatch.agent`, and rankwatch's own
code never imports this name. Importing it warns once and hands over the real modules: `agent` and
`agent.<module>` are `rankwatch.agent` and `rankwatch.agent.<module>` themselves (one session, not a
copy), through an importer that aliases the submodules on first use.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

warnings.warn(
    "`import agent` is deprecated and will be removed: `from rankwatch import agent` is the same module",
    DeprecationWarning,
    stacklevel=2,
)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`agent.<name>` as the module `rankwatch.agent.<name>` itself."""

    def __init__(self) -> None:
        self._specs: dict = {}  # the real modules' own specs, which the import system overwrites with the alias's

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("agent."):
            return None
        real = importlib.util.find_spec("rankwatch." + name)
        return importlib.util.spec_from_loader(name, self) if real else None

    def create_module(self, spec):
        module = importlib.import_module("rankwatch." + spec.name)
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._specs.pop(module.__name__, module.__spec__)


sys.meta_path.insert(0, _Alias())
sys.modules[__name__] = importlib.import_module("rankwatch.agent")
