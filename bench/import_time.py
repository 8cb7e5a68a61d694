"""What opening a store costs in imports: `python -X importtime` of the modules a reader of a store file
loads, in this tree against a baseline tree (an earlier commit, say, unpacked with `git archive`), the
runs of the two interleaved so that a loaded machine weighs on both alike.

  baseline   the module in the baseline tree (before: where the store was one module, `collector.store`)
  this       the module in this tree (the store's bottom module `collector.store.db`)

Each pair prints the median cumulative import time of its module over the runs, the modules it leaves in
sys.modules, and the ratio this/baseline.

Usage: python bench/import_time.py --baseline DIR [--runs 9] [--pair BASELINE_MODULE:THIS_MODULE ...]
  (default pairs: collector.store:collector.store.db, dashboard.source, collector.reports.query)
"""

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

THIS = Path(__file__).resolve().parent.parent
PAIRS = (
    "collector.store:collector.store.db",
    "dashboard.source:dashboard.source",
    "collector.query:collector.reports.query",
)
_COUNT = "import sys; import {module}; print(len(sys.modules))"


def _run(tree: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stderr if "-X" in args else done.stdout


def import_ms(tree: Path, module: str) -> float:
    """The cumulative import time of `module` in a fresh interpreter in `tree`, in ms."""
    for line in _run(tree, "-X", "importtime", "-c", f"import {module}").splitlines():
        parts = line.split("|")  # "import time: self | cumulative | " + two spaces a level + the name
        if len(parts) == 3 and parts[2] == f" {module}":
            return int(parts[1]) / 1000
    raise RuntimeError(f"no import of {module} in {tree}")


def modules(tree: Path, module: str) -> int:
    return int(_run(tree, "-c", _COUNT.format(module=module)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the tree to compare with")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--pair", action="append", help="BASELINE_MODULE:THIS_MODULE (repeatable)")
    args = parser.parse_args()
    print(
        f"{'baseline module':<18} {'ms':>6} {'modules':>8}   "
        f"{'this module':<20} {'ms':>6} {'modules':>8}   this/baseline"
    )
    for pair in args.pair or PAIRS:
        before, after = pair.split(":")
        baseline, this = [], []
        for _ in range(args.runs):
            baseline.append(import_ms(args.baseline, before))
            this.append(import_ms(THIS, after))
        a, b = statistics.median(baseline), statistics.median(this)
        print(
            f"{before:<18} {a:>6.0f} {modules(args.baseline, before):>8}   {after:<20} {b:>6.0f} "
            f"{modules(THIS, after):>8}   {b / a:.2f}"
        )


if __name__ == "__main__":
    main()
