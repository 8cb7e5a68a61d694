"""Serving: `rankwatch collector` (with `token`, the scoped tokens made from its own, and `alerts test`, its
receivers tried) and `rankwatch dashboard`."""

import argparse
import os
import sys
from pathlib import Path

from rankwatch.agent.config import MIN_TOKEN_CHARS, QUERY, SCOPES, TOKEN_ENV
from rankwatch.cli import checks, options
from rankwatch.cli.options import NON_NEGATIVE, PORT, POSITIVE, QUANTITY, QUANTITY_OR_ZERO, UsageError

# --rollback-on's names of the anomaly kinds (collector/analysis/analyzers/anomalies.py's)
ROLLBACK_KINDS = {"nan": "nan", "loss": "loss_spike", "grad": "grad_spike"}


def cmd_collector(args: argparse.Namespace) -> None:
    from collector.config import Config
    from collector.server import Unstartable, serve
    from collector.store.upkeep import Upkeep
    from rankwatch.agent.config import TOKEN_FILE_ENV, token

    token_given = args.token or args.token_file or os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_FILE_ENV)
    settings = options.given(args)
    if args.no_auto_rollback:
        settings["rollback_on"] = frozenset()
    config = Config(
        db=checks.store(args),
        token=(token(args.token, args.token_file) or "") if token_given else None,  # None: the file beside the store
        alerts=alert_config(args),
        lake=checks.lake(args),
        upkeep=Upkeep(args.compact_every, args.retain_days),
        model=checks.step_model(args.model) if args.model else None,
        **settings,
    )
    if config.model is not None:  # an untrusted model draws nothing: say so where the collector starts
        print(f"rankwatch collector: step-time model {args.model}: {config.model.verdict}", file=sys.stderr)
    try:
        serve(config)
    except Unstartable as e:
        raise UsageError(str(e)) from None


def _rollback_kinds(text: str) -> frozenset[str]:
    """--rollback-on's anomaly kinds from nan, loss and grad."""
    chosen = [k.strip() for k in text.split(",") if k.strip()]
    if not chosen or not set(chosen) <= set(ROLLBACK_KINDS):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of nan, loss and grad")
    return frozenset(ROLLBACK_KINDS[k] for k in chosen)


def _rollback_names(kinds: frozenset[str]) -> str:
    """Anomaly kinds as --rollback-on names them."""
    return ",".join(name for name, kind in ROLLBACK_KINDS.items() if kind in kinds)


def alert_config(args: argparse.Namespace):
    """The receivers file named by --alerts, else the one beside the store if there is one."""
    from collector.alerts.config import AlertConfig, AlertConfigError, default_path, load

    path = Path(args.alerts) if args.alerts else default_path(checks.store(args))
    if not args.alerts and not path.exists():
        return AlertConfig()
    try:
        return load(path)
    except AlertConfigError as e:
        raise UsageError(str(e)) from None


def cmd_token(args: argparse.Namespace) -> None:
    from rankwatch.agent.config import scoped_token, token_scope

    checks.store(args)  # a --db that is no store is said as every command says it, not as a missing token
    token = checks.sent_token(args)
    if token is None:
        raise UsageError(
            "no token was found: give the collector's with --token-file PATH, $RANKWATCH_TOKEN, or --db (the "
            "collector's store, the token file beside it)"
        )
    if scope := token_scope(token):
        raise UsageError(f"that token is scoped to {scope}: scoped tokens are made from the collector's own token")
    print(scoped_token(token, args.scope))


def cmd_alerts_test(args: argparse.Namespace) -> None:
    import httpx

    from collector.alerts import probe
    from collector.alerts.config import receiver
    from collector.alerts.webhook import DeliveryError

    if args.secret and not args.url:
        raise UsageError("--secret goes with --url")
    config = alert_config(args)
    try:
        receivers = (
            [receiver({"url": args.url} | ({"secret": args.secret} if args.secret else {}), "--url")]
            if args.url
            else list(config.receivers)
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not receivers:
        raise UsageError("no receiver to test: give --url, or list receivers in the alerts file (--alerts)")
    failed = []
    with httpx.Client(timeout=config.timeout_s) as client:
        for r in receivers:
            try:
                status = probe.send(client, r, config.dashboard_url)
            except DeliveryError as e:
                failed.append(r.name)
                print(f"{r.name}: failed: {e}")
            else:
                print(f"{r.name}: delivered (HTTP {status})")
    if failed:
        raise UsageError(
            f"the test alert did not reach {len(failed)} of {len(receivers)} receivers: {', '.join(failed)}"
        )


def cmd_dashboard(args: argparse.Namespace) -> None:
    from collector.store.db import StoreLocked, connect
    from dashboard.serve import serve
    from rankwatch.agent.config import collector_url

    dashboard_port_free(args.port, "--port PORT")
    collector, db = collector_url(args.collector) if args.collector else None, None
    if not collector:
        db = checks.store(args, existing=True)
        try:
            connect(db, read_only=True).close()
        except StoreLocked as e:
            if args.db:
                raise UsageError(f"{e}, or read it through the collector (--collector URL)") from None
            collector, db = collector_url(), None  # the default store's collector holds it: ask that collector
    if collector:
        token = checks.sent_token(args)
        checks.collector_takes(collector, token, unreachable_ok=False, scope=QUERY)  # not a page of "wrong token"
        if token:
            os.environ[TOKEN_ENV] = token  # read and checked here, handed to the dashboard's process
    serve(args.port, db, collector, (db or checks.store(args)).parent)


def dashboard_port_free(port: int, hint: str) -> None:
    """A one-line usage error, before Streamlit starts, when the dashboard's port is taken."""
    from collector.server import check_address
    from dashboard.serve import HOST

    try:
        check_address(HOST, port)
    except OSError as e:
        raise UsageError(f"cannot serve the dashboard on {HOST}:{port}: {e.strerror or e} ({hint})") from None


def add_collector(sub: options.Commands) -> None:
    p = sub.add_parser("collector", help="run the OTLP/HTTP collector and store")
    options.db(p)
    options.config_field(p, "--host", "host")
    options.config_field(p, "--port", "port", type=PORT)
    p.add_argument(
        "--token",
        help=f"bearer token, {MIN_TOKEN_CHARS} characters or more (default: ${TOKEN_ENV}, else the token file "
        "beside the DB)",
    )
    options.token_file(p)
    options.config_field(p, "--workers", "workers", type=NON_NEGATIVE)
    options.config_field(p, "--max-queue-bytes", "max_queue_bytes", options.binary_size, type=POSITIVE)
    options.config_field(p, "--writer-memory", "writer_memory", options.binary_size, type=POSITIVE, metavar="BYTES")
    options.config_field(p, "--max-reading-bytes", "max_reading_bytes", options.binary_size, type=POSITIVE)
    options.config_field(p, "--header-timeout", "header_timeout_s", type=QUANTITY, metavar="SECONDS")
    options.config_field(p, "--max-connections", "max_connections", type=POSITIVE)
    options.config_field(p, "--analyze-every", "analyze_every_s", type=QUANTITY, metavar="SECONDS")
    options.hang_after(p)
    options.step_model(p, "what each straggler's state explains, and when the whole job computes slower than predicted")
    options.config_field(p, "--power-every", "power_every_s", type=QUANTITY_OR_ZERO, metavar="SECONDS")
    p.add_argument(
        "--no-auto-rollback",
        action="store_true",
        help="report anomalies (NaN, loss spikes) without sending the job a rollback",
    )
    options.config_field(
        p,
        "--rollback-on",
        "rollback_on",
        _rollback_names,
        "nan, loss or grad, comma-separated",
        type=_rollback_kinds,
        metavar="KINDS",
    )
    p.add_argument(
        "--alerts",
        metavar="FILE",
        help="alert receivers, TOML or JSON (default: alerts.toml beside the store, if it exists)",
    )
    options.lake(p, "store into (--db's directory keeps this collector's token and alerts file)")
    p.add_argument(
        "--compact-every",
        type=QUANTITY,
        default=600.0,
        metavar="SECONDS",
        help="with --lake: how often one of the lake's collectors merges its small files and drops what no "
        "snapshot of the last hour reads (default 600)",
    )
    p.add_argument(
        "--retain-days",
        type=QUANTITY,
        metavar="DAYS",
        help="with --lake: telemetry older than this is deleted at each compaction (default: kept)",
    )
    p.set_defaults(func=cmd_collector)


def add_token(sub: options.Commands) -> None:
    p = sub.add_parser("token", help="print a token scoped to ingest, query or control, made from the collector's")
    p.add_argument(
        "--scope",
        choices=SCOPES,
        required=True,
        help="ingest: send telemetry and take a run's commands (what a job needs); query: read; control: post "
        "commands, and read",
    )
    options.db(p, "the collector's store file, the token file beside it the collector's")
    options.token_file(p)
    p.set_defaults(func=cmd_token)


def add_alerts(sub: options.Commands) -> None:
    p = sub.add_parser("alerts", help="alert webhooks")
    alerts = p.add_subparsers(dest="alerts_command", required=True, parser_class=options.Parser)
    p = alerts.add_parser("test", help="send a signed test alert to --url, or to every configured receiver")
    p.add_argument("--url", help="the receiver to test (default: every receiver in the alerts file)")
    p.add_argument("--secret", help="its Standard Webhooks secret, whsec_<base64>")
    p.add_argument("--alerts", metavar="FILE", help="receivers file (default: alerts.toml beside the store)")
    options.db(p, "store file whose directory holds the default alerts file")
    p.set_defaults(func=cmd_alerts_test)


def add_dashboard(sub: options.Commands) -> None:
    p = sub.add_parser("dashboard", help="the Streamlit dashboard, on loopback")
    options.db(
        p,
        "a store file no collector holds, read-only",
        "; through its collector when one holds it; with --collector, that collector's store, whose token file "
        "beside it is the token sent",
    )
    options.collector(
        p,
        "a running collector, through its query API (token: --token-file, $RANKWATCH_TOKEN, else the "
        "token file beside the store); checked at start",
    )
    options.dashboard_port(p)
    options.token_file(p)
    p.set_defaults(func=cmd_dashboard)
