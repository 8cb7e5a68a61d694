"""`rankwatch demo`: a collector, a 4-rank job with injected faults and the dashboard, end to end
(rankwatch/demo.py); what would stop them is said in one line before anything starts."""

import argparse

from rankwatch.cli import checks, options
from rankwatch.cli.launching import stop_on_sigterm
from rankwatch.cli.options import PORT, POSITIVE, UsageError
from rankwatch.cli.serving import dashboard_port_free


def cmd_demo(args: argparse.Namespace) -> None:
    from collector.config import Config
    from collector.server import Unstartable, startable
    from rankwatch.demo import MIN_STEPS, run

    if args.steps < MIN_STEPS:
        raise UsageError(f"--steps {args.steps}: the demo needs {MIN_STEPS} or more to show its straggler and spike")
    config = Config(db=checks.store(args), **options.given(args))
    try:
        startable(config)
    except Unstartable as e:
        raise UsageError(str(e)) from None
    if not args.no_dashboard:
        dashboard_port_free(args.dashboard_port, "--dashboard-port PORT, or --no-dashboard")
    stop_on_sigterm()
    run(
        db=config.db,
        steps=args.steps,
        port=config.port,
        dashboard_port=None if args.no_dashboard else args.dashboard_port,
    )


def add_demo(sub: options.Commands) -> None:
    p = sub.add_parser("demo", help="collector + a 4-rank job with injected faults, end to end")
    p.add_argument("--steps", type=POSITIVE, default=300)
    options.db(p)
    options.config_field(p, "--port", "port", type=PORT)
    options.dashboard_port(p, "--dashboard-port")
    p.add_argument(
        "--no-dashboard",
        action="store_true",
        help="end with the job, without the dashboard (by default it shows the run live and stays up)",
    )
    p.set_defaults(func=cmd_demo)
