"""Memory tiers: what the agent records of swaps, against the kernel and the disk, and what the tiers
analyzer concludes, on real offloaded runs of the reference trainer (gloo on this machine's CPU).

- `io`: an offloaded AdamW (4 groups of 33.5 MB of moments, on disk) steps 10 times in this process under
  a live agent: the bytes its transfer spans record against what /proc/self/io says the process read and
  wrote, and the bandwidth of its reads and writes against the disk's probe (median of 5 probes taken between the steps,
  under the same load).
- `whatif`: a serial and an overlapped run of the same job (2 ranks, `tiny`), on this disk and on a disk
  slowed to 50 MB/s on both ranks: the overlapped step time predicted from the serial run (the tiers
  analyzer's `whatif`: the longest of the rest of the step, the transfers and the host optimizer) against
  the one the overlapped run measured (medians over steps 5 on, the slowest rank each step).
- `detection`: `--runs` runs (50 steps) with `slow-disk` on a seeded rank (20-150 MB/s, from a seeded step
  10-25) and as many healthy ones, through a live collector; a detection is a `slow_disk` finding naming
  that rank alone, drawn by the time 20 steps after the fault had ended (its latency: the newest step
  ended when the finding was written, less the fault's), a false one any `slow_disk` finding of a
  healthy run.
- `overhead`: the agent's cost of recording 10 transfers and one host work in a step (a live session),
  against a step without; and of one reading of the process's and host's I/O and memory (rankwatch/agent/host.py,
  read once a second, the host's disks included).
- `host`: the host optimizer's step of `optimizer=host` (a 30M-parameter model in 8 groups, as one rank of
  `rankwatch train` starts: one intra-op thread), serial and overlapped, in this process, alternated `--rounds`
  times, with AdamW on one intra-op thread and on all of this machine's cores: ms per step (the median of
  `--steps` after one), the process's CPU time and the minor page faults a step takes.

The last line is one JSON object. Usage: python bench/offload.py [--parts io,whatif,detection,overhead,host]
[--runs 20] [--steps 40] [--rounds 3]
"""

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOKEN = "bench-token-0123456789"


class Collector:
    """A collector on a store in `directory`, for the bench's runs."""

    def __init__(self, directory: Path, *args: str):
        from rankwatch.launch import wait_healthy

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.db, self.url = directory / "rankwatch.duckdb", f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "rankwatch", "collector", "--db", str(self.db), "--port", str(port)]
        self.process = subprocess.Popen([*command, "--token", TOKEN, *args], stdout=subprocess.DEVNULL)
        wait_healthy(self.url, self.process)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


def query(db: Path, sql: str, params=None) -> list[tuple]:
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(sql, params or []).fetchall()


def _io() -> dict[str, int]:
    lines = Path("/proc/self/io").read_text().splitlines()
    return {k: int(v) for k, v in (line.split(": ") for line in lines)}


def io(directory: Path) -> dict:
    import torch

    from rankwatch import agent
    from rankwatch.agent import semconv as sc
    from trainer.offload import OffloadedAdamW, Spec, probe

    swap = directory / "swap"
    collector = Collector(directory)
    probes, kernel = [], {"read_bytes": 0, "write_bytes": 0}

    def counted(work):  # the process's storage I/O over `work` alone (the probes between are not the swaps')
        before = _io()
        out = work()
        after = _io()
        for k in kernel:
            kernel[k] += after[k] - before[k]
        return out

    try:
        agent.init(run_id="offload-io", collector=collector.url, token=TOKEN, rank=0, world_size=1)
        layers = [torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)]
        optimizer = counted(
            lambda: OffloadedAdamW([list(m.parameters()) for m in layers], Spec("disk"), swap, 1e-3, 0.1)
        )
        for step in range(10):
            if step % 2 == 0:  # the disk probed under the same load as the swaps (the collector, the exporter)
                probes.append(probe(directory / "probe"))
            with agent.step(step):
                for m in layers:
                    m.weight.grad = torch.randn_like(m.weight)
                counted(optimizer.step)
        counted(optimizer.close)
        agent.shutdown()
    finally:
        collector.stop()
    rows = query(
        collector.db,
        f"""SELECT name, sum(CAST(attrs->>{sc.json_path(sc.TRANSFER_BYTES)} AS BIGINT)),
                   median(CAST(attrs->>{sc.json_path(sc.TRANSFER_BYTES)} AS BIGINT) / duration_s)
            FROM ops WHERE kind = 'transfer' GROUP BY name""",
    )
    recorded = {name: (int(total), float(bw)) for name, total, bw in rows}
    out: dict = {"probes": probes}
    for way, direction, probed in (("read", "disk->host", 0), ("write", "host->disk", 1)):
        (total, bw), by_kernel = recorded[direction], kernel[f"{way}_bytes"]
        probe_bps = statistics.median(p[probed] for p in probes)
        out |= {
            f"{way}_bytes_recorded": total,
            f"{way}_bytes_kernel": by_kernel,
            f"{way}_ratio": total / by_kernel,
            f"{way}_bps": bw,
            f"probe_{way}_bps": probe_bps,
            f"{way}_of_probe": bw / probe_bps,
        }
    return out


def job(collector: Collector, run: str, steps: int, schedule: str, faults=(), seed: int = 1234) -> int:
    from rankwatch.launch import train

    return train(
        nproc=2,
        steps=steps,
        run_id=run,
        faults=list(faults),
        collector=collector.url,
        token=TOKEN,
        store=collector.db,
        trainer_args=["--offload", "optimizer=disk", "--offload-schedule", schedule, "--seed", str(seed)],
    )


def tier_steps(db: Path, run: str, first: int = 5):
    import duckdb
    import pandas as pd

    from collector.analysis import engine

    with duckdb.connect(str(db), read_only=True) as con:
        frame: pd.DataFrame = con.execute(engine._TIER_STEPS, {"run": run, "after": first - 1, "upto": 10**9}).df()
    return frame


def whatif(directory: Path, steps: int) -> dict:
    from collector.analysis.analyzers.tiers import whatif as predict

    collector = Collector(directory)
    out = {}
    try:
        for faults in ((), ("slow-disk:rank=0,mbps=50", "slow-disk:rank=1,mbps=50")):
            for schedule in ("serial", "overlap"):
                run = f"whatif-{schedule}-{'slow' if faults else 'disk'}"
                assert job(collector, run, steps, schedule, faults) == 0, run
    finally:
        collector.stop()
    for disk in ("disk", "slow"):
        serial, overlap = (
            tier_steps(collector.db, f"whatif-serial-{disk}"),
            tier_steps(collector.db, f"whatif-overlap-{disk}"),
        )
        predicted, measured = predict(serial), predict(overlap)
        out[disk] = {
            "serial_measured_s": predicted["measured_s"],
            "serial_predicted_s": predicted["serial_s"],
            "overlap_predicted_s": predicted["overlap_s"],
            "overlap_measured_s": measured["measured_s"],
            "error": predicted["overlap_s"] / measured["measured_s"] - 1,
            "parts": {k: predicted[k] for k in ("rest_s", "transfer_s", "host_optimizer_s")},
        }
    return out


def detection(directory: Path, runs: int, steps: int) -> dict:
    collector = Collector(directory, "--analyze-every", "0.5")
    cases = []
    try:
        for seed in range(runs):
            rng = random.Random(seed)
            rank, mbps, start = rng.randrange(2), rng.randint(20, 150), rng.randint(10, 25)
            run = f"detect-{seed}"
            fault = f"slow-disk:rank={rank},mbps={mbps},from={start}"
            assert job(collector, run, steps, "serial", [fault], seed=seed) == 0, run
            cases.append((run, rank, start, fault))
        for seed in range(runs):
            assert job(collector, f"healthy-{seed}", steps, "serial", seed=seed) == 0
    finally:
        collector.stop()
    # when a finding was first drawn, in steps: the newest step of its run that had ended by then
    rows = query(
        collector.db,
        """SELECT f.run_id, f.ranks, f.step_start,
                  (SELECT max(step) FROM steps s
                   WHERE s.run_id = f.run_id AND epoch_ns(s.end_ts) <= epoch_ns(f.created_at)) AS seen_at
           FROM findings f WHERE analyzer = 'tiers' AND kind = 'slow_disk'""",
    )
    found: dict[str, list] = {}
    for run, ranks, onset, seen_at in rows:
        found.setdefault(run, []).append((list(ranks), onset, seen_at))
    detected, missed, latency = 0, [], []
    for run, rank, start, fault in cases:
        mine = found.get(run, [])
        named = [seen for r, _, seen in mine if r == [rank]]
        if named and all(r == [rank] for r, _, _ in mine) and min(named) - start <= 20:
            detected += 1
            latency.append(min(named) - start)
        else:
            missed.append({"fault": fault, "found": mine})
    onsets = [onset - start for run, rank, start, _ in cases for r, onset, _ in found.get(run, []) if r == [rank]]
    false = [run for run in found if run.startswith("healthy-")]
    return {
        "runs": runs,
        "detected": detected,
        "latency_steps": {"median": statistics.median(latency), "max": max(latency)} if latency else None,
        "onset_error_steps": {"min": min(onsets), "max": max(onsets)} if onsets else None,
        "missed": missed,
        "false_runs": len(false),
        "false": false,
    }


def overhead(directory: Path) -> dict:
    from rankwatch.agent import semconv as sc
    from rankwatch.agent.host import HostState
    from rankwatch.agent.session import Session

    collector = Collector(directory)
    try:
        session = Session("offload-overhead", 0, 1, collector.url, TOKEN)
        per = {}
        for with_copies in (False, True, False, True):
            started = time.perf_counter()
            for step in range(2000):
                with session.step(step), session.phase("forward"):
                    if with_copies:
                        for _ in range(10):
                            with session.transfer(sc.TIER_DISK, sc.TIER_HOST, 1 << 20, "optimizer_state"):
                                pass
                        with session.host_work("optimizer"):
                            pass
            per.setdefault(with_copies, []).append((time.perf_counter() - started) / 2000)
        session.shutdown()
    finally:
        collector.stop()
    base, copies = min(per[False]), min(per[True])
    host = HostState(every_s=0.0, host_wide=True)  # every call reads: the cost of one reading, each second
    started = time.perf_counter()
    for _ in range(500):
        host.read()
    return {
        "step_us": base * 1e6,
        "step_with_copies_us": copies * 1e6,
        "added_us": (copies - base) * 1e6,
        "host_reading_us": (time.perf_counter() - started) / 500 * 1e6,
    }


HOST_PARAMS, HOST_GROUPS = 30_000_000, 8  # the host step's model: its parameters, in groups of equal size


def host(directory: Path, steps: int, rounds: int) -> dict:
    import resource

    import torch

    from trainer.offload import OffloadedAdamW, Spec

    torch.set_num_threads(1)  # as a rank of `rankwatch train` starts (OMP_NUM_THREADS=1)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(HOST_PARAMS // HOST_GROUPS // 1000, 1000, bias=False) for _ in range(HOST_GROUPS)]
    for m in layers:
        m.weight.grad = torch.randn_like(m.weight)
    cores = len(os.sched_getaffinity(0))
    runs = [(schedule, threads) for threads in sorted({1, cores}) for schedule in ("serial", "overlap")]
    took: dict[tuple, list[float]] = {run: [] for run in runs}
    cpu: dict[tuple, list[float]] = {run: [] for run in runs}
    faults: dict[tuple, list[int]] = {run: [] for run in runs}
    for _ in range(rounds):  # alternated: what else loads the machine slows each alike
        for schedule, threads in runs:
            optimizer = OffloadedAdamW(
                [list(m.parameters()) for m in layers], Spec("host", schedule), directory, 1e-3, 0.1, threads=threads
            )
            for step in range(steps + 1):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                started, started_cpu = time.perf_counter(), time.process_time()
                optimizer.step()
                if step:  # the first allocates what the next reuse
                    took[schedule, threads].append(time.perf_counter() - started)
                    cpu[schedule, threads].append(time.process_time() - started_cpu)
                    faults[schedule, threads].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            optimizer.close()
    return {
        "cores": cores,
        **{
            f"{schedule}, {threads} threads": {
                "step_ms": statistics.median(took[schedule, threads]) * 1e3,
                "cpu_ms_per_step": statistics.median(cpu[schedule, threads]) * 1e3,
                "minor_faults_per_step": statistics.median(faults[schedule, threads]),
            }
            for schedule, threads in runs
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="io,whatif,detection,overhead,host")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    result = {}
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:  # on the project's disk, not a tmpfs
        for part in args.parts.split(","):
            directory = Path(tmp) / part
            directory.mkdir()
            started = time.time()
            if part == "io":
                result[part] = io(directory)
            elif part == "whatif":
                result[part] = whatif(directory, args.steps)
            elif part == "detection":
                result[part] = detection(directory, args.runs, 50)
            elif part == "overhead":
                result[part] = overhead(directory)
            elif part == "host":
                result[part] = host(directory, args.steps, args.rounds)
            print(f"{part} ({time.time() - started:.0f} s): {json.dumps(result[part], default=str)}", flush=True)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
