"""Rollback latency at any step rate: from the step whose loss spiked to the job training again,
on real torchrun jobs of the reference trainer through a real collector on loopback.

Two jobs of 1 rank, their loss spiking 50x once: the tiny model at its own pace (batch 4: about
35 ms a step on an idle CPU) and the same paced to about 1 s a step (a pause of `--pause` seconds
in each step: a hang fault of that length at every step, each firing once, so the steps trained
again after the rollback run at their own pace); the median step time measured is printed. For each, the timeline from
the spiked step's end, as the store has it: the traces export that brought it committed (the last
one committed before the finding), the collector's finding, the rollback command, the job's look
that took it (the end of the step before its `apply_step`; the fetch itself is not stored), the
restore done (the `checkpoint_restored` event) and the job resumed (the command's `resumed_ns`),
and the restore's tier. The goal is 2 s plus the restore, from the memory tier. The collector's
timer is an hour away: only commits drive passes.

Usage: python bench/rollback_latency.py [--fast-steps 400] [--slow-steps 40] [--pause 0.95]
"""

import argparse
import json
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rankwatch.agent import semconv as sc
from rankwatch.launch import train
from tests.support.collectors import Collector, free_port
from tests.support.otlp_payloads import query

RUN = "latency"
# the timeline's marks, in order, each as seconds from the spiked step's end
MARKS = ("committed", "found", "commanded", "looked", "restored", "resumed")


def job(directory: Path, steps: int, spike_at: int, pace: list[str]) -> dict:
    """One job's timeline, in seconds from the spiked step's end."""
    db = directory / "rw.duckdb"
    with open(directory / "collector.log", "w") as log:
        collector = Collector(
            db, free_port(), "bench-token-0123456789", log=log, extra_args=("--analyze-every", "3600")
        ).start()
        try:
            status = train(
                nproc=1,
                steps=steps,
                run_id=RUN,
                faults=[f"spike:at={spike_at},scale=50", *pace],
                collector=collector.url,
                token=collector.token,
                store=db,
                trainer_args=["--batch", "4", "--ckpt-memory", "16", "--ckpt-dir", str(directory / "ckpt")],
            )
        finally:
            collector.stop()
    assert status == 0, f"the job exited {status}"
    ((spiked, step_s),) = query(
        db,
        f"""SELECT min(epoch_ns(end_ts)) FILTER (WHERE step = {spike_at}),
                                         median(duration_s) FROM steps WHERE run_id = '{RUN}'""",
    )
    ((found,),) = query(
        db, f"SELECT min(epoch_ns(created_at)) FROM findings WHERE run_id = '{RUN}' AND kind = 'loss_spike'"
    )
    rows = query(
        db,
        f"SELECT epoch_ns(created_at), apply_step, result FROM commands WHERE run_id = '{RUN}' "
        "AND kind = 'rollback' ORDER BY id",
    )
    if found is None or not rows or rows[0][2] is None:  # a row of dashes says so
        return {"step_s": step_s, "rollbacks": len(rows), "tier": "-", **dict.fromkeys(MARKS)}
    ((committed,),) = query(
        db,
        "SELECT max(epoch_ns(received_at)) FROM exports WHERE signal = 'traces' AND epoch_ns(received_at) <= ?",
        [found],
    )
    commanded, apply_step, result = rows[0][0], rows[0][1], json.loads(rows[0][2])
    ((looked,),) = query(
        db,
        f"SELECT min(epoch_ns(end_ts)) FROM steps WHERE run_id = '{RUN}' AND step = ? AND epoch_ns(end_ts) >= ?",
        [apply_step - 1, spiked],
    )
    restores = query(
        db,
        f"""SELECT epoch_ns(ts), attrs->>{sc.json_path(sc.CKPT_TIER)} FROM events
                             WHERE run_id = '{RUN}' AND event = 'checkpoint_restored' AND epoch_ns(ts) > ?
                             ORDER BY ts""",
        [spiked],
    )
    restored, tier = restores[0] if restores else (None, "-")
    marks = dict(zip(MARKS, (committed, found, commanded, looked, restored, result["resumed_ns"])))
    return {
        "step_s": step_s,
        "rollbacks": len(rows),
        "tier": tier,
        "restored_step": result.get("restored_step"),
        **{name: None if t is None else (t - spiked) / 1e9 for name, t in marks.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast-steps", type=int, default=400)
    parser.add_argument("--slow-steps", type=int, default=40)
    parser.add_argument("--pause", type=float, default=0.95, help="seconds the slow job pauses in each step")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep each job's store and collector log in DIR")
    args = parser.parse_args()
    table = Table(
        "job",
        "median step",
        "→ committed",
        "→ finding",
        "→ command",
        "→ look",
        "→ restored",
        "→ job resumed",
        "tier",
        "rollbacks",
        title="rollback latency from the spiked step's end (goal: ≤ 2 s plus the restore, from memory)",
    )
    pauses = [f"hang:rank=0,at={step},seconds={args.pause:g}" for step in range(args.slow_steps)]
    cases = {
        "own pace": (args.fast_steps, args.fast_steps // 2, []),
        "paced to ~1 s a step": (args.slow_steps, args.slow_steps // 2, pauses),
    }
    for name, (steps, spike_at, pace) in cases.items():
        with nullcontext(tempfile.mkdtemp(dir=args.keep)) if args.keep else tempfile.TemporaryDirectory() as directory:
            t = job(Path(directory), steps, spike_at, pace)
        table.add_row(
            name,
            f"{t['step_s'] * 1e3:.0f} ms",
            *("-" if t[mark] is None else f"{t[mark]:.2f} s" for mark in MARKS),
            t["tier"],
            str(t["rollbacks"]),
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
