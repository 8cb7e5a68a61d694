"""Node health before failure: how far ahead the fleet analyzer names a node that wears out, against the
straggler analyzer on the same steps, and how often it names a healthy one.

Runs of the fleet simulator (trainer/simulate.py, its node health in trainer/nodehealth.py), built in memory
(`simulate.tables`), `--ranks` ranks on 8-rank nodes: `--runs` runs with one wearing node each, the kinds rotated
(pcie-replays, nvlink-crc, pcie-width, hot-gpu, ib-flap), its node, the step it starts wearing (30-100), how
hard (0.1x to 1x the simulator's rates, log-uniformly: the gentlest barely stand out before they fail) and the
step it fails at (350-650 steps later: its ranks 1.2x-1.4x slower from then) drawn from the run's seed;
`--clean` runs with no fault; `--job-wide` runs whose every GPU is power-capped from a drawn step (every rank
slows together). Each run is judged as the live collector judges it: a pass every 7 steps (the collector's
--analyze-every of 5 s at the simulator's 0.7 s steps) over the new steps, the straggler analyzer and the fleet
analyzer on the same frames.

  precision    of the nodes the fleet analyzer flagged (an unhealthy_node finding), the share that wore out
  recall       of the nodes that wore out, the share it flagged
  lead         steps from the pass that first flags the worn node to the pass that draws the straggler
               analyzer's first finding on its ranks once they slow (negative: the straggler was named first); the
               median over the worn nodes both named (a straggler finding on them before they slow, from the
               jitter, is counted apart: straggler_before_fail)
  before_fail  the share of worn nodes flagged before they failed (began to slow)
  false        flags of the clean runs' nodes (episodes), per 10,000 node-steps
  job          job-wide regressions found on the power-capped runs (recall), and drawn on the others (false)

Usage: python bench/fleet_health.py [--runs 40] [--clean 10] [--job-wide 4] [--ranks 64] [--seed 0]
The last line printed is a JSON object of the figures.
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.analysis.analyzers import Frames, fleet, stragglers
from trainer import simulate
from trainer.faults import WEAR_KINDS, parse

PASS_STEPS = 7  # steps between two passes
HISTORY = stragglers.READS.history  # steps before the new ones a pass reads
AFTER_FAIL = 120  # steps a worn run goes on after its node fails
CLEAN_STEPS = 800
RATES = (0.1, 1.0)  # how hard a node wears (trainer/nodehealth.py's rates times this), drawn log-uniformly


@dataclass
class Judged:
    """A run's passes: for each, the nodes flagged unhealthy, the ranks named by the straggler analyzer, and
    whether a job-wide regression was drawn."""

    passes: list[int] = field(default_factory=list)  # each pass's newest step
    flagged: list[set] = field(default_factory=list)  # hosts
    straggling: list[set] = field(default_factory=list)  # ranks
    regressed: list[bool] = field(default_factory=list)
    fleet_s: float = 0.0  # CPU time of the fleet analyzer's passes

    def first(self, flags: list, holds, since: int = 0) -> int | None:
        """The newest step of the first pass from step `since` on whose flag `holds`."""
        return next(
            (step for step, flag in zip(self.passes, flags, strict=True) if step >= since and holds(flag)), None
        )

    def episodes(self, host) -> int:
        """How many times `host` began to be flagged."""
        on = [host in f for f in self.flagged]
        return sum(now and not before for before, now in zip([False, *on], on, strict=False))


def judge(topology: simulate.Topology, steps: int, faults: list[str], seed: int) -> Judged:
    """A simulated run judged pass by pass, as the live collector judges it."""
    rank_steps, samples, placement = simulate.tables(topology, steps, [parse(f) for f in faults], seed)
    rank_steps = rank_steps.sort_values(["step", "rank"], ignore_index=True).assign(run_id="bench")
    samples = samples.sort_values("ts", kind="stable", ignore_index=True)
    ts, step_of_row = samples["ts"].to_numpy(), rank_steps["step"].to_numpy()

    def node_samples(since: int, until: int, slice_ns: int, metrics: list[str]) -> pd.DataFrame:
        part = samples.iloc[np.searchsorted(ts, since) : np.searchsorted(ts, until, side="right")]
        return part[part["metric"].isin(metrics)]

    judged, kept = Judged(), {}
    for last in range(PASS_STEPS - 1, steps, PASS_STEPS):
        first_new = last - PASS_STEPS + 1
        rows = slice(np.searchsorted(step_of_row, first_new - HISTORY), np.searchsorted(step_of_row, last, "right"))
        frames = Frames(
            "bench", rank_steps.iloc[rows], first_new, last, placement, 0, node_samples=node_samples, kept=kept
        )
        named = stragglers.judge(frames)
        started = time.process_time()
        found = fleet.judge(frames)
        judged.fleet_s += time.process_time() - started
        judged.passes.append(last)
        judged.flagged.append({f.evidence["host"] for f in found if f.kind == fleet.UNHEALTHY})
        judged.straggling.append({r for f in named if f.kind in ("rank", "node") for r in f.ranks})
        judged.regressed.append(any(f.kind == fleet.JOB_SLOWDOWN for f in found))
    return judged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="runs with a wearing node (the kinds rotated)")
    parser.add_argument("--clean", type=int, default=10, help="runs with no fault")
    parser.add_argument("--job-wide", type=int, default=4, help="runs whose every GPU is capped from a step on")
    parser.add_argument("--ranks", type=int, default=64, help="ranks, 8 a node")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.monotonic()
    topology = simulate.Topology(dp=args.ranks)
    nodes = -(-args.ranks // topology.ranks_per_host)
    host_of = topology.placement().set_index("rank")["host"]
    console = Console()
    rows, leads, flags, fleet_s, passes = [], [], {"true": 0, "false": 0}, 0.0, 0
    job_false, early = 0, 0
    for i in range(args.runs):
        draw = np.random.default_rng([args.seed, i])
        kind, node = WEAR_KINDS[i % len(WEAR_KINDS)], int(draw.integers(nodes))
        start = int(draw.integers(30, 101))
        fail = start + int(draw.integers(350, 651))
        slowdown = round(float(draw.uniform(1.2, 1.4)), 2)
        rate = round(float(np.exp(draw.uniform(np.log(RATES[0]), np.log(RATES[1])))), 3)
        spec = f"{kind}:node={node},from={start},fail={fail},slowdown={slowdown},rate={rate}"
        judged = judge(topology, fail + AFTER_FAIL, [spec], args.seed * 1000 + i)
        ranks = set(host_of.index[host_of == node])
        flagged_at = judged.first(judged.flagged, lambda hosts: str(node) in hosts)  # (evidence names hosts)
        named_at = judged.first(judged.straggling, lambda named: bool(named & ranks), since=fail)
        early += any(step < fail and named & ranks for step, named in zip(judged.passes, judged.straggling))
        others = {h for hosts in judged.flagged for h in hosts} - {str(node)}
        flags["true"] += flagged_at is not None
        flags["false"] += len(others)
        job_false += any(judged.regressed)
        if flagged_at is not None and named_at is not None:
            leads.append((kind, named_at - flagged_at))
        fleet_s, passes = fleet_s + judged.fleet_s, passes + len(judged.passes)
        rows.append((kind, spec, flagged_at, named_at, fail, len(others)))
    clean_false, clean_node_steps = 0, 0
    for i in range(args.clean):
        judged = judge(topology, CLEAN_STEPS, [], args.seed * 1000 + 500 + i)
        clean_false += sum(judged.episodes(str(h)) for h in range(nodes))
        flags["false"] += len({h for hosts in judged.flagged for h in hosts})
        job_false += any(judged.regressed)
        clean_node_steps += nodes * CLEAN_STEPS
        fleet_s, passes = fleet_s + judged.fleet_s, passes + len(judged.passes)
    job_found = 0
    for i in range(args.job_wide):
        draw = np.random.default_rng([args.seed, 10_000 + i])
        capped_from, watts = int(draw.integers(150, 400)), int(draw.integers(40, 50)) * 10
        judged = judge(
            topology, CLEAN_STEPS, [f"power-cap:watts={watts},from={capped_from}"], args.seed * 1000 + 900 + i
        )
        found_at = judged.first(judged.regressed, bool)
        job_found += found_at is not None and found_at >= capped_from
        flags["false"] += len({h for hosts in judged.flagged for h in hosts})
        fleet_s, passes = fleet_s + judged.fleet_s, passes + len(judged.passes)

    table = Table("kind", "fault", "flagged at", "straggler at", "fails at", "others flagged", title="worn nodes")
    for kind, spec, flagged_at, named_at, fail, others in rows:
        table.add_row(kind, spec, str(flagged_at), str(named_at), str(fail), str(others))
    console.print(table)
    worn = len(rows)
    by_kind = {
        kind: {
            "recall": sum(r[2] is not None for r in rows if r[0] == kind) / max(sum(r[0] == kind for r in rows), 1),
            "median_lead_steps": statistics.median([lead for k, lead in leads if k == kind])
            if any(k == kind for k, _ in leads)
            else None,
        }
        for kind in WEAR_KINDS
    }
    figures = {
        "precision": flags["true"] / (flags["true"] + flags["false"]) if flags["true"] + flags["false"] else None,
        "recall": flags["true"] / worn if worn else None,
        "median_lead_steps": statistics.median(lead for _, lead in leads) if leads else None,
        "flagged_before_fail": sum(r[2] is not None and r[2] < r[4] for r in rows) / worn if worn else None,
        "straggler_before_fail": early,
        "false_per_10k": 1e4 * clean_false / clean_node_steps if clean_node_steps else None,
        "job_recall": job_found / args.job_wide if args.job_wide else None,
        "job_false": job_false,
        "by_kind": by_kind,
        "runs": worn,
        "clean_runs": args.clean,
        "job_wide_runs": args.job_wide,
        "ranks": args.ranks,
        "nodes": nodes,
        "fleet_ms_per_pass": 1e3 * fleet_s / passes if passes else None,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
