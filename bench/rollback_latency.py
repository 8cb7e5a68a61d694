"""Rollback latency at any step rate: from the step whose loss spiked to the job training again,
on real torchrun jobs of the reference trainer through a real collector on loopback.

Two jobs of 1 rank, their loss spiking 50x once: the tiny model at its own pace (about 35 ms a
step on an idle CPU; the step time measured is printed) and the same paced to about 1 s a step
(a straggler fault: the rank sleeps on in each step). For each: the spiked step's end (its span,
in the store) to the collector's finding, to the rollback command, to the job resumed (the
command's `resumed_ns`, after the restore), and the restore's tier; the goal is 2 s plus the
restore, from the memory tier. The collector's timer is an hour away: only commits drive passes.

Usage: python bench/rollback_latency.py [--fast-steps 400] [--slow-steps 40]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent import semconv as sc
from rankwatch.launch import train
from tests.conftest import Collector, free_port
from tests.otlp_payloads import query


def job(directory: Path, steps: int, spike_at: int, pace: list[str]) -> dict:
    """One job's timeline, in seconds from the spiked step's end."""
    db = directory / "rw.duckdb"
    with open(directory / "collector.log", "w") as log:
        collector = Collector(db, free_port(), "bench", log=log, extra_args=("--analyze-every", "3600")).start()
        try:
            status = train(nproc=1, steps=steps, run_id="latency", faults=[f"spike:at={spike_at},scale=50", *pace],
                           collector=collector.url, token=collector.token, store=db,
                           trainer_args=["--ckpt-memory", "16", "--ckpt-dir", str(directory / "ckpt")])
        finally:
            collector.stop()
    assert status == 0, f"the job exited {status}"
    ((spiked_ns, step_s),) = query(db, f"""SELECT min(epoch_ns(end_ts)) FILTER (WHERE step = {spike_at}),
                                             median(duration_s) FROM steps WHERE run_id = 'latency'""")
    ((found,),) = query(db, "SELECT min(epoch_ns(created_at)) FROM findings WHERE run_id = 'latency' "
                            "AND kind = 'loss_spike'")
    rows = query(db, "SELECT epoch_ns(created_at), result FROM commands WHERE run_id = 'latency' AND kind = 'rollback' "
                     "ORDER BY id")
    tiers = query(db, f"""SELECT attrs->>{sc.json_path(sc.CKPT_TIER)} FROM events WHERE run_id = 'latency'
                          AND event = 'checkpoint_restored' ORDER BY ts""")
    commanded, result = rows[0][0], json.loads(rows[0][1])
    return {"step_s": step_s, "found": (found - spiked_ns) / 1e9, "commanded": (commanded - spiked_ns) / 1e9,
            "resumed": (result["resumed_ns"] - spiked_ns) / 1e9, "rollbacks": len(rows),
            "tier": tiers[-1][0] if tiers else "-", "restored_step": result.get("restored_step")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast-steps", type=int, default=400)
    parser.add_argument("--slow-steps", type=int, default=40)
    args = parser.parse_args()
    table = Table("job", "median step", "spike → finding", "→ rollback command", "→ job resumed", "restore tier",
                  "rollbacks", title="rollback latency from the spiked step's end (goal: ≤ 2 s plus the restore)")
    cases = {"own pace": (args.fast_steps, args.fast_steps // 2, []),
             "paced to ~1 s a step": (args.slow_steps, args.slow_steps // 2, ["straggler:rank=0,slowdown=35,from=0"])}
    for name, (steps, spike_at, pace) in cases.items():
        with tempfile.TemporaryDirectory() as directory:
            t = job(Path(directory), steps, spike_at, pace)
        table.add_row(name, f"{t['step_s'] * 1e3:.0f} ms", f"{t['found']:.2f} s", f"{t['commanded']:.2f} s",
                      f"{t['resumed']:.2f} s", t["tier"], str(t["rollbacks"]))
    Console().print(table)


if __name__ == "__main__":
    main()
