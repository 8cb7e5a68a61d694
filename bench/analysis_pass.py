"""What one pass of the analysis engine costs, and how soon after its commit a step's finding exists.

1. Cost per pass (offline, a DuckDB store file, no collector): a run of `--ranks` ranks with a
   full history (the most any analyzer reads) and new steps since the last pass, judged by every
   analyzer of the registry and recorded, as the live collector's pass does: wall and CPU time for
   1 new step and for a full pass (RANK_STEPS rank-steps: 16 steps at 16,384 ranks), side by side
   with the same at 1,024 ranks (the ratio shows the cost grows with ranks x steps, and a pass is
   bounded by the rank-steps it takes). The pass before it judged the step before, as a live
   collector's does, and the engine kept the steps it read; beside it, in turns, the same pass
   with those dropped, reading its whole history from the store again (the engine before it kept any).
2. Commit to finding (a real collector on loopback, real OTLP from the agent's exporter): jobs of
   4 ranks at 10 and at 100 steps a second, their loss spiking every 60 steps; for each spike, the
   time from the acknowledgement of the export that carried it (its commit) to its finding in the
   store (the goal: 1 s), against the timer pass of before (every 5 s, the collector's default
   --analyze-every, here set to an hour so that only commits drive passes); and the CPU the collector
   (its server and writer processes) spent a second of the job. Each rank exports apart, as agents
   do, so most commits bring some ranks' steps alone.

Usage: python bench/analysis_pass.py [--ranks [16384 [65536 ...]]] [--spikes 5 (0: no commit latency)]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.analysis import findings
from collector.analysis.engine import RANK_STEPS, Engine
from collector.store.schema import DDL
from trainer import simulate
from trainer.faults import parse

HISTORY = 96  # steps before the new ones: what the straggler analyzer reads at most


def _store(path: Path, ranks: int, steps: int) -> duckdb.DuckDBPyConnection:
    """A store holding one run of `ranks` ranks x `steps` steps, one rank straggling."""
    pp = 8
    topology = simulate.Topology(dp=ranks // pp, pp=pp)
    frames = pd.concat(
        simulate.steps(
            topology,
            steps,
            [parse("straggler:rank=3,slowdown=1.2,from=40")],
            seed=0,
            start_ns=time.time_ns() - steps * 10**9,
        ),
        ignore_index=True,
    )
    con = duckdb.connect(str(path))
    con.execute(DDL)
    frames = frames.assign(
        run_id="bench",
        start_ts=pd.to_datetime(frames["start_ns"], unit="ns"),
        end_ts=pd.to_datetime(frames["end_ns"], unit="ns"),
        loss=3.0,
        grad_norm=1.0,
    )
    con.execute("""INSERT INTO steps BY NAME SELECT run_id, rank, step, start_ts, end_ts, duration_s, data_s,
                   compute_s, comm_wait_s, loss, grad_norm FROM frames""")
    con.register("placement", topology.placement().assign(run_id="bench", first_seen=pd.Timestamp.now(tz="UTC")))
    con.execute("INSERT INTO ranks BY NAME SELECT * FROM placement")
    con.execute("INSERT INTO runs VALUES ('bench', ?, now())", [ranks])
    return con


def _pass(con, engine: Engine, after: int, keep: bool = True) -> tuple[float, float, int]:
    """(wall s, CPU s, steps judged) of one pass starting after step `after`, as a live collector's:
    the pass before judged step `after` alone (and kept the steps it read, as the engine does;
    `keep=False`: dropped them, so the pass reads its whole history from the store, the baseline)."""
    engine.forget("bench")
    engine.judge(con, "bench", time.time_ns())  # the cursor made; then moved to before `after`
    engine.cursors["bench"].step = after - 1
    budget, engine.rank_steps = engine.rank_steps, 1  # the pass before: step `after` alone
    engine.judge(con, "bench", time.time_ns())
    engine.rank_steps = budget
    if not keep:
        engine.release("bench")
    wall, cpu = time.perf_counter(), time.process_time()
    judged = engine.judge(con, "bench", time.time_ns())
    findings.record_pass(con, "bench", judged.found, engine.reads, judged.last)
    return time.perf_counter() - wall, time.process_time() - cpu, judged.last - judged.first_new + 1


def pass_costs(ranks_list: list[int]) -> Table:
    table = Table(
        "ranks",
        "new steps",
        "wall, ms",
        "CPU, ms",
        "CPU per rank-step, µs",
        "vs 1,024 ranks (wall)",
        "reading its history again: wall, ms",
        "kept / read again (wall)",
        title="one pass of the engine (every analyzer, findings recorded)",
    )
    base: dict[int, float] = {}
    for ranks in ranks_list:
        full = max(RANK_STEPS // ranks, 1)
        with tempfile.TemporaryDirectory() as directory:
            con = _store(Path(directory) / "bench.duckdb", ranks, HISTORY + full + 1)
            engine = Engine()
            for new in (1, full):
                _pass(con, engine, HISTORY + full - new)  # warm
                runs, again = [], []
                for _ in range(3):  # the two side by side, in turns
                    runs.append(_pass(con, engine, HISTORY + full - new))
                    again.append(_pass(con, engine, HISTORY + full - new, keep=False)[0])
                wall, cpu, judged = (float(np.median([r[i] for r in runs])) for i in range(3))
                baseline = float(np.median(again))
                key = 1 if new == 1 else 0
                base.setdefault(key, wall)
                table.add_row(
                    f"{ranks:,}",
                    f"{int(judged)}",
                    f"{wall * 1e3:.0f}",
                    f"{cpu * 1e3:.0f}",
                    f"{cpu / (judged * ranks) * 1e6:.2f}",
                    f"{wall / base[key]:.1f}x",
                    f"{baseline * 1e3:.0f}",
                    f"{wall / baseline:.2f}x",
                )
            con.close()
    return table


def commit_latency(spikes: int) -> Table:
    """Commit to finding at 10 and 100 steps a second, through a real collector."""
    from tests.support.collectors import Collector, free_port
    from tests.support.engine_jobs import exporters, live_findings, send_steps
    from tests.support.proc_cpu import cpu_s
    from tests.support.waits import wait_until

    table = Table(
        "steps/s",
        "spikes",
        "commit → finding, s (median)",
        "max",
        "vs the 1 s goal",
        "timer pass of before (5 s): mean wait",
        "collector CPU a second of the job",
        title="a spike's finding after the commit that carried it",
    )
    for rate in (10, 100):
        with tempfile.TemporaryDirectory() as directory, open(Path(directory) / "collector.log", "w") as log:
            collector = Collector(
                Path(directory) / "rw.duckdb",
                free_port(),
                "bench-token-0123456789",
                log=log,
                extra_args=("--analyze-every", "3600"),
            ).start()
            try:
                pid = collector.process.pid
                processes = [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
                cpu_before, wall_before = sum(map(cpu_s, processes)), time.monotonic()
                run, step_s = f"latency-{rate}", 1 / rate
                sending = exporters(collector, run, 4)
                t0, latencies, batch = time.time_ns(), [], max(rate // 10, 1)  # an export every 0.1 s
                spike_steps = set(range(60, 60 * (spikes + 1), 60))
                for start in range(0, 60 * (spikes + 1), batch):
                    acked = send_steps(
                        sending,
                        range(start, start + batch),
                        t0,
                        step_s,
                        compute=lambda r, s: 0.6 * step_s,
                        loss=lambda s: 50.0 if s in spike_steps else 3.0,
                    )
                    if spike_steps & set(range(start, start + batch)):
                        seen = len(latencies) + 1
                        wait_until(
                            lambda: sum(f["kind"] == "loss_spike" for f in live_findings(collector, run)) >= seen,
                            "the spike was not found",
                            60,
                        )
                        latencies.append(time.monotonic() - acked)
                    time.sleep(max(0.0, t0 / 1e9 + (start + batch) * step_s - time.time()))
                cpu = (sum(map(cpu_s, processes)) - cpu_before) / (time.monotonic() - wall_before)
            finally:
                collector.stop()
        table.add_row(
            str(rate),
            str(len(latencies)),
            f"{np.median(latencies):.2f}",
            f"{max(latencies):.2f}",
            f"{np.median(latencies) / 1.0:.2f}x",
            "2.5 s",
            f"{cpu:.2f} s",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[16384], help="job sizes, beside 1,024 ranks")
    parser.add_argument("--spikes", type=int, default=5)
    args = parser.parse_args()
    console = Console()
    console.print(pass_costs([1024, *args.ranks]))
    if args.spikes:
        console.print(commit_latency(args.spikes))


if __name__ == "__main__":
    main()
