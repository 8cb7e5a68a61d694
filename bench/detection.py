"""Straggler detection on simulated fleets, judged against each run's own noise: false findings
on clean runs and steps to detection of slowdowns, at 1% to 5% step-time jitter, and the
analyzer's CPU time per step judged.

Scenarios are drawn by the fleet simulator (trainer/simulate.py) and judged by the straggler
analyzer (collector/analysis/analyzers/stragglers.py) as the engine judges them (each step once, on the
steps before it), offline: no collector in the loop, so the analyzer's own cost is what is timed.

- clean runs at 1%, 2%, 3%, 4%, 5% jitter: findings per 10,000 steps (the goal: 0), against a
  baseline analyzer with the fixed floor of before (a 12-step window, z 4 on a spread floored at
  1%, judged on the newest 12 steps), side by side;
- slowdowns of 5% and 10% on one rank, one node (8 ranks) and one pipeline stage from step 20, at
  each jitter: found (the right kind and ranks) and how many steps after the onset (median, max
  over seeds); noisier runs are judged over longer windows, so they take longer;
- the analyzer's CPU time per step judged at `--ranks` ranks.

Usage: python bench/detection.py [--ranks 1024] [--clean-steps 4000] [--steps 160] [--seeds 3]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.analysis.analyzers import Frames, stragglers
from trainer import simulate
from trainer.faults import parse

ONSET = 20
JITTERS = (0.01, 0.02, 0.03, 0.04, 0.05)
CHUNK = 50  # steps judged per call on clean runs, as a pass judges the steps committed since the last


def frames(topology, n_steps, faults, jitter, seed) -> pd.DataFrame:
    timing = simulate.Timing(jitter=jitter)
    steps = pd.concat(simulate.steps(topology, n_steps, faults, timing, seed=seed), ignore_index=True)
    return steps.assign(run_id="bench", end_ts=steps["end_ns"])


def judge(steps: pd.DataFrame, placement: pd.DataFrame, first: int, last: int, settings: stragglers.Settings) -> list:
    """The analyzer over steps first..last, with the history before them it reads."""
    history = steps[(steps["step"] > first - 1 - stragglers.READS.history) & (steps["step"] <= last)]
    return stragglers.judge(Frames("bench", history, first, last, placement, 0), settings)


def baseline(steps: pd.DataFrame, placement: pd.DataFrame, end: int) -> list:
    """The fixed floor of before: the newest 12 steps, z 4, spread floored at 1%."""
    s = stragglers.Settings(max_window=12, false_rate=1.0, jitter_floor=0.01, resolution=1.0)
    recent = steps[(steps["step"] > end - 12) & (steps["step"] <= end)]
    return stragglers.judge(Frames("bench", recent, end, end, placement, 0), s)


def clean_rates(topology, placement, n_steps: int, settings) -> Table:
    table = Table(
        "jitter",
        "steps judged",
        "findings",
        "per 10,000 steps",
        "baseline: steps flagged per 10,000",
        title="clean runs: false findings (baseline: the fixed floor of before, every step judged)",
    )
    for jitter in track(JITTERS, description="clean runs", transient=True):
        steps = frames(topology, n_steps, [], jitter, seed=7)
        found = sum(
            len(judge(steps, placement, start, min(start + CHUNK, n_steps) - 1, settings))
            for start in range(12, n_steps, CHUNK)
        )
        flagged = sum(bool(baseline(steps, placement, end)) for end in range(12, n_steps))
        judged = n_steps - 12
        table.add_row(
            f"{jitter:.0%}", str(judged), str(found), f"{found / judged * 1e4:.1f}", f"{flagged / judged * 1e4:.0f}"
        )
    return table


def detection(topology, placement, n_steps: int, seeds: int, settings) -> tuple[Table, float, int]:
    node_ranks = list(range(64, 72))
    stage_ranks = placement.loc[placement["pp_stage"] == 3, "rank"].tolist()
    patterns = {
        "rank": ("straggler:rank=37,slowdown={s},from=20", "rank", [37]),
        "node": ("slow-node:node=8,slowdown={s},from=20", "node", node_ranks),
        "stage": ("slow-stage:stage=3,slowdown={s},from=20", "stage", stage_ranks),
    }
    table = Table(
        "pattern",
        "slowdown",
        *[f"{j:.0%} jitter" for j in JITTERS],
        title=f"steps from onset to detection (median, max over {seeds} seeds; found/seeds)",
    )
    cpu, calls = 0.0, 0
    cases = [(p, s) for p in patterns for s in (1.05, 1.10)]
    for pattern, slowdown in track(cases, description="slowdowns", transient=True):
        template, kind, ranks = patterns[pattern]
        cells = []
        for jitter in JITTERS:
            delays = []
            for seed in range(seeds):
                steps = frames(topology, n_steps, [parse(template.format(s=slowdown))], jitter, seed)
                for end in range(ONSET, n_steps):
                    started = time.process_time()
                    found = judge(steps, placement, end, end, settings)
                    cpu, calls = cpu + time.process_time() - started, calls + 1
                    if any(f.kind == kind and f.ranks == ranks for f in found):
                        delays.append(end - ONSET)
                        break
            cells.append(
                f"{int(np.median(delays))}, {max(delays)} ({len(delays)}/{seeds})" if delays else f"- (0/{seeds})"
            )
        table.add_row(pattern, f"{(slowdown - 1) * 100:.0f}%", *cells)
    return table, cpu, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--clean-steps", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=160, help="steps of each slowdown scenario")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    pp = 8
    topology = simulate.Topology(dp=args.ranks // pp, pp=pp)
    placement = topology.placement()
    settings, console = stragglers.Settings(), Console()
    console.print(clean_rates(topology, placement, args.clean_steps, settings))
    table, cpu, calls = detection(topology, placement, args.steps, args.seeds, settings)
    console.print(table)
    console.print(f"analyzer CPU per step judged at {args.ranks} ranks: {cpu / calls * 1e3:.1f} ms ({calls} steps)")


if __name__ == "__main__":
    main()
