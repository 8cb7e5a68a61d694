"""Launching a job with rankwatch in it: `rankwatch run` (an unmodified command), `rankwatch train` (the reference
trainer) and `rankwatch node` (the node's sidecar they start)."""

import argparse
import math
import os
import signal
import sys
import time

from rankwatch.cli import checks, options
from rankwatch.cli.options import NON_NEGATIVE, POSITIVE, UsageError
from trainer.device import DEVICES


def stop_on_sigterm() -> None:
    """SIGTERM (a service manager, `timeout`, `kill`) stops the command as Ctrl-C does, so that it
    stops what it started (the job's ranks, the collector, the dashboard) instead of orphaning them."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def check_targets(faults: list, ranks: int, steps: int, stages: int = 1, hosts: int = 1) -> None:
    """Each fault names a rank, stage and host the job has, and a step it reaches: one that does
    not would be silently ignored."""
    job = {"rank": ranks, "stage": stages, "node": hosts, "at": steps, "from": steps, "fail": steps}
    for f in faults:
        for key, count in job.items():
            if f.get(key) is not None and not f.get(key) < count:
                what = "step" if key in ("at", "from", "fail") else key
                raise UsageError(f"{f.spec!r}: {key}={f.get(key)} is not in the job, whose {what}s are 0..{count - 1}")


def _simulating(args: argparse.Namespace) -> None:
    """The job's ranks simulate the GPU they lack with --simulate-gpu, and only then (the environment they
    inherit says so); never because the launcher's own environment happened to."""
    from rankwatch.agent.config import SIMULATE_GPU_ENV

    if args.simulate_gpu:
        os.environ[SIMULATE_GPU_ENV] = "1"
    else:
        os.environ.pop(SIMULATE_GPU_ENV, None)


def cmd_run(args: argparse.Namespace) -> None:
    from rankwatch.agent.config import collector_url

    collector, store, token = collector_url(args.collector), checks.store(args), checks.sent_token(args)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("give the job's command after --, e.g. rankwatch run -- torchrun --nproc-per-node 2 train.py")
    checks.collector_takes(collector, token, unreachable_ok=True)  # before the job starts a rank
    _simulating(args)

    from rankwatch.launch import run

    stop_on_sigterm()
    try:
        sys.exit(run(command, run_id=args.run, collector=collector, token=token, store=store))
    except FileNotFoundError:
        raise UsageError(f"{command[0]!r}: no such command") from None


def cmd_node(args: argparse.Namespace) -> None:
    """The node's sidecar (rankwatch/agent/node.py) until SIGTERM or Ctrl-C; then what waits is delivered, and what
    could not be is noted where the launcher asked ($RANKWATCH_UNDELIVERED)."""
    from rankwatch.agent.config import UNDELIVERED_ENV, collector_urls
    from rankwatch.agent.node import Node

    collector, token = collector_urls(args.collector), checks.sent_token(args)
    if os.path.exists(args.socket):
        raise UsageError(f"{args.socket}: already exists (another node's socket?)")
    stop_on_sigterm()
    node = Node(args.socket, collector, token)
    try:
        signal.pause() if hasattr(signal, "pause") else time.sleep(math.inf)
    except KeyboardInterrupt:
        pass
    finally:
        os.unlink(args.socket)
        lost = node.stop(os.environ.get(UNDELIVERED_ENV))
        if lost:
            print(f"rankwatch node: {lost.rank_steps} rank-steps ({lost.spans} spans) never delivered", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> None:
    from rankwatch.agent.config import collector_url
    from rankwatch.agent.paths import checkpoint_dir

    collector, store, token = collector_url(args.collector), checks.store(args), checks.sent_token(args)
    if args.run is not None:
        try:
            checkpoint_dir(store, args.run)
        except ValueError as e:
            raise UsageError(str(e)) from None
    checks.collector_takes(collector, token, unreachable_ok=True)  # before torchrun starts a rank
    _simulating(args)

    from rankwatch.launch import train
    from trainer.device import DeviceError
    from trainer.faults import TRAINER_KINDS, parse
    from trainer.job import CONFIGS, SNAPSHOT_EVERY, Spec, unfit
    from trainer.layout import Layout

    if args.model not in CONFIGS:
        raise UsageError(f"unknown --model {args.model!r}; models: {', '.join(CONFIGS)}")
    if args.ckpt_every is not None and args.ckpt_every % SNAPSHOT_EVERY:
        raise UsageError(
            f"--ckpt-every {args.ckpt_every} is not a multiple of {SNAPSHOT_EVERY}: the job writes to disk one "
            f"of its snapshots, taken every {SNAPSHOT_EVERY} steps"
        )
    try:
        faults = [parse(spec, TRAINER_KINDS) for spec in args.inject]
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        layout = Layout.of(args.nproc, args.dp, args.tp, args.pp) if args.dp or args.tp > 1 or args.pp > 1 else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_targets(faults, args.nproc, args.steps, stages=layout.pp if layout else 1)
    try:
        offload = Spec.parse(args.offload, args.offload_schedule) if args.offload else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if offload and (problem := offload.refuses(layout is not None)):
        raise UsageError(problem)
    for f in faults:
        if problem := unfit(f, layout, offload):
            raise UsageError(f"{f.spec!r}: {problem}")
    trainer_args = [] if args.ckpt_every is None else ["--ckpt-every", str(args.ckpt_every)]
    if offload:
        trainer_args += ["--offload", str(offload), "--offload-schedule", offload.schedule]
    if layout:
        trainer_args += ["--dp", str(layout.dp), "--tp", str(layout.tp), "--pp", str(layout.pp)]
    stop_on_sigterm()
    try:
        sys.exit(
            train(
                nproc=args.nproc,
                steps=args.steps,
                run_id=args.run,
                faults=args.inject,
                collector=collector,
                model=args.model,
                max_restarts=args.max_restarts,
                device=args.device,
                store=store,
                token=token,
                trainer_args=trainer_args,
            )
        )
    except DeviceError as e:
        raise UsageError(str(e)) from None


def _simulate_gpu(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--simulate-gpu",
        action="store_true",
        help="a rank without a GPU simulates one (its power, clocks and energy, labelled simulated wherever shown); "
        "by default such a rank has no GPU telemetry",
    )


def add_train(sub: options.Commands) -> None:
    p = sub.add_parser("train", help="the reference GPT trainer under torchrun, instrumented")
    p.add_argument("--nproc", type=POSITIVE, default=2, help="ranks on this machine")
    p.add_argument("--steps", type=POSITIVE, default=200)
    options.run_id(p)
    options.faults(p, "straggler:rank=2,slowdown=1.3,from=40")
    options.collector(p)
    options.db(p, "the collector's store file, beside which checkpoints are kept in runs/RUN/checkpoints")
    p.add_argument("--model", default="tiny", help="tiny, small, gpt2 or 1b")
    p.add_argument(
        "--dp", type=POSITIVE, help="data-parallel degree, with FSDP2 (default: what --tp and --pp leave of --nproc)"
    )
    p.add_argument("--tp", type=POSITIVE, default=1, help="tensor-parallel degree (DTensor)")
    p.add_argument("--pp", type=POSITIVE, default=1, help="pipeline stages (a 1F1B schedule)")
    p.add_argument(
        "--max-restarts",
        type=NON_NEGATIVE,
        default=0,
        help="torchrun starts a failed job again up to this many times; it resumes from its checkpoint",
    )
    p.add_argument(
        "--offload",
        metavar="optimizer=host|disk[,activations=disk]",
        help="the optimizer's state on the host, or swapped to a local disk every step, and stepped on the CPUs; "
        "the activations saved for backward swapped to disk too",
    )
    p.add_argument(
        "--offload-schedule",
        default="serial",
        metavar="serial|overlap",
        help="swaps and the host optimizer after backward, or overlapped with compute (default serial)",
    )
    p.add_argument(
        "--ckpt-every",
        type=POSITIVE,
        metavar="STEPS",
        help="write a checkpoint to disk every STEPS steps (default 100; a multiple of 10: one of the job's snapshots)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="auto: a GPU per rank where this machine has enough, else the CPU",
    )
    _simulate_gpu(p)
    options.token_file(p)
    p.set_defaults(func=cmd_train)


def add_run(sub: options.Commands) -> None:
    p = sub.add_parser(
        "run", help="an unmodified training command, instrumented: rankwatch run -- torchrun ... train.py"
    )
    options.collector(p)
    options.run_id(p)
    options.db(
        p,
        "the collector's store file, whose token file beside it is the token sent and where its dashboard's "
        "address is noted",
    )
    _simulate_gpu(p)
    options.token_file(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the job's command, after --")
    p.set_defaults(func=cmd_run)


def add_node(sub: options.Commands) -> None:
    p = sub.add_parser(
        "node", help="the node's sidecar: exports what the host's ranks hand it (rankwatch run and train start one)"
    )
    p.add_argument("--socket", required=True, help="the Unix socket the ranks connect to (their $RANKWATCH_NODE)")
    options.collector(p)
    options.token_file(p)
    p.set_defaults(func=cmd_node)
