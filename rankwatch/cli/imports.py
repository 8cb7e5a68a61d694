"""`rankwatch import`: a trace recorded elsewhere (an op trace, PyTorch profiler traces, NCCL Flight Recorder
dumps) into a store file, as one run, its findings drawn."""

import argparse
import sys
from pathlib import Path
from typing import Any

from rankwatch.cli import checks, options
from rankwatch.cli.options import UsageError


def cmd_import(args: argparse.Namespace) -> None:
    from rich.progress import Progress

    from collector import private
    from collector.receive.imports import TraceError, store_run
    from collector.receive.imports.flight_recorder import FlightRecorderDumps
    from collector.receive.imports.kineto import KinetoTrace
    from collector.receive.imports.ops import OpTrace
    from collector.reports import postmortem
    from collector.store.db import StoreLocked, connect

    db, paths = checks.store(args), [Path(p) for p in args.path]
    kineto = args.format == "kineto"
    trace: KinetoTrace | FlightRecorderDumps | OpTrace
    run: dict[str, Any]
    try:
        if kineto:
            trace = KinetoTrace(*paths)
            # profiles are often taken on a sample of a job's ranks: the run is the ranks imported, the
            # others are not telemetry lost (a notice says how many the job had)
            run = {"step_columns": trace.step_columns, "trace_format": args.format}
        elif args.format == "flight-recorder":
            trace = FlightRecorderDumps(*paths)
            run = {"world_size": trace.world_size, "events": trace.events, "trace_format": args.format}
        elif len(paths) > 1:
            raise UsageError("an ops trace is one file (Parquet or CSV) holding every rank")
        else:
            trace, run = OpTrace(paths[0]), {}
        try:
            private.restrict(db)  # the store, as the collector's: owner-only
        except OSError as e:
            raise UsageError(f"cannot make the store's directory {db.parent}: {e.strerror or e}") from None
        with Progress(transient=True) as progress:
            task = progress.add_task(f"importing {', '.join(p.name for p in paths)}", total=trace.rows)

            def batches():
                for batch in trace.batches():
                    yield batch
                    progress.advance(task, batch.num_rows)

            counts = store_run(db, args.run, batches(), trace.placement_frame, **run)
        with connect(db) as con:  # no collector drew its story as it went: its findings are drawn now
            postmortem.record(con, postmortem.analyze_run(con, args.run))
    except (TraceError, StoreLocked) as e:
        raise UsageError(str(e)) from None
    for notice in getattr(trace, "notices", ()):
        print(f"rankwatch import: {notice}", file=sys.stderr)
    if isinstance(trace, KinetoTrace) and (trace.world_size or 0) > counts["ranks"]:
        print(
            f"rankwatch import: the traces hold {counts['ranks']} of the job's {trace.world_size} ranks "
            "(distributedInfo.world_size): the run is these ranks",
            file=sys.stderr,
        )
    dropped = f" ({trace.dropped} GPU ops outside any ProfilerStep dropped)" if isinstance(trace, KinetoTrace) else ""
    print(
        f"rankwatch import: run {args.run}: {counts['ops']} ops{dropped}, {counts['steps']} rank-steps of "
        f"{counts['ranks']} ranks -> {db}"
    )


def add_import(sub: options.Commands) -> None:
    p = sub.add_parser("import", help="a trace recorded elsewhere, into a store file (one run, all or nothing)")
    p.add_argument(
        "format",
        choices=("ops", "kineto", "flight-recorder"),
        help="ops: the generic op trace (Parquet or CSV); kineto: PyTorch profiler traces "
        "(.json or .json.gz, a file per rank: files, directories of them, or both); flight-recorder: "
        "PyTorch NCCL Flight Recorder dumps (<prefix><rank>, a file per rank: files, directories, or both)",
    )
    p.add_argument("path", nargs="+", help="one run's traces")
    p.add_argument("--run", required=True, help="run id to import under")
    options.db(p)
    p.set_defaults(func=cmd_import)
