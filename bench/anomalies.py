"""How the rollback policy fares on real training curves: false rollbacks on clean curves, and how
soon injected spikes and NaNs are rolled back.

Curves: the first attempt of every step of GPT-2 on an H100 before its injected spike
(tests/data/h100_gpt2_first_attempts.csv), 1-rank CPU runs of the reference trainer over seeds,
learning rates and model sizes, sent through a real collector (`rankwatch train`, no rollback) and
read back from its store, and the fleet simulator's training curve (trainer/curve.py: 8 ranks, the
loss falling as a power law, natural gradient-norm excursions) over seeds and noise levels (0.5x to
4x the H100's noise), its spikes and NaNs injected by the simulator's own `spike` and `nan` faults.
Each curve is judged as the live collector judges it: after every step, the anomaly analyzer over
the newest 48 steps, and a rollback for each finding the default policy (collector/control/commands.py's
ROLLBACK_ON) answers.

  false    rollback-worthy findings on the clean curves, per 10,000 steps
  caught   the same curves with one step's loss (and gradient norm) scaled 2x, 5x, 50x, or made NaN,
           at every 20th step past the analyzer's warmup and baseline: the share rolled back, and
           the steps from the bad step to the pass that rolls it back (0: the pass right after it);
           on the simulator's curves at every 100th step (each case judges ~50 passes)

Usage: python bench/anomalies.py [--steps 300] [--seeds 2] [--sim-steps 1000] [--sim-seeds 3]
(--seeds 0: no trainer runs)
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.analysis.analyzers import anomalies
from collector.control.commands import ROLLBACK_ON
from rankwatch.launch import train
from tests.support.collectors import Collector, free_port
from tests.support.otlp_payloads import query
from trainer.curve import Curve, curve
from trainer.faults import parse

WINDOW = 48  # the live pass's steps per run (4 x the straggler window)
H100 = Path(__file__).resolve().parents[1] / "tests" / "data" / "h100_gpt2_first_attempts.csv"
FIRST = anomalies.Settings().warmup + anomalies.Settings().baseline  # the first step a spike can be judged at
SIM_RANKS, SIM_NOISE = 8, (0.5, 1.0, 2.0, 4.0)
INJECTED = (("loss x2", 2.0), ("loss x5", 5.0), ("loss x50", 50.0), ("NaN", np.nan))


def rollbacks(curve: pd.DataFrame, last: int | None = None) -> dict[int, int]:
    """step_start -> the newest step of the pass that first rolls it back, judging after every step."""
    steps = curve.assign(run_id="bench", non_finite=~np.isfinite(curve[["loss", "grad_norm"]]).all(axis=1))
    found: dict[int, int] = {}
    for newest in range(int(steps["step"].min()), int(steps["step"].max() if last is None else last) + 1):
        window = steps[(steps["step"] <= newest) & (steps["step"] > newest - WINDOW)]
        for finding in anomalies.analyze(window):
            if finding.kind in ROLLBACK_ON:
                found.setdefault(finding.step_start, newest)
    return found


def cpu_curves(steps: int, seeds: int, directory: Path) -> dict[str, pd.DataFrame]:
    """Clean 1-rank runs of the reference trainer, through a collector that rolls nothing back."""
    runs = []
    with open(directory / "collector.log", "w") as log:
        collector = Collector(
            directory / "curves.duckdb",
            free_port(),
            "bench-token-0123456789",
            extra_args=("--no-auto-rollback",),
            log=log,
        ).start()
        try:
            for model in ("tiny", "small"):
                for lr in (1e-3, 3e-3, 1e-2):
                    for seed in range(seeds):
                        runs.append(f"{model}-lr{lr:g}-seed{seed}")
                        status = train(
                            nproc=1,
                            steps=steps if model == "tiny" else steps // 2,
                            run_id=runs[-1],
                            model=model,
                            collector=collector.url,
                            token=collector.token,
                            store=collector.db,
                            device="cpu",
                            trainer_args=["--seed", str(seed), "--lr", str(lr), "--log-every", "1000"],
                        )
                        assert status == 0, f"{runs[-1]}: exit {status}"
        finally:
            collector.stop()
    return {
        f"CPU {run}": pd.DataFrame(
            query(collector.db, "SELECT step, loss, grad_norm FROM steps WHERE run_id = ? ORDER BY step", [run]),
            columns=["step", "loss", "grad_norm"],
        ).assign(rank=0)
        for run in runs
    }


def simulated(seed: int, noise: float, steps: int, faults: tuple[str, ...] = ()) -> pd.DataFrame:
    """The fleet simulator's curve (rank, step, loss, grad_norm) at `noise` times the H100's noise."""
    draws = curve(Curve().scaled(noise), SIM_RANKS, [parse(spec) for spec in faults], seed)
    rows = [
        (rank, step, loss, grad)
        for step, (losses, grad) in zip(range(steps), draws)
        for rank, loss in enumerate(losses)
    ]
    return pd.DataFrame(rows, columns=["rank", "step", "loss", "grad_norm"])


def spoiled(curve: pd.DataFrame, at: int, bad: float) -> pd.DataFrame:
    """`curve` with step `at`'s loss and gradient norm times `bad` (NaN: made NaN), as the trainer's
    `spike` and `nan` faults leave them."""
    hit = curve.copy()
    row = hit["step"] == at
    hit.loc[row, ["loss", "grad_norm"]] = hit.loc[row, ["loss", "grad_norm"]] * bad
    return hit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of each tiny CPU run (small: half)")
    parser.add_argument("--seeds", type=int, default=2, help="CPU runs per model and learning rate (0: none)")
    parser.add_argument("--sim-steps", type=int, default=1000, help="steps of each simulated curve")
    parser.add_argument("--sim-seeds", type=int, default=3, help="simulated curves per noise level")
    args = parser.parse_args()
    h100 = pd.read_csv(H100).assign(rank=0)
    curves = {"H100 GPT-2 (steps 0-149)": h100[h100["step"] < 150]}
    if args.seeds:
        with tempfile.TemporaryDirectory() as directory:
            curves |= cpu_curves(args.steps, args.seeds, Path(directory))
    sims = {
        f"simulator, noise x{noise:g}, seed {seed}": (seed, noise)
        for noise in SIM_NOISE
        for seed in range(args.sim_seeds)
    }
    curves |= {name: simulated(seed, noise, args.sim_steps) for name, (seed, noise) in sims.items()}

    console = Console()
    table = Table("clean curve", "steps", "false rollbacks", "per 10,000 steps")
    totals: dict[str, list[int]] = {}
    for name, frame in curves.items():
        steps, false = frame["step"].nunique(), len(rollbacks(frame))
        table.add_row(name, str(steps), str(false), f"{1e4 * false / steps:.0f}")
        for group in ("all", "simulator" if name in sims else "recorded and trainer"):
            totals[group] = [a + b for a, b in zip(totals.get(group, [0, 0]), (steps, false))]
    for group, (steps, false) in totals.items():
        table.add_row(group, str(steps), str(false), f"{1e4 * false / steps:.1f}")
    console.print(table)

    table = Table("injected at one step", "curves", "cases", "rolled back", "steps to rollback (median, max)")
    for label, bad in INJECTED:
        for source in ("recorded and trainer", "simulator"):
            delays, cases = [], 0
            for name, clean in curves.items():
                if (name in sims) != (source == "simulator"):
                    continue
                for at in range(FIRST, int(clean["step"].max()) - 5, 100 if name in sims else 20):
                    if name in sims:  # the simulator's own fault, drawn afresh up to 5 steps past it
                        spec = f"nan:at={at}" if np.isnan(bad) else f"spike:at={at},scale={bad:g}"
                        hit = simulated(*sims[name], at + 6, (spec,))
                    else:
                        hit = spoiled(clean, at, bad)
                    cases += 1
                    found = rollbacks(hit[hit["step"] > at - WINDOW], last=at + 5)
                    if at in found:
                        delays.append(found[at] - at)
            table.add_row(
                label,
                source,
                str(cases),
                f"{len(delays) / cases:.0%}",
                f"{np.median(delays):.0f}, {max(delays)}" if delays else "-",
            )
    console.print(table)


if __name__ == "__main__":
    main()
