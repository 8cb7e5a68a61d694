"""Straggler detection on simulated fleets: detection rate, steps to detection, false positives,
and the analyzer's CPU time per step of telemetry.

Scenarios are drawn by the fleet simulator (trainer/simulate.py) and judged by the straggler
analyzer (collector/analyzers/stragglers.py) as the collector would, once per step over the
latest window, offline (no collector in the loop, so the analyzer's own cost is what is timed):

- slowdowns of 3%, 5%, 10%, 30% on one rank, one node (8 ranks) and one pipeline stage,
  starting at step 20, at 2% jitter: found (the right kind and ranks) and how many steps after
  the onset;
- clean runs at 1%, 2% and 3% jitter: steps with any finding, per 10,000 steps;
- the analyzer's CPU time for one step's analysis at 1,024 and 16,384 ranks.

Usage: python bench/detection.py [--ranks 1024] [--steps 60] [--clean-steps 2000] [--seeds 3]
"""

import argparse
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.analyzers import stragglers  # noqa: E402
from trainer import simulate  # noqa: E402
from trainer.faults import parse  # noqa: E402

ONSET = 20


def frames(topology, n_steps, faults, jitter, seed) -> Iterator[pd.DataFrame]:
    timing = simulate.Timing(jitter=jitter)
    return (frame.assign(run_id="bench") for frame in simulate.steps(topology, n_steps, faults, timing, seed=seed))


def judge(steps: Iterator[pd.DataFrame], placement: pd.DataFrame, settings: stragglers.Settings):
    """(step, findings) for every step once a window is full, and the CPU seconds spent in the
    analyzer. The window slides over the frames as they come, so a long run costs no more memory
    or time per step than a short one."""
    cpu, out, window = 0.0, [], deque(maxlen=settings.window)
    for frame in steps:
        window.append(frame)
        if len(window) < settings.window:
            continue
        recent = pd.concat(window, ignore_index=True)
        started = time.process_time()
        findings = stragglers.analyze(recent, placement, settings)
        cpu += time.process_time() - started
        out.append((int(frame["step"].iloc[0]), findings))
    return out, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--clean-steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    pp = 8
    topology = simulate.Topology(dp=args.ranks // pp, pp=pp)
    placement = topology.placement()
    settings = stragglers.Settings()
    console = Console()
    node_ranks = list(range(64, 72))
    stage_ranks = placement.loc[placement["pp_stage"] == 3, "rank"].tolist()
    patterns = {"rank": ("straggler:rank=300,slowdown={s},from=20", "rank", [300]),
                "node": ("slow-node:node=8,slowdown={s},from=20", "node", node_ranks),
                "stage": ("slow-stage:stage=3,slowdown={s},from=20", "stage", stage_ranks)}

    table = Table("pattern", "slowdown", "found", "steps to detection (median, max)", "wrong findings")
    cpu_total, calls = 0.0, 0
    cases = [(p, s) for p in patterns for s in (1.03, 1.05, 1.10, 1.30)]
    for pattern, slowdown in track(cases, description="scenarios", transient=True):
        template, kind, ranks = patterns[pattern]
        delays, wrong = [], 0
        for seed in range(args.seeds):
            df = frames(topology, args.steps, [parse(template.format(s=slowdown))], 0.02, seed)
            judged, cpu = judge(df, placement, settings)
            cpu_total, calls = cpu_total + cpu, calls + len(judged)
            hits = [step for step, fs in judged if any(f.kind == kind and f.ranks == ranks for f in fs)]
            wrong += sum(1 for _, fs in judged for f in fs if not (f.kind == kind and f.ranks == ranks))
            if hits:
                delays.append(hits[0] - ONSET)
        found = f"{len(delays)}/{args.seeds}"
        steps_to = f"{sorted(delays)[len(delays) // 2]}, {max(delays)}" if delays else "-"
        table.add_row(pattern, f"{(slowdown - 1) * 100:.0f}%", found, steps_to, str(wrong))
    console.print(table)

    clean = Table("jitter", "steps judged", "steps with a finding", "per 10,000 steps")
    for jitter in (0.01, 0.02, 0.03):
        df = track(frames(topology, args.clean_steps, [], jitter, seed=7), total=args.clean_steps,
                   description=f"clean run at {jitter:.0%} jitter", transient=True)
        judged, cpu = judge(df, placement, settings)
        cpu_total, calls = cpu_total + cpu, calls + len(judged)
        flagged = sum(1 for _, fs in judged if fs)
        clean.add_row(f"{jitter * 100:.0f}%", str(len(judged)), str(flagged), f"{flagged / len(judged) * 1e4:.1f}")
    console.print(clean)
    console.print(f"analyzer CPU per step at {args.ranks} ranks: {cpu_total / calls * 1e3:.1f} ms "
                  f"(window {settings.window} steps, {calls} calls)")

    big = simulate.Topology(dp=16384 // pp, pp=pp)
    df = frames(big, settings.window + 5, [parse("straggler:rank=9000,slowdown=1.1,from=0")], 0.02, 0)
    judged, cpu = judge(df, big.placement(), settings)
    console.print(f"analyzer CPU per step at 16,384 ranks: {cpu / len(judged) * 1e3:.0f} ms "
                  f"(keeps up with one step per second while this is under 1,000 ms); found: "
                  f"{[(f.kind, f.ranks) for f in judged[-1][1]]}")


if __name__ == "__main__":
    main()
