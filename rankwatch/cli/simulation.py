"""`rankwatch simulate`: a fleet of simulated ranks (trainer/simulate.py), sent to a collector or written as an
op trace."""

import argparse
import sys
import time
from pathlib import Path

from rankwatch.agent.config import HANG_FLOOR_S
from rankwatch.cli import checks, options
from rankwatch.cli.launching import check_targets
from rankwatch.cli.options import NON_NEGATIVE, POSITIVE, QUANTITY_OR_ZERO, UsageError

HANG_FOR_S = 2 * HANG_FLOOR_S  # how long simulated stuck ranks keep sending heartbeats: past the hang floor


def cmd_simulate(args: argparse.Namespace) -> None:
    from rich.progress import track

    from trainer import simulate
    from trainer.faults import parse

    pp, tp = args.pp, args.tp
    dp = args.dp or args.ranks // (pp * tp)
    if dp * pp * tp != args.ranks:
        raise UsageError(f"--ranks {args.ranks} is not dp x pp x tp = {dp} x {pp} x {tp}")
    if (args.collector is None) == (args.out is None):
        raise UsageError("give one of --collector URL or --out FILE.parquet")
    fits_in_memory(args.ranks, to_collector=args.out is None)
    if args.collector:
        from rankwatch.agent import config

        store, exporter_url = checks.store(args), config.collector_urls(args.collector)
        token = checks.sent_token(args)  # a bad token: one line now
        # a refused one too, before minutes of refusals
        checks.collector_takes(exporter_url, token, unreachable_ok=True)
    topology = simulate.Topology(dp, pp, tp)
    try:
        faults = [parse(spec, simulate.SIMULATOR_KINDS) for spec in args.inject]
    except ValueError as e:
        raise UsageError(
            str(e)
            .replace("the trainer injects", "the simulator injects")
            .replace("for `rankwatch simulate`", "for `rankwatch train`")
        ) from None
    check_targets(faults, args.ranks, args.steps, pp, -(-args.ranks // topology.ranks_per_host))
    for f in faults:
        if f.kind == "hang" and not 1 <= f.get("at") < args.steps:
            raise UsageError(
                f"{f.spec!r}: at must be within 1..{args.steps - 1} (a step must finish before "
                "the hang, and the hang fall within the run)"
            )
        if f.kind == "hang" and f.get("seconds") is not None:
            raise UsageError(
                f"{f.spec!r}: a simulated hang lasts until the simulator stops (--hang-for); "
                "seconds= is for `rankwatch train`"
            )
    limits = _power_caps(args.power_caps, args.ranks) if args.power_caps else None
    hang = simulate.first_hang(faults)
    if hang and args.collector:
        print(
            f"rankwatch simulate: ranks {hang[1]} hang at step {hang[0]}; heartbeats go on for "
            f"{args.hang_for:g} s after it, then the simulator stops"
        )
    frames = track(
        simulate.steps(topology, args.steps, faults, seed=args.seed, power_limits=limits),
        total=args.steps,
        description=f"simulating {args.ranks} ranks",
        transient=True,
    )
    if args.out:
        rows = simulate.to_parquet(Path(args.out), topology, frames, faults)
        print(
            f"rankwatch simulate: {rows} ops of {args.ranks} ranks x {args.steps} steps -> {args.out} "
            f"(ground truth: {args.out}.truth.json)"
        )
        return
    from rankwatch.agent import semconv as sc
    from rankwatch.agent.config import TokenRefused
    from rankwatch.agent.export import Exporter
    from rankwatch.launch import TELEMETRY_LOST, announce, report_loss

    run_id = args.run or time.strftime("sim-%Y%m%d-%H%M%S")
    announce("simulate", run_id, exporter_url, store)
    # paced: the simulator waits for the collector rather than dropping what it cannot take yet
    exporter = Exporter(exporter_url, token, {sc.RUN_ID: run_id}, paced=True, senders=simulate.SENDERS)
    try:
        rank_steps, spans = simulate.to_collector(
            exporter, run_id, topology, frames, faults, args.hang_for, seed=args.seed
        )
        exporter.flush()
    except TokenRefused as e:  # the collector's token changed under the run: stop now, not after every step
        exporter.shutdown()
        raise UsageError(f"{e}: the simulation stopped") from None
    exporter.shutdown()
    lost, samples = exporter.undelivered()
    if lost or samples:
        report_loss("simulate", run_id, exporter_url, lost.rank_steps, lost.spans, lost.records, samples)
        sys.exit(TELEMETRY_LOST)
    print(
        f"rankwatch simulate: run {run_id}, {rank_steps} rank-steps ({spans} spans: steps and their collectives) "
        f"of {args.ranks} ranks sent to {exporter_url}"
    )


def fits_in_memory(ranks: int, to_collector: bool) -> None:
    """A fleet too large for this machine's memory is one line before the simulator starts, not
    a MemoryError after minutes of work (trainer/simulate.py measures what a rank costs)."""
    from trainer.simulate import available_memory, bytes_per_rank

    per_rank, available = bytes_per_rank(to_collector), available_memory()
    if ranks * per_rank > available:
        raise UsageError(
            f"--ranks {ranks:,} needs about {ranks * per_rank / 2**30:,.0f} GiB of memory; the "
            f"{available / 2**30:.0f} GiB available here hold at most {available // per_rank:,} simulated ranks "
            f"{'sent to a collector' if to_collector else 'written with --out'}"
        )


def _power_caps(path: str, ranks: int):
    """Per-rank power limits from a JSON file, {rank: W} or a `rankwatch power recommend --json` document."""
    import json

    from trainer.simulate import power_limits

    try:
        return power_limits(json.loads(Path(path).read_text()), ranks)
    except OSError as e:
        raise UsageError(f"cannot read --power-caps {path}: {e.strerror or e}") from None
    except ValueError as e:  # JSONDecodeError is one
        raise UsageError(f"--power-caps {path}: {str(e).splitlines()[0]}") from None


def add_simulate(sub: options.Commands) -> None:
    p = sub.add_parser("simulate", help="a fleet of simulated ranks (DP x PP x TP) with injected faults")
    p.add_argument("--ranks", type=POSITIVE, required=True)
    p.add_argument("--dp", type=POSITIVE, help="data-parallel replicas (default: ranks / (pp x tp))")
    p.add_argument("--pp", type=POSITIVE, default=1, help="pipeline stages")
    p.add_argument("--tp", type=POSITIVE, default=1, help="tensor-parallel ranks")
    p.add_argument("--steps", type=POSITIVE, required=True)
    options.run_id(p)
    options.faults(p, "slow-stage:stage=3,slowdown=1.2")
    options.collector(p, "send OTLP to this collector")
    options.db(p, "the collector's store file, whose token file beside it is the token sent")
    p.add_argument(
        "--out",
        type=options.output_file,
        help="write a Parquet op trace instead (with a hang, it ends before the hang's step)",
    )
    p.add_argument(
        "--hang-for",
        type=QUANTITY_OR_ZERO,
        default=HANG_FOR_S,
        metavar="SECONDS",
        help=f"with a hang and --collector: how long the stuck ranks keep sending heartbeats "
        f"(default {HANG_FOR_S:g}, past the collector's default --hang-after of {HANG_FLOOR_S:g})",
    )
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument(
        "--power-caps",
        metavar="FILE.json",
        help="per-rank power limits, {rank: watts} or a `rankwatch power recommend --json` document",
    )
    options.token_file(p)
    p.set_defaults(func=cmd_simulate)
