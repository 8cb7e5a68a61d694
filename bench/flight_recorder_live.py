"""What matching a hang's Flight Recorder entries across ranks costs the live analysis, at scale.

Each rank's answer holds 256 NCCL entries alternating the world group's all-reduces and its tensor-parallel
group's (groups of 8), pg_config listing both (the world's members as torch writes them: a JSON list in a string),
and one rank is missing from the world's newest all-reduce.

1. Through a store (`--store-ranks`, a DuckDB file, no collector): a stacks request whose answers come in 4
   waves; after each, the hang analyzer's read of them (engine.read_stacks as Frames.stacks calls it, the answers
   read before kept) is timed: each reads only its wave's answers. Then a pass with nothing new, and the matching
   (once: Recorded.verdict), whose verdict names the missing rank.
2. In memory (`--ranks`): the answers' Flight Recorders as the store hands them (JSON text) read in 8 waves
   (recorded.read, each wave added to those before), then matched: CPU seconds, and the memory the read entries
   hold (the process's peak, less before).

Usage: python bench/flight_recorder_live.py [--ranks 16384 ...] [--store-ranks 2048 ...]
"""

import argparse
import contextlib
import json
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.analysis import recorded
from collector.analysis.engine import read_stacks
from collector.control import commands
from collector.store.schema import DDL
from rankwatch.agent import semconv as sc

ENTRIES, TP, MISSING, WAVES = 256, 8, 5, 4


def _entry(record_id: int, seq: int, group: str, desc: str, state: str) -> dict:
    """An all-reduce of 4 MiB as torch's NCCL Flight Recorder dumps it in JSON."""
    return {
        "record_id": record_id,
        "pg_id": int(group),
        "process_group": [group, desc],
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": record_id,
        "profiling_name": "nccl:all_reduce",
        "time_created_ns": 1_724_779_239_000_000_000 + record_id,
        "input_sizes": [[1024, 1024]],
        "input_dtypes": ["Float"],
        "output_sizes": [[1024, 1024]],
        "output_dtypes": ["Float"],
        "state": state,
        "time_discovered_started_ns": 0,
        "time_discovered_completed_ns": 0,
        "retired": state == "completed",
        "timeout_ms": 600000,
        "is_p2p": False,
    }


def _recorder(rank: int, world: str) -> str:
    """A rank's Flight Recorder as JSON text, its newest 256 entries (its ring went round)."""
    tp, first = str(1 + rank // TP), rank // TP * TP
    entries = [
        _entry(1000 + i, 500 + i // 2, *(("0", "default_pg") if i % 2 == 0 else (tp, "tp")), "completed")
        for i in range(ENTRIES - 1)
    ]
    if rank != MISSING:  # the world's next all-reduce, which every rank but one entered
        entries.append(_entry(1000 + ENTRIES, 500 + ENTRIES // 2, "0", "default_pg", "started"))
    config = {
        "0": {"name": "0", "desc": "default_pg", "ranks": world},
        tp: {"name": tp, "desc": "tp", "ranks": json.dumps(list(range(first, first + TP)))},
    }
    return json.dumps({"backend": "nccl", "version": "2.10", "pg_config": config, "pg_status": {}, "entries": entries})


def _body(rank: int, world: str) -> str:
    """A rank's answer: a main thread, and its Flight Recorder."""
    main = {"name": "MainThread", "ident": 1, "main": True, "frames": [{"file": "/job/train.py", "line": 120}]}
    return f'{{"threads": [{json.dumps(main)}], "flight_recorder": {_recorder(rank, world)}}}'


def _answer(con: duckdb.DuckDBPyConnection, request: int, ranks: range, world: str) -> None:
    attrs = json.dumps({sc.STACKS_REQUEST: request})
    now = pd.Timestamp.now("UTC").tz_localize(None)
    answers = pd.DataFrame(
        {
            "run_id": "bench",
            "rank": list(ranks),
            "ts": now,
            "event": sc.EVENT_RANK_STACKS,
            "body": [_body(r, world) for r in ranks],
            "attrs": attrs,
        }
    )
    con.register("answers", answers)
    con.execute("INSERT INTO events BY NAME SELECT * FROM answers")
    con.unregister("answers")


def through_store(ranks: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        con = duckdb.connect(str(Path(directory) / "bench.duckdb"))
        con.execute(DDL)
        con.execute("INSERT INTO runs VALUES ('bench', ?, now())", [ranks])
        request = commands.create(con, "bench", "stacks", {"ranks": None}, "analysis")["id"]
        world = json.dumps(list(range(ranks)))
        known: dict = {}
        waves = []
        for wave in range(WAVES):
            _answer(con, request, range(wave * ranks // WAVES, (wave + 1) * ranks // WAVES), world)
            with _timed() as took:
                answers = read_stacks(con, "bench", every_rank=True, known=known, recorded=True)
            waves.append(took)
        assert answers is not None and answers.recorded is not None
        with _timed() as nothing_new:
            again = read_stacks(con, "bench", every_rank=True, known=known, recorded=True)
        assert again is not None and again.recorded is answers.recorded
        with _timed() as matched:
            verdict = answers.recorded.verdict
        assert verdict is not None
        con.close()
    return {
        "through": "store",
        "ranks": ranks,
        "entries": len(answers.recorded.entries),
        "waves_s": [round(w["wall"], 2) for w in waves],
        "read_s": round(sum(w["wall"] for w in waves), 1),
        "read_cpu_s": round(sum(w["cpu"] for w in waves), 1),
        "nothing_new_s": round(nothing_new["wall"], 3),
        "match_s": round(matched["wall"], 1),
        "match_cpu_s": round(matched["cpu"], 1),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "verdict": verdict["verdicts"][0]["summary"],
    }


def in_memory(ranks: int, waves: int = 8) -> dict:
    world = json.dumps(list(range(ranks)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    read: recorded.Recorded | None = None
    read_cpu = 0.0
    for wave in range(waves):
        answers = [(r, _recorder(r, world)) for r in range(wave * ranks // waves, (wave + 1) * ranks // waves)]
        with _timed() as took:
            read = recorded.read("bench", answers, read)
        read_cpu += took["cpu"]
        del answers
    assert read is not None
    held_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) // 1024
    with _timed() as matched:
        verdict = read.verdict
    assert verdict is not None
    return {
        "through": "memory",
        "ranks": ranks,
        "entries": len(read.entries),
        "read_cpu_s": round(read_cpu, 1),
        "match_cpu_s": round(matched["cpu"], 1),
        "peak_rise_mib": held_mib,
        "verdict": verdict["verdicts"][0]["summary"],
    }


@contextlib.contextmanager
def _timed() -> Iterator[dict]:
    """The wall and CPU seconds (this process's, every thread's: DuckDB's too) of the block, once it ended."""
    took: dict = {}
    wall, cpu = time.perf_counter(), time.process_time()
    yield took
    took.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store-ranks", type=int, nargs="*", default=[2048])
    parser.add_argument("--ranks", type=int, nargs="*", default=[16384])
    args = parser.parse_args()
    for ranks in args.ranks:  # first: the peak memory it rose to is its own
        print(json.dumps(in_memory(ranks)), flush=True)
    for ranks in args.store_ranks:
        print(json.dumps(through_store(ranks)), flush=True)


if __name__ == "__main__":
    main()
