"""Power caps on a simulated fleet with a straggler: energy saved and slowdown of no cap, a
Zeus-style global limit and per-rank caps, side by side.

The fleet simulator (trainer/simulate.py) plays a data-parallel job of 1,024 ranks, one rank
computing 20% slower, its GPUs following the GPU power model
(rankwatch/agent/gpumodel.py). The power analyzer (collector/analysis/analyzers/power.py) decides, offline:

  (a) no cap: every GPU at its highest limit (700 W);
  (b) a global limit the way Zeus's GlobalPowerLimitOptimizer finds it: the job runs under
      each limit from 700 W down to 200 W, 25 W apart, for 2 warm-up and 8 profiled steps,
      and the limit is picked on the measured curve by ZeusCost (eta 0.5) and by the least
      energy within 2% slowdown;
  (c) per-rank caps from the slack the ranks waiting for the straggler have, recommended from
      one run of `--steps` steps at 700 W.

Each choice is then measured on a held-out run (another seed, `--eval-steps` steps) played
with and without the caps: the same noise, so the differences are the caps'. Figures per
step: energy of all GPUs, and step time (the median rank's).

At a thousand ranks the simulator's GC-like pauses (`--pause-rate` per rank-step, 50-200 ms)
often outlast the straggler; `--pause-rate 0` shows the caps without them.

Usage: python bench/power.py [--ranks 1024] [--steps 60] [--eval-steps 100] [--pause-rate 0.0005]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.analysis.analyzers import power
from rankwatch.agent.gpumodel import GpuModel
from trainer import simulate
from trainer.faults import parse

STRAGGLER = "straggler:rank=200,slowdown=1.2"
SWEEP_W = np.arange(700.0, 199.0, -25.0)
WARMUP, PROFILED = 2, 8


def run(
    topology: simulate.Topology,
    timing: simulate.Timing,
    n_steps: int,
    specs: list[str],
    seed: int,
    limits: np.ndarray | None = None,
    samples: bool = False,
) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """The rank-steps of a simulated run, and its device samples when asked."""
    frames = list(
        simulate.steps(topology, n_steps, [parse(s) for s in specs], timing, seed=seed, start_ns=0, power_limits=limits)
    )
    steps = pd.concat(frames, ignore_index=True).assign(run_id="bench-power")
    return steps, pd.concat([simulate.device_samples(f) for f in frames], ignore_index=True) if samples else None


def measured(steps: pd.DataFrame) -> tuple[float, float]:
    """(energy per step of all GPUs, J; step time of the median rank, s), means over the run."""
    return steps.groupby("step")["energy_j"].sum().mean(), steps.groupby("step")["duration_s"].median().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-steps", type=int, default=100)
    parser.add_argument("--pause-rate", type=float, default=simulate.Timing().pause_rate)
    args = parser.parse_args()
    console, topology = Console(width=150), simulate.Topology(dp=args.ranks)
    timing = simulate.Timing(pause_rate=args.pause_rate)

    each = WARMUP + PROFILED
    sweep_specs = [STRAGGLER] + [
        f"power-cap:watts={w:g},from={i * each},to={(i + 1) * each}" for i, w in enumerate(SWEEP_W)
    ]
    sweep, _ = run(topology, timing, len(SWEEP_W) * each, sweep_specs, seed=1)
    settings = power.Settings(warmup=WARMUP)
    zeus = power.analyze(sweep, policy=power.Policy("zeus", 0.5), settings=settings)
    slowdown_2 = power.analyze(sweep, policy=power.Policy("max-slowdown", 0.02), settings=settings)
    profiling_j = sweep["energy_j"].sum()

    observed, devices = run(topology, timing, args.steps, [STRAGGLER], seed=1, samples=True)
    started = time.process_time()
    nameplate_w = args.ranks * GpuModel().limit_max_w  # the facility's budget: the GPUs' highest limits
    report = power.analyze(observed, devices, topology.placement(), facility_w=nameplate_w)
    analysis_cpu = time.process_time() - started
    per_rank = report.per_rank

    baseline = measured(run(topology, timing, args.eval_steps, [STRAGGLER], seed=2)[0])
    rows = [("(a) no cap", "700 W", baseline, "")]
    for name, choice in (
        ("(b) Zeus global, ZeusCost eta 0.5", zeus.job_cap),
        ("(b) Zeus global, <= 2% slowdown", slowdown_2.job_cap),
    ):
        got = measured(
            run(topology, timing, args.eval_steps, [STRAGGLER], seed=2, limits=np.full(args.ranks, choice.cap_w))[0]
        )
        rows.append(
            (
                name,
                f"{choice.cap_w:.0f} W",
                got,
                f"{100 * choice.energy_saving:.1f}% / {100 * (choice.slowdown - 1):+.2f}% (in the sweep)",
            )
        )
    limits = simulate.power_limits({str(r): w for r, w in per_rank.caps.items()}, args.ranks)
    got = measured(run(topology, timing, args.eval_steps, [STRAGGLER], seed=2, limits=limits)[0])
    low, high = (100 * x / per_rank.energy_j_per_step for x in per_rank.saving_j_per_step_range)
    rows.append(
        (
            "(c) per-rank caps",
            (f"{min(per_rank.caps.values()):.0f}-{max(per_rank.caps.values()):.0f} W on {len(per_rank.caps)} ranks"),
            got,
            (
                f"{100 * per_rank.saving_fraction:.1f}% ({low:.1f}-{high:.1f}) / "
                f"{100 * (per_rank.slowdown - 1):+.2f}% ({100 * (per_rank.slowdown_range[0] - 1):+.1f} to "
                f"{100 * (per_rank.slowdown_range[1] - 1):+.1f})"
            ),
        )
    )

    console.print(
        f"{args.ranks} ranks (data-parallel), {STRAGGLER}, pauses {args.pause_rate:g} per rank-step; "
        f"held-out runs of {args.eval_steps} steps"
    )
    table = Table("policy", "limits", "energy per step", "saved", "step time", "slowdown", "predicted saved / slowdown")
    energy0, time0 = baseline
    for name, limits_text, (energy, step_s), predicted in rows:
        table.add_row(
            name,
            limits_text,
            f"{energy / 1e3:.1f} kJ",
            f"{100 * (1 - energy / energy0):.1f}%",
            f"{step_s:.3f} s",
            f"{100 * (step_s / time0 - 1):+.2f}%",
            predicted,
        )
    console.print(table)
    sweep_s, n_sweep = sweep.groupby("step")["duration_s"].median().sum(), sweep["step"].nunique()
    console.print(
        f"Zeus-style sweep: {len(SWEEP_W)} limits x {each} steps: {sweep_s:.0f} s "
        f"({100 * (sweep_s / (n_sweep * time0) - 1):+.0f}% over as many uncapped steps), "
        f"{profiling_j / 3.6e6:.2f} kWh ({100 * (profiling_j / (n_sweep * energy0) - 1):+.0f}%)"
    )
    console.print(
        f"per-rank caps: safety {per_rank.safety:.3f} (share of the median slack filled); straggler kept: "
        f"{[c.rank for c in per_rank.ranks if c.cap_w is None]}; analysis {analysis_cpu:.1f} s CPU for "
        f"{args.steps} steps x {args.ranks} ranks ({len(devices):,} device samples)"
    )
    if report.headroom:
        h = report.headroom
        console.print(
            f"headroom: {h.nodes} nodes, p99 {h.job_p99_w / 1e3:.0f} kW, peak {h.job_peak_w / 1e3:.0f} kW "
            f"against a {h.facility_w / 1e3:.0f} kW nameplate: {h.extra_nodes} more nodes at "
            f"{100 * h.risk:.1f}% risk"
        )


if __name__ == "__main__":
    main()
