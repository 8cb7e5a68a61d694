"""Straggler attribution: is a slow rank's slowdown its hardware's, or does its cause lie outside the
GPU? Labelled on seeded simulated runs, and what it costs at 1,024 ranks.

The fleet simulator (trainer/simulate.py) plays data-parallel runs of `--ranks` ranks. Half the
judged runs have one rank thermally throttled (its SM clock held down, hotter, computing slower in
proportion); the other half one rank computing as much slower in software (a straggler: its GPU's state
untouched). The straggler analyzer finds the slow rank; NCPP's step-time model (fitted here on other
seeds' simulated runs: this measures the attribution's plumbing, not the model's accuracy on real
hardware, where the simulator's own formula would only be inverted) then says how much of its slowdown
the rank's state explains (collector/analysis/analyzers/predicted.py): "hardware" or "outside the
GPU". A run counts as labelled right when the analyzer named the faulty rank and the label matches.

Cost: the features and the prediction of one analysis pass's new rank-steps at `--cost-ranks` ranks
(one step each), and one explanation: the median of 5 calls after a first.

Usage: python bench/attribution.py [--runs 40] [--ranks 16] [--steps 40] [--epochs 40] [--cost-ranks 1024]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.analysis.analyzers import predicted, stragglers
from collector.predict import stepmodel, steptime
from collector.predict.stepmodel import Fitted
from trainer import simulate
from trainer.faults import parse

ONSET = 10
# as much slower as the thermal fault makes a rank (clock_max / thermal clock)
SLOWDOWN = simulate.GpuModel().clock_max_mhz / simulate.GpuModel().thermal_clock_mhz


def run(topology: simulate.Topology, steps: int, faults: list[str], seed: int):
    """One simulated run's rank-steps (with run_id) and their features."""
    rank_steps, samples, ranks = simulate.tables(topology, steps, [parse(f) for f in faults], seed)
    return rank_steps.assign(run_id=f"sim-{seed}"), steptime.features(rank_steps, samples, ranks), ranks


def training(topology: simulate.Topology, steps: int, epochs: int) -> Fitted:
    """NCPP fitted on simulated runs of other seeds: throttled, capped, slow in software and clean;
    trusted here (the figures say what it was fitted on, not what it is worth on hardware)."""
    kinds = [
        [f"thermal:rank=1,from={ONSET}"],
        [f"straggler:rank=2,slowdown={SLOWDOWN:.3f},from={ONSET}"],
        [f"power-cap:rank=3,watts=350,from={ONSET}"],
        [],
    ]
    made = [run(topology, steps, faults, 1000 + i) for i, faults in enumerate(kinds)]
    features = pd.concat([f.assign(**{stepmodel.RUN: s["run_id"]}) for s, f, _ in made], ignore_index=True)
    target = pd.concat([s for s, _, _ in made], ignore_index=True)["compute_s"].to_numpy()
    model = stepmodel.ncpp(epochs, seed=0).fit(features, target).model
    fitted = {"mape": 0.0, "p90": 0.0, "within5": 1.0, "r2_log": 1.0}
    return Fitted(model, {"ncpp": fitted, "median": {**fitted, "mape": 100.0}}, "median")


def label(topology, steps: int, fitted: Fitted, seed: int) -> tuple[bool, str, dict]:
    """One judged run: whether the faulty rank was named and labelled right, the label, the points of
    the slowdown each group explains."""
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(topology.ranks))
    hardware = seed % 2 == 0
    fault = (
        f"thermal:rank={rank},from={ONSET}"
        if hardware
        else f"straggler:rank={rank},slowdown={SLOWDOWN:.3f},from={ONSET}"
    )
    rank_steps, features, ranks = run(topology, steps, [fault], seed)
    found = [f for f in stragglers.analyze(rank_steps, ranks) if f.kind == "rank"]
    if not found or found[0].ranks != [rank]:
        return False, "not found", {}
    evidence = predicted.explain(found[0], rank_steps, features, fitted).evidence
    right = evidence["explained"]["cause"] == ("hardware" if hardware else "outside the GPU")
    return right, evidence["explained"]["cause"], evidence["explained_points"]


def cost(fitted: Fitted, ranks: int, repeats: int = 5) -> dict:
    """Seconds to draw the features of one step of `ranks` ranks, to predict them, and one explanation:
    the median of `repeats` (a collector does this every pass; the first call warms pandas up)."""
    topology = simulate.Topology(dp=ranks)
    rank_steps, samples, placement = simulate.tables(topology, 3, [parse("thermal:rank=7,from=0")], 7)
    last = rank_steps[rank_steps["step"] == rank_steps["step"].max()]
    mine = last["rank"].to_numpy() == 7
    timings = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        features = steptime.features(last, samples, placement)
        drawn = time.perf_counter()
        expected = predicted.predict(fitted, features)
        done = time.perf_counter()
        steptime.explain(fitted.model, features[mine], features[~mine], float(np.median(expected[mine])))
        timings.append((drawn - started, done - drawn, time.perf_counter() - done))
    features_s, predict_s, explain_s = np.median(timings[1:], axis=0)
    return {"features_s": float(features_s), "predict_s": float(predict_s), "explain_s": float(explain_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--cost-ranks", type=int, default=1024)
    args = parser.parse_args()
    topology = simulate.Topology(dp=args.ranks)
    fitted = training(topology, args.steps, args.epochs)
    results = [label(topology, args.steps, fitted, seed) for seed in range(args.runs)]
    right = sum(r for r, _, _ in results)
    for seed, (ok, cause, points) in enumerate(results):
        truth = "hardware" if seed % 2 == 0 else "outside the GPU"
        top = max(points, key=points.__getitem__) if points else "-"
        print(f"seed {seed:3d}: truth {truth:16s} labelled {cause:16s} {'ok' if ok else 'WRONG'}  top group {top}")
    timing = cost(fitted, args.cost_ranks)
    print(f"labelled right: {right} of {len(results)} ({right / len(results):.0%})")
    print(
        f"at {args.cost_ranks} ranks: features {timing['features_s'] * 1e3:.1f} ms, prediction "
        f"{timing['predict_s'] * 1e3:.1f} ms, one explanation {timing['explain_s'] * 1e3:.1f} ms (one step each)"
    )
    print(json.dumps({"runs": len(results), "right": right, "accuracy": right / len(results), **timing}))


if __name__ == "__main__":
    main()
