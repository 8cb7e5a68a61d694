"""What importing each shared leaf costs, against the agent's machinery it used to bring in.

Each module is imported in fresh interpreters under `python -X importtime`; a figure is the sum of
the self times of every module the import loaded beyond the interpreter's start-up (the median over
`--runs`), and the number of those modules. The baseline, run side by side, is `agent.session`: the
session and the OpenTelemetry SDK, which `import agent.semconv` loaded before the agent package
imported lazily.

    python bench/leaf_imports.py [--runs 9]
"""

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEAVES = (
    "rankwatch.agent",
    "rankwatch.agent.semconv",
    "rankwatch.agent.gpumodel",
    "rankwatch.agent.paths",
    "rankwatch.agent.apiclient",
)
BASELINE = "rankwatch.agent.session"


def _self_times(code: str) -> dict[str, int]:
    """Each module `code` imported, with its self time (µs)."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    times = {}
    for line in r.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "self [us]" not in line:
            own, _, name = (field.strip() for field in line.removeprefix("import time:").split("|"))
            times[name] = int(own)
    return times


def measure(module: str, runs: int) -> tuple[float, int]:
    """(median ms, modules loaded) of importing `module`."""
    totals, count = [], 0
    for _ in range(runs):
        startup = _self_times("pass")
        loaded = {name: us for name, us in _self_times(f"import {module}").items() if name not in startup}
        totals.append(sum(loaded.values()) / 1000)
        count = len(loaded)
    return statistics.median(totals), count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=9)
    args = p.parse_args()
    base_ms, base_count = measure(BASELINE, args.runs)
    print(f"{'import':<18}{'ms':>9}{'modules':>9}{'vs baseline':>13}")
    print(f"{BASELINE:<18}{base_ms:>9.1f}{base_count:>9}{'1':>13}  (baseline)")
    for module in LEAVES:
        ms, count = measure(module, args.runs)
        print(f"{module:<18}{ms:>9.1f}{count:>9}{ms / base_ms:>13.3f}")


if __name__ == "__main__":
    main()
