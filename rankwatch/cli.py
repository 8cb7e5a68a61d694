"""`rankwatch` command line: one subcommand per public job.

Bad input ends in a one-line `rankwatch: error: ...` on stderr and exit 2.
Subcommands import their machinery lazily, so `rankwatch train` never loads
duckdb and `rankwatch query` never loads torch.
"""

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collector.printable import escape_logs, printable
from rankwatch.agent.config import INGEST, QUERY, SCOPES, TOKEN_ENV, TokenError, UrlError
from rankwatch.agent.paths import DB_ENV, DEFAULT_DB
from trainer.device import DEVICES

if TYPE_CHECKING:
    from rankwatch.agent.apiclient import ApiClient

_DEFAULT_DB = f"default: {DEFAULT_DB}, or ${DB_ENV}"  # the --db options' help


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2; `context`, lines printed under it as they
    are (already printable: where in the SQL DuckDB refused it, collector/reports/query.py)."""

    def __init__(self, message: str, prog: str = "rankwatch", context: str | None = None):
        super().__init__(message)
        self.prog = prog
        self.context = context


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message, self.prog)


def _whole(low: int, high: int | None = None):
    """argparse type: a whole number in [low, high]; anything else is a one-line usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"{value} is outside {low}..{high}" if high is not None else f"must be {low} or more, got {value}"
            )
        return value

    return parse


def _quantity(allow_zero: bool):
    """argparse type: a finite number of seconds (or watts), positive, or also 0 with `allow_zero`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be {'0 or more' if allow_zero else 'more than 0'}, got {text}")
        return value

    return parse


POSITIVE, NON_NEGATIVE, PORT = _whole(1), _whole(0), _whole(1, 65535)


DUCKDB_MAGIC = b"DUCK"  # bytes 8-11 of every DuckDB database file


def _db(args, existing: bool = False) -> Path:
    """The store of --db, $RANKWATCH_DB or the default, checked the same way for every command: a
    directory, an unreadable file or a file of another kind is one line here, not a DuckDB traceback
    later; with `existing`, so is no file at all (a command that only reads never creates a store)."""
    from rankwatch.agent.paths import store_path

    path = store_path(getattr(args, "db", None))
    if path.is_dir():
        raise UsageError(f"the store {path} is a directory: give the store file (--db PATH)")
    try:
        with open(path, "rb") as f:
            header = f.read(12)
    except FileNotFoundError:
        if existing:
            raise UsageError(f"no store at {path}") from None
        return path
    except OSError as e:
        raise UsageError(f"cannot read the store {path}: {e.strerror or e}") from None
    if header and header[8:12] != DUCKDB_MAGIC:  # an empty file is where a store is yet to be made
        raise UsageError(f"{path} is not a rankwatch store (a DuckDB file): check --db")
    return path


def _output_file(text: str) -> str:
    """argparse type: a file the command may write (its directory there and writable, not a directory
    itself), checked before any work, so a typo costs no minutes of analysis and no traceback."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file name in it")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: there is no directory {path.parent}")
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def _preflight(config) -> None:
    """What would stop a collector from starting (collector/server.py), as a one-line usage error."""
    from collector.server import preflight
    from collector.store.db import StoreLocked
    from collector.store.lake import LakeError

    try:
        preflight(config)
    except (StoreLocked, LakeError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None


def _rollback_kinds(text: str) -> frozenset[str]:
    """--rollback-on's anomaly kinds (collector/analysis/analyzers/anomalies.py's names) from nan, loss, grad."""
    names = {"nan": "nan", "loss": "loss_spike", "grad": "grad_spike"}
    chosen = [k.strip() for k in text.split(",") if k.strip()]
    if not chosen or not set(chosen) <= set(names):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of nan, loss and grad")
    return frozenset(names[k] for k in chosen)


def _token(args) -> str | None:
    """The token a client command sends: --token-file, then rankwatch/agent/config.py's order, ending with the token
    file beside the store of --db (or $RANKWATCH_DB, or the default); a file's token is checked there
    (TokenError, which main() reports in one line)."""
    from rankwatch.agent.config import token

    return token(file=args.token_file, store=getattr(args, "db", None))


def _refused(error: Exception, token: str | None) -> UsageError:
    """A refused token, in one line that says where a command looks for the right one."""
    from rankwatch.agent.config import token_scope

    scope = token and token_scope(token)
    why = (
        "no token was found"
        if token is None
        else f"that token is scoped to {scope}, and this takes another scope"
        if scope
        else "that token is not its token"
    )
    return UsageError(
        f"{error}: {why}; give it with "
        "--token-file PATH, $RANKWATCH_TOKEN, or --db (the collector's store, the token file beside it)"
    )


def _collector_takes(url: str, token: str | None, unreachable_ok: bool, scope: str = INGEST) -> None:
    """Before a command sends anything: the collector at `url` takes `token` for `scope` (ingest: one empty,
    authenticated export; query: one query of a constant), else one line naming where a token is looked
    for; an unreachable collector is one line too unless `unreachable_ok` (a job's telemetry waits for it)."""
    from rankwatch.agent.config import TokenRefused
    from rankwatch.agent.senders import check_token

    try:
        reached = check_token(url, token) if scope == INGEST else _answers_queries(url, token)
    except TokenRefused as e:
        raise _refused(e, token) from None
    if not reached and not unreachable_ok:
        raise UsageError(f"cannot reach the collector at {url}: is it running? (rankwatch collector)")


def _answers_queries(url: str, token: str | None) -> bool:
    """agent.export.check_token's twin for the query API: True when the collector at `url` answers a query
    with `token`, False when it cannot be reached, TokenRefused when it answers 401 or 403."""
    from collector.reports.queryapi import PATH
    from rankwatch.agent.apiclient import ApiClient, ApiError
    from rankwatch.agent.config import TokenRefused

    try:
        ApiClient(url, token, timeout_s=5).post(PATH, {"sql": "SELECT 1"})
    except ApiError as e:
        if e.status in (401, 403):
            raise TokenRefused(f"the collector at {url} refused the token (HTTP {e.status}: {e})") from None
        return e.status is not None  # it answered, and not about the token
    return True


def cmd_token(args) -> None:
    from rankwatch.agent.config import scoped_token, token_scope

    _db(args)  # a --db that is no store is said as every command says it, not as a missing token
    token = _token(args)
    if token is None:
        raise UsageError(
            "no token was found: give the collector's with --token-file PATH, $RANKWATCH_TOKEN, or --db (the "
            "collector's store, the token file beside it)"
        )
    if scope := token_scope(token):
        raise UsageError(f"that token is scoped to {scope}: scoped tokens are made from the collector's own token")
    print(scoped_token(token, args.scope))


def cmd_collector(args) -> None:
    from collector import private
    from collector.receive.auth import load_or_create_token
    from collector.server import Config, serve
    from collector.store.upkeep import Upkeep
    from rankwatch.agent.config import TOKEN_FILE_ENV, checked_token, token

    private.restrict(_db(args))
    given = args.token or args.token_file or os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_FILE_ENV)
    checked = (
        checked_token(token(args.token, args.token_file) or "", "--token or $RANKWATCH_TOKEN")
        if given
        else load_or_create_token(_db(args).parent)  # the file beside the store, checked, or made
    )
    config = Config(
        db=_db(args),
        host=args.host,
        port=args.port,
        token=checked,
        workers=args.workers,
        max_queue_bytes=args.max_queue_bytes,
        max_reading_bytes=args.max_reading_bytes,
        **({"writer_memory": args.writer_memory} if args.writer_memory else {}),
        header_timeout_s=args.header_timeout,
        max_connections=args.max_connections,
        analyze_every_s=args.analyze_every,
        hang_after_s=args.hang_after,
        rollback_on=frozenset() if args.no_auto_rollback else args.rollback_on,
        power_every_s=args.power_every or None,
        alerts=_alert_config(args),
        lake=_lake(args),
        upkeep=Upkeep(args.compact_every, args.retain_days),
        model=_model(args.model) if args.model else None,
    )
    if config.model is not None:  # an untrusted model draws nothing: say so where the collector starts
        print(f"rankwatch collector: step-time model {args.model}: {config.model.verdict}", file=sys.stderr)
    _preflight(config)
    serve(config)


def _reader(args):
    """A read-only connection to the store: the lake of --lake and --data-path, else the file of --db."""
    from collector.store.db import connect
    from collector.store.lake import LakeError, open_lake

    lake = _lake(args)
    if lake is None:
        return connect(_db(args, existing=True), read_only=True)
    try:
        return open_lake(lake, read_only=True)
    except LakeError as e:
        raise UsageError(str(e)) from None


def _lake_options(p, what: str) -> None:
    p.add_argument(
        "--lake",
        metavar="CATALOG",
        help=f"{what} a lake shared by several collectors, whose catalog is this PostgreSQL database "
        "(a libpq connection string: 'host=H port=P dbname=D user=U' or postgresql://U@H:P/D; its password "
        "from ~/.pgpass or $PGPASSWORD, never here)",
    )
    p.add_argument("--data-path", metavar="DIR", help="with --lake: the directory of the lake's Parquet files")


def _lake(args):
    """The lake named by --lake and --data-path (both or neither), or None: the store file."""
    if (args.lake is None) != (args.data_path is None):
        raise UsageError("--lake and --data-path go together: the lake's catalog database and its data directory")
    if args.lake is None:
        return None
    from collector.store.lake import Lake, LakeError

    try:
        return Lake(args.lake, Path(args.data_path).resolve())
    except LakeError as e:
        raise UsageError(str(e)) from None


def _alert_config(args):
    """The receivers file named by --alerts, else the one beside the store if there is one."""
    from collector.alerts.config import AlertConfig, AlertConfigError, default_path, load

    path = Path(args.alerts) if args.alerts else default_path(_db(args))
    if not args.alerts and not path.exists():
        return AlertConfig()
    try:
        return load(path)
    except AlertConfigError as e:
        raise UsageError(str(e)) from None


def cmd_alerts_test(args) -> None:
    import httpx

    from collector.alerts import probe
    from collector.alerts.config import receiver
    from collector.alerts.webhook import DeliveryError

    if args.secret and not args.url:
        raise UsageError("--secret goes with --url")
    config = _alert_config(args)
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


def _answer(args, sql: str) -> dict:
    """The query API's answer to `sql`, from the collector of --collector or else the store file of --db."""
    from collector.reports.query import QueryError, ask, run_sql
    from collector.store.db import StoreLocked
    from rankwatch.agent.config import collector_url

    try:
        if args.collector:
            return ask(collector_url(args.collector), _token(args), sql)
        return run_sql(_db(args, existing=True), sql)
    except QueryError as e:
        raise UsageError(str(e), context=e.context) from None
    except StoreLocked as e:
        raise UsageError(str(e)) from None


def cmd_query(args) -> None:
    from collector.reports.query import write

    answer = _answer(args, args.sql)
    if answer["truncated"]:
        print(f"rankwatch query: the first {len(answer['rows'])} rows only (the query API's cap)", file=sys.stderr)
    write(answer["columns"], answer["rows"], args.format, types=answer["types"])


def cmd_runs(args) -> None:
    import pandas as pd

    from collector.reports.query import write
    from collector.reports.runs import listing
    from dashboard.queries import RUNS
    from dashboard.source import to_frame

    # read through a collector, a run may be running now; a store file open here is one no collector writes
    runs = listing(to_frame(_answer(args, RUNS)), live=bool(args.collector), at=pd.Timestamp.now(tz="UTC"))
    write(list(runs.columns), list(runs.itertuples(index=False)), args.format)


def cmd_nodes(args) -> None:
    import json
    from urllib.parse import quote

    from collector.reports import nodes, queryapi
    from collector.store.db import StoreLocked

    if args.collector:
        from rankwatch.agent.apiclient import ApiClient, ApiError
        from rankwatch.agent.config import collector_url

        token = _token(args)
        path = queryapi.NODES_PATH.replace("{run_id:path}", quote(args.run, safe=""))
        try:
            listed = ApiClient(collector_url(args.collector), token).get(path, {"unhealthy": str(int(args.unhealthy))})
        except ApiError as e:
            raise (_refused(e, token) if e.status in (401, 403) else UsageError(str(e))) from None
    else:
        try:
            listed = nodes.read(_reader(args), args.run, args.unhealthy)
        except (StoreLocked, LookupError) as e:
            raise UsageError(str(e).strip("'\"")) from None
    if args.json:
        print(json.dumps(listed, indent=2))
    else:
        _print_nodes(listed, args.unhealthy)


def _print_nodes(listed: dict, unhealthy: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from collector.analysis.analyzers.fleet import said_of
    from collector.reports.terminal import markup_safe

    console, listing = Console(), listed["nodes"]
    if not listing:
        console.print(f"run {markup_safe(listed['run'])}: " + ("no unhealthy node" if unhealthy else "no node known"))
        return
    table = Table("host", "ranks", "state", "since step", "score", "what sets it apart", title=f"run {listed['run']}")
    for node in listing:
        apart = "; ".join(map(said_of, node["metrics"]))
        since, score = node["since_step"], node["score"]
        table.add_row(
            *map(markup_safe, (str(node["host"]), _ranks(node["ranks"]), node["state"])),
            "-" if since is None else str(since),
            "-" if score is None else f"{score:.1f}",
            markup_safe(apart) or "-",
        )
    console.print(table)


def cmd_analyze(args) -> None:
    import json
    from dataclasses import asdict

    from collector.analysis.analyzers import hangs
    from collector.reports.postmortem import analyze_run
    from collector.store.db import StoreLocked
    from collector.store.runs import UnknownRun

    model = _model(args.model) if args.model else None
    try:
        con = _reader(args)
        report = analyze_run(con, args.run, hang_settings=hangs.Settings(floor_s=args.hang_after), model=model)
    except (StoreLocked, UnknownRun) as e:
        raise UsageError(str(e)) from None
    if args.heatmap and report.whatif is None:
        raise UsageError(f"run {args.run} has no steps (Flight Recorder dumps): no heatmap to draw")
    if args.heatmap:
        from collector.reports.heatmap import write_heatmap

        write_heatmap(report.steps, Path(args.heatmap), f"run {args.run}: compute against the step median")
    if args.json:
        whatif = asdict(report.whatif) if report.whatif else {}  # a run without steps has no what-if part
        loss = {"telemetry_loss": report.loss.as_dict()} if report.loss else {}
        prediction = {"prediction": report.prediction.as_dict()} if report.prediction else {}
        findings = {"findings": [asdict(f) for f in report.findings]}
        print(json.dumps({"run": args.run, **whatif, **loss, **prediction, **findings}, indent=2))
    else:
        _print_report(report)


def _print_report(report) -> None:
    from rich.console import Console
    from rich.table import Table

    from collector.analysis.analyzers import whatif
    from collector.reports.terminal import markup_safe

    w, console, run = report.whatif, Console(), markup_safe(report.run_id)
    if w is None:
        console.print(f"[bold]run {run}[/]: Flight Recorder dumps, no steps: no what-if analysis")
        _print_findings(report.findings, console)
        return
    console.print(f"[bold]run {run}[/]: {markup_safe(whatif.summary(w))}")
    if report.loss is not None and report.loss.any:  # conclusions drawn where data is missing: say so first
        console.print(f"[bold red]{report.loss.summary()}[/]: the analysis below is drawn on partial data")
    explained = Table("explained by", "slowdown", title="what-if: only these at their real durations")
    for t, slowdown in w.op_types.items():
        explained.add_row(f"op type {t}", f"{slowdown:.3f}x")
    if w.idle_slowdown is not None:
        explained.add_row("launch delay and idle (not in the slowdown)", f"{w.idle_slowdown:.3f}x")
    for s in w.stages[:4]:
        explained.add_row(f"stage {s['pp_stage']}", f"{s['slowdown']:.3f}x")
    for worker in w.workers[:8]:
        placed = ", ".join(
            f"{what} {worker[key]}"
            for what, key in (("stage", "pp_stage"), ("replica", "dp_rank"))
            if worker[key] is not None
        )
        explained.add_row(f"rank {worker['rank']}" + (f" ({placed})" if placed else ""), f"{worker['slowdown']:.3f}x")
    console.print(explained)
    if report.prediction is not None:
        _print_prediction(report.prediction, console)
    _print_findings(report.findings, console)


def _model(path: str):
    """The step-time model saved at `path` by `rankwatch model fit`; a usage error where it is not one."""
    from collector.predict.stepmodel import Fitted

    try:
        return Fitted.load(Path(path))
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {path}: not a model saved by `rankwatch model fit` ({e})") from None


def _print_prediction(prediction, console) -> None:
    """Each rank's compute time, measured against what its state predicts (the slowest first)."""
    from rich.table import Table

    console.print(f"step-time model: {prediction.verdict}")
    if not prediction.trusted:
        return
    ranks = prediction.ranks.assign(ratio=prediction.ranks["measured_s"] / prediction.ranks["predicted_s"])
    table = Table("rank", "compute, measured", "predicted", "measured / predicted", title="compute time per rank")
    for row in ranks.sort_values("ratio", ascending=False).head(8).itertuples():
        table.add_row(
            str(row.rank), f"{row.measured_s * 1e3:.1f} ms", f"{row.predicted_s * 1e3:.1f} ms", f"{row.ratio:.2f}"
        )
    console.print(table)


def cmd_model_fit(args) -> None:
    from rich.console import Console
    from rich.table import Table

    from collector.predict.stepmodel import TooLittleData, fit
    from collector.store.db import StoreLocked

    try:
        fitted = fit(_reader(args), args.run, epochs=args.epochs)
    except (StoreLocked, TooLittleData) as e:
        raise UsageError(str(e)) from None
    fitted.save(Path(args.out))
    console = Console()
    table = Table("predictor", "MAPE %", "P90 %", "within 5%", "R² (log)", title="each run held out in turn")
    for name, m in fitted.figures.items():
        table.add_row(name, f"{m['mape']:.1f}", f"{m['p90']:.1f}", f"{m['within5']:.0%}", f"{m['r2_log']:.3f}")
    console.print(table)
    print(f"saved {args.out}: {fitted.verdict}")


def _counted(found: list) -> str:
    """ "2 findings, 1 recommendation": what went wrong apart from advice (severity info, such as power caps)."""
    from collector.analysis.analyzers import NOT_JUDGED

    advice = sum(f.severity == "info" and f.kind != NOT_JUDGED for f in found)
    problems = len(found) - advice
    told = f"{problems} finding{'s' * (problems != 1)}"
    return told + (f", {advice} recommendation{'s' * (advice != 1)}" if advice else "")


def _print_findings(found: list, console) -> None:
    from rich.table import Table

    from collector.analysis.analyzers import NOT_JUDGED
    from collector.reports.terminal import markup_safe

    if not found:
        console.print("No findings: no analyzer found anything wrong.")
        return
    findings = Table(
        "analyzer",
        "kind",
        "ranks",
        "steps",
        "severity",
        "summary",
        title=_counted(found),
        show_lines=True,
    )
    for f in found:
        steps = "-" if f.step_start is None else f"{f.step_start}-{f.step_end}"
        findings.add_row(*map(markup_safe, (f.analyzer, f.kind, _ranks(f.ranks), steps, f.severity, f.summary)))
    console.print(findings)
    for f in found:  # what to do, where a finding says it in its own figures (a failed rank's host, its stack)
        if told := f.evidence.get("what_to_do"):
            lines = "\n".join(markup_safe(line) for line in str(told).splitlines())  # each line made safe
            console.print(f"[bold]{markup_safe(f.analyzer)} / {markup_safe(f.kind)}, what to do:[/] {lines}")
    for f in found:  # where every rank is, where a hang's ranks answered (collector/analysis/stacks.py)
        if isinstance(merged := f.evidence.get("stacks"), dict):
            from collector.analysis import stacks

            console.print(f"[bold]{markup_safe(f.analyzer)} / {markup_safe(f.kind)}, where every rank was:[/]")
            for line in stacks.lines(merged):
                console.print("  " + markup_safe(line), soft_wrap=True)
        if isinstance(recorder := f.evidence.get("flight_recorder"), dict):
            from collector.analysis import recorded

            console.print(f"[bold]{markup_safe(f.analyzer)} / {markup_safe(f.kind)}, what the Flight Recorders say:[/]")
            for line in recorded.lines(recorder):
                console.print("  " + markup_safe(line), soft_wrap=True)
    for f in found:  # silence from an analyzer that could not judge is no clean bill: say why
        if f.kind == NOT_JUDGED:
            reason = markup_safe(f.summary.removeprefix("not judged: "))
            console.print(f"[bold]{markup_safe(f.analyzer)}: not judged[/] ({reason})")


def _ranks(ranks: list[int]) -> str:
    from collector import ranksets

    return ranksets.compact(ranks) or "-"


def cmd_power_recommend(args) -> None:
    import json

    from collector.analysis.analyzers.power import POWER_METRICS, Policy
    from collector.reports.powercaps import document, recommend
    from collector.store.db import StoreLocked
    from collector.store.runs import UnknownRun

    try:
        policy = Policy.parse(args.policy)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        con = _reader(args)
        report = recommend(con, args.run, policy, args.facility_watts)
    except (StoreLocked, UnknownRun) as e:
        raise UsageError(str(e)) from None
    (samples,) = con.execute(
        "SELECT count(*) FROM device_samples WHERE run_id = ? AND metric IN ?", [args.run, list(POWER_METRICS)]
    ).fetchall()[0]
    if not samples:  # nothing measured and nothing simulated: an empty table would read as "no saving"
        raise UsageError(f"run {args.run} has no power samples ({', '.join(POWER_METRICS)}): no caps to recommend")
    if args.plot:
        from collector.reports.powerplot import write_curve

        write_curve(report, Path(args.plot))
    if args.json:
        print(json.dumps(document(report), indent=2))
    else:
        _print_power(report)


def cmd_power_apply(args) -> None:
    import json

    from rankwatch.agent.apiclient import ApiClient, ApiError
    from rankwatch.agent.config import collector_url

    if not args.caps and args.watts is None:
        raise UsageError("give --caps FILE.json, --watts W, or both")
    if args.caps:
        try:
            document = json.loads(Path(args.caps).read_text())
        except OSError as e:
            raise UsageError(f"cannot read --caps {args.caps}: {e.strerror or e}") from None
        except ValueError as e:
            raise UsageError(f"--caps {args.caps}: {str(e).splitlines()[0]}") from None
        caps = document.get("rank_caps", document) if isinstance(document, dict) else document
        body = {"caps": caps} | ({"watts": args.watts} if args.watts is not None else {})
    else:
        body = {"watts": args.watts}
    api = ApiClient(collector_url(args.collector), _token(args))
    _check_caps(api, args.run, body)
    try:
        command = api.post("/v1/commands", {"run_id": args.run, "kind": "power_cap", "args": body})
    except ApiError as e:
        raise UsageError(
            f"the collector refused the power cap (HTTP {e.status}): {e}" if e.status else str(e)
        ) from None
    print(
        f"rankwatch power apply: command {command['id']} (power_cap: {len(command['args']['caps'])} ranks capped"
        + (f", the others at {command['args']['watts']:g} W" if "watts" in command["args"] else "")
        + f") is pending for run {args.run}; the job applies it at a step boundary"
    )


_JOB = """SELECT (SELECT list(rank ORDER BY rank) FROM ranks WHERE run_id = $run),
                  max(value) FILTER (metric = $low), min(value) FILTER (metric = $high),
                  (SELECT count(DISTINCT rank) FROM events WHERE run_id = $run AND event = $ended),
                  greatest((SELECT epoch_ns(max(ts)) FROM events WHERE run_id = $run),
                           (SELECT epoch_ns(max(end_ts)) FROM steps WHERE run_id = $run))
           FROM device_samples WHERE run_id = $run AND metric IN ($low, $high)"""
SILENT_S = 60.0  # a running job's agent sends a heartbeat every 5 s: this long without one or a step, none runs


def _check_running(
    run_id: str,
    ranks: list[int],
    ended: int,
    last_ns: int | None,
    undone: str = "a power cap would never be applied",
    doing: str = "apply a power cap",
) -> None:
    """A command only a running job applies: refused for a run whose every rank said it ended, or that
    sent no step or event for SILENT_S (an imported or finished run), since it would stay pending for ever;
    `undone` and `doing` say what in the refusal."""
    if ranks and ended >= len(ranks):
        raise UsageError(f"run {run_id} has ended (every rank said so): {undone}")
    silent_s = None if last_ns is None else (time.time_ns() - last_ns) / 1e9
    if silent_s is None or silent_s > SILENT_S:
        since = (
            "has sent no step or heartbeat"
            if silent_s is None
            else f"has sent nothing for {silent_s:.0f} s"
            if silent_s < 120
            else f"has sent nothing for {silent_s / 60:.0f} min"
        )
        raise UsageError(f"run {run_id} {since}: no job is running to {doing}")


def _check_caps(api: "ApiClient", run_id: str, body: dict) -> None:
    """Before a power cap is sent: the run is one the collector knows and still running, every capped
    rank is one of its ranks, and every cap is within the limits its GPUs accept (the tightest range
    they share)."""
    from collector.reports import queryapi
    from rankwatch.agent import semconv as sc

    try:
        answer = queryapi.remote_query(
            api,
            _JOB,
            {"run": run_id, "low": sc.POWER_LIMIT_MIN_W, "high": sc.POWER_LIMIT_MAX_W, "ended": sc.EVENT_ENDED},
        )
    except queryapi.QueryFailed as e:
        raise UsageError(str(e)) from None
    ranks, low, high, ended, last_ns = answer["rows"][0]
    if not ranks:
        raise UsageError(f"the collector at {api.url} knows no run {run_id!r}")
    _check_running(run_id, ranks, ended, last_ns)
    caps = body.get("caps")
    if not isinstance(caps, dict):
        caps = {}
    targets = [(f"rank {r}", r, w) for r, w in caps.items()] + (
        [("every other rank", None, body["watts"])] if "watts" in body else []
    )
    for name, rank, watts in targets:
        if rank is not None and str(rank).isdigit() and int(rank) not in ranks:
            raise UsageError(f"run {run_id} has no rank {rank} (its ranks: {_ranks(ranks)})")
        if isinstance(watts, (int, float)) and low is not None and high is not None and not low <= watts <= high:
            raise UsageError(f"{watts:g} W for {name} is outside the {low:g}-{high:g} W its GPUs accept")


_RUNNING = """SELECT (SELECT list(rank ORDER BY rank) FROM ranks WHERE run_id = $run),
                      (SELECT count(DISTINCT rank) FROM events WHERE run_id = $run AND event = $ended),
                      greatest((SELECT epoch_ns(max(ts)) FROM events WHERE run_id = $run),
                               (SELECT epoch_ns(max(end_ts)) FROM steps WHERE run_id = $run))"""
STACKS_POLL_S = 0.5  # how often `rankwatch stacks` looks for the answers


def cmd_stacks(args) -> None:
    import json
    from urllib.parse import quote

    from collector import ranksets
    from collector.analysis import stacks
    from collector.reports import queryapi
    from rankwatch.agent import semconv as sc
    from rankwatch.agent.apiclient import ApiClient, ApiError
    from rankwatch.agent.config import collector_url

    url, token = collector_url(args.collector), _token(args)
    api = ApiClient(url, token)
    try:
        ranks = None if args.ranks is None else ranksets.parse(args.ranks)
    except ValueError as e:
        raise UsageError(f"--ranks: {e}") from None
    if ranks == []:
        raise UsageError("--ranks names no rank: give ranks (0,3-5), or leave it out to ask every rank")
    try:
        answer = queryapi.remote_query(api, _RUNNING, {"run": args.run, "ended": sc.EVENT_ENDED})
    except queryapi.QueryFailed as e:
        raise UsageError(str(e)) from None
    known, ended, last_ns = answer["rows"][0]
    if not known:
        raise UsageError(f"the collector at {url} knows no run {args.run!r}")
    if ranks and (missing := sorted(set(ranks) - set(known))):
        raise UsageError(f"run {args.run} has no {ranksets.phrase(missing)} (its ranks: {_ranks(known)})")
    _check_running(args.run, known, ended, last_ns, "its ranks would never answer", "answer a stacks request")
    try:
        command = api.post("/v1/commands", {"run_id": args.run, "kind": "stacks", "args": {"ranks": ranks}})
        path = queryapi.STACKS_PATH.replace("{run_id:path}", quote(args.run, safe=""))
        deadline = time.monotonic() + args.wait
        while True:
            merged = api.get(path, {"request": str(command["id"])})
            if not merged["unanswered"] or time.monotonic() >= deadline:
                break
            time.sleep(STACKS_POLL_S)
    except ApiError as e:
        raise (_refused(e, token) if e.status in (401, 403) else UsageError(str(e))) from None
    if args.json:
        print(json.dumps(merged, indent=2))
    else:
        print(
            printable(f"run {args.run}: stacks request {merged['request']}, ")
            + f"{merged['answered']} of {merged['asked']} ranks answered"
        )
        for line in stacks.lines(merged):
            print("  " + printable(line))
    if not merged["answered"]:
        print(
            f"rankwatch stacks: no rank answered within {args.wait:g} s (ranks answer from rankwatch's agent, "
            "which must be running in the job)",
            file=sys.stderr,
        )
        sys.exit(1)


def _print_power(report) -> None:
    from rich.console import Console
    from rich.table import Table

    from collector.analysis.analyzers.power import SIMULATED
    from collector.quantities import duration, energy, percent, plural, power
    from collector.reports.terminal import markup_safe

    console = Console()
    console.print(
        f"[bold]run {markup_safe(report.run_id)}[/]: {plural(report.steps, 'step')} of "
        f"{plural(report.ranks, 'rank')}; "
        f"policy {markup_safe(report.policy)}" + (f"; [bold]{SIMULATED}[/]" if report.simulated else "")
    )
    source = report.curve[0].source if report.curve else "measured"
    curve = Table(
        "limit",
        "step time",
        "slowdown",
        "energy per step",
        "saving",
        "ZeusCost",
        title=f"time/energy trade-off ({'measured' if source == 'measured' else 'power model'}, ±95%)",
    )
    for p in sorted(report.curve, key=lambda p: -p.cap_w):
        picked = report.job_cap is not None and p.cap_w == report.job_cap.cap_w
        curve.add_row(
            f"{'[bold red]> ' if picked else ''}{power(p.cap_w)}",
            f"{duration(p.step_s)} ± {duration(1.96 * p.step_s_se)}",
            percent(p.slowdown - 1, signed=True),
            f"{energy(p.energy_j)} ± {energy(1.96 * p.energy_j_se)}",
            percent(p.energy_saving),
            f"{p.zeus_cost / 1e3:.1f}k",
        )
    console.print(curve)
    r = report.per_rank
    if r and r.caps:
        caps = Table(
            "rank",
            "limit now",
            "cap",
            "slack",
            "clock",
            "saves per step",
            title=f"per-rank caps: {len(r.caps)} of {plural(len(r.ranks), 'rank')} (steps {r.step_start}-{r.step_end})",
        )
        for c in sorted(r.ranks, key=lambda c: c.cap_w or c.limit_w)[:8]:
            caps.add_row(
                str(c.rank),
                power(c.limit_w),
                f"- ({c.kept_because})" if c.cap_w is None else power(c.cap_w),
                duration(c.slack_s),
                f"{c.clock_mhz:.0f} -> {c.new_clock_mhz:.0f} MHz",
                energy(c.saving_j_per_step),
            )
        console.print(caps)
    _print_findings(report.findings, console)


def cmd_import(args) -> None:
    from rich.progress import Progress

    from collector import private
    from collector.receive.imports import TraceError, store_run
    from collector.receive.imports.flight_recorder import FlightRecorderDumps
    from collector.receive.imports.kineto import KinetoTrace
    from collector.receive.imports.ops import OpTrace
    from collector.reports import postmortem
    from collector.store.db import StoreLocked, connect

    db, paths = _db(args), [Path(p) for p in args.path]
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


def _stop_on_sigterm() -> None:
    """SIGTERM (a service manager, `timeout`, `kill`) stops the command as Ctrl-C does, so that it
    stops what it started (the job's ranks, the collector, the dashboard) instead of orphaning them."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def _check_targets(faults: list, ranks: int, steps: int, stages: int = 1, hosts: int = 1) -> None:
    """Each fault names a rank, stage and host the job has, and a step it reaches: one that does
    not would be silently ignored."""
    job = {"rank": ranks, "stage": stages, "node": hosts, "at": steps, "from": steps, "fail": steps}
    for f in faults:
        for key, count in job.items():
            if f.get(key) is not None and not f.get(key) < count:
                what = "step" if key in ("at", "from", "fail") else key
                raise UsageError(f"{f.spec!r}: {key}={f.get(key)} is not in the job, whose {what}s are 0..{count - 1}")


def _simulating(args) -> None:
    """The job's ranks simulate the GPU they lack with --simulate-gpu, and only then (the environment they
    inherit says so); never because the launcher's own environment happened to."""
    from rankwatch.agent.config import SIMULATE_GPU_ENV

    if args.simulate_gpu:
        os.environ[SIMULATE_GPU_ENV] = "1"
    else:
        os.environ.pop(SIMULATE_GPU_ENV, None)


def cmd_run(args) -> None:
    from rankwatch.agent.config import collector_url

    collector, store, token = collector_url(args.collector), _db(args), _token(args)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("give the job's command after --, e.g. rankwatch run -- torchrun --nproc-per-node 2 train.py")
    _collector_takes(collector, token, unreachable_ok=True)  # before the job starts a rank
    _simulating(args)

    from rankwatch.launch import run

    _stop_on_sigterm()
    try:
        sys.exit(run(command, run_id=args.run, collector=collector, token=token, store=store))
    except FileNotFoundError:
        raise UsageError(f"{command[0]!r}: no such command") from None


def cmd_node(args) -> None:
    """The node's sidecar (rankwatch/agent/node.py) until SIGTERM or Ctrl-C; then what waits is delivered, and what
    could not be is noted where the launcher asked ($RANKWATCH_UNDELIVERED)."""
    from rankwatch.agent.config import UNDELIVERED_ENV, collector_urls
    from rankwatch.agent.node import Node

    collector, token = collector_urls(args.collector), _token(args)
    if os.path.exists(args.socket):
        raise UsageError(f"{args.socket}: already exists (another node's socket?)")
    _stop_on_sigterm()
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


def cmd_train(args) -> None:
    from rankwatch.agent.config import collector_url
    from rankwatch.agent.paths import checkpoint_dir

    collector, store, token = collector_url(args.collector), _db(args), _token(args)
    if args.run is not None:
        try:
            checkpoint_dir(store, args.run)
        except ValueError as e:
            raise UsageError(str(e)) from None
    _collector_takes(collector, token, unreachable_ok=True)  # before torch loads and torchrun starts a rank
    _simulating(args)

    from rankwatch.launch import train
    from trainer.device import DeviceError
    from trainer.faults import TRAINER_KINDS, parse
    from trainer.layout import Layout
    from trainer.model import CONFIGS
    from trainer.offload import Spec
    from trainer.train import SNAPSHOT_EVERY, unfit

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
    _check_targets(faults, args.nproc, args.steps, stages=layout.pp if layout else 1)
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
    _stop_on_sigterm()
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


def cmd_simulate(args) -> None:
    from rich.progress import track

    from trainer import simulate
    from trainer.faults import parse

    pp, tp = args.pp, args.tp
    dp = args.dp or args.ranks // (pp * tp)
    if dp * pp * tp != args.ranks:
        raise UsageError(f"--ranks {args.ranks} is not dp x pp x tp = {dp} x {pp} x {tp}")
    if (args.collector is None) == (args.out is None):
        raise UsageError("give one of --collector URL or --out FILE.parquet")
    _fits_in_memory(args.ranks, to_collector=args.out is None)
    if args.collector:
        from rankwatch.agent import config

        store, exporter_url = _db(args), config.collector_urls(args.collector)
        token = _token(args)  # a bad token: one line now
        _collector_takes(exporter_url, token, unreachable_ok=True)  # a refused one too, before minutes of refusals
    topology = simulate.Topology(dp, pp, tp)
    try:
        faults = [parse(spec, simulate.SIMULATOR_KINDS) for spec in args.inject]
    except ValueError as e:
        raise UsageError(
            str(e)
            .replace("the trainer injects", "the simulator injects")
            .replace("for `rankwatch simulate`", "for `rankwatch train`")
        ) from None
    _check_targets(faults, args.ranks, args.steps, pp, -(-args.ranks // topology.ranks_per_host))
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


def _fits_in_memory(ranks: int, to_collector: bool) -> None:
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


def cmd_dashboard(args) -> None:
    from collector.store.db import StoreLocked, connect
    from dashboard.serve import serve
    from rankwatch.agent.config import collector_url

    _dashboard_port_free(args.port, "--port PORT")
    collector, db = collector_url(args.collector) if args.collector else None, None
    if not collector:
        db = _db(args, existing=True)
        try:
            connect(db, read_only=True).close()
        except StoreLocked as e:
            if args.db:
                raise UsageError(f"{e}, or read it through the collector (--collector URL)") from None
            collector, db = collector_url(), None  # the default store's collector holds it: ask that collector
    if collector:
        token = _token(args)
        _collector_takes(collector, token, unreachable_ok=False, scope=QUERY)  # not a page of "wrong token" later
        if token:
            os.environ[TOKEN_ENV] = token  # read and checked here, handed to the dashboard's process
    serve(args.port, db, collector, (db or _db(args)).parent)


def _dashboard_port_free(port: int, hint: str) -> None:
    """A one-line usage error, before Streamlit starts, when the dashboard's port is taken."""
    from collector.server import check_address
    from dashboard.serve import HOST

    try:
        check_address(HOST, port)
    except OSError as e:
        raise UsageError(f"cannot serve the dashboard on {HOST}:{port}: {e.strerror or e} ({hint})") from None


def cmd_demo(args) -> None:
    from collector.server import Config
    from rankwatch.demo import MIN_STEPS, run

    if args.steps < MIN_STEPS:
        raise UsageError(f"--steps {args.steps}: the demo needs {MIN_STEPS} or more to show its straggler and spike")
    db = _db(args)
    _preflight(Config(db=db, port=args.port))
    if not args.no_dashboard:
        _dashboard_port_free(args.dashboard_port, "--dashboard-port PORT, or --no-dashboard")
    _stop_on_sigterm()
    run(db=db, steps=args.steps, port=args.port, dashboard_port=None if args.no_dashboard else args.dashboard_port)


def _simulate_gpu_option(p) -> None:
    p.add_argument(
        "--simulate-gpu",
        action="store_true",
        help="a rank without a GPU simulates one (its power, clocks and energy, labelled simulated wherever shown); "
        "by default such a rank has no GPU telemetry",
    )


def _reading_options(p: argparse.ArgumentParser) -> None:
    """Where `query` and `runs` read, and how they print it (collector/reports/query.py's FORMATS: named here
    too, since the parser is built before any command and must not load DuckDB)."""
    p.add_argument(
        "--db", help=f"store file ({_DEFAULT_DB}); with --collector, its store, for the token file beside it"
    )
    p.add_argument(
        "--collector",
        metavar="URL",
        help="ask a running collector's query API instead (token: --token-file, $RANKWATCH_TOKEN, else the "
        "token file beside the store)",
    )
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    _token_file_option(p)


def _token_file_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--token-file",
        metavar="PATH",
        help="read the bearer token from this file (unlike a token on the command line, it does not show in ps)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rankwatch", description="Observability and diagnostics for distributed training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("demo", help="collector + a 4-rank job with injected faults, end to end")
    p.add_argument("--steps", type=POSITIVE, default=300)
    p.add_argument("--db", help=f"store file ({_DEFAULT_DB})")
    p.add_argument("--port", type=PORT, default=4318, help="collector port")
    p.add_argument("--dashboard-port", type=PORT, default=8501)
    p.add_argument(
        "--no-dashboard",
        action="store_true",
        help="end with the job, without the dashboard (by default it shows the run live and stays up)",
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("train", help="the reference GPT trainer under torchrun, instrumented")
    p.add_argument("--nproc", type=POSITIVE, default=2, help="ranks on this machine")
    p.add_argument("--steps", type=POSITIVE, default=200)
    p.add_argument("--run", help="run id (default: made from the time)")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="fault, e.g. straggler:rank=2,slowdown=1.3,from=40 (repeatable)",
    )
    p.add_argument("--collector", help="collector URL (default: $RANKWATCH_COLLECTOR, else http://127.0.0.1:4318)")
    p.add_argument(
        "--db",
        help=f"the collector's store file, beside which checkpoints are kept in runs/RUN/checkpoints ({_DEFAULT_DB})",
    )
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
    _simulate_gpu_option(p)
    _token_file_option(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "run", help="an unmodified training command, instrumented: rankwatch run -- torchrun ... train.py"
    )
    p.add_argument("--collector", help="collector URL (default: $RANKWATCH_COLLECTOR, else http://127.0.0.1:4318)")
    p.add_argument("--run", help="run id (default: made from the time)")
    p.add_argument(
        "--db",
        help="the collector's store file, whose token file beside it is the token sent and where its dashboard's "
        f"address is noted ({_DEFAULT_DB})",
    )
    _simulate_gpu_option(p)
    _token_file_option(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the job's command, after --")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "node", help="the node's sidecar: exports what the host's ranks hand it (rankwatch run and train start one)"
    )
    p.add_argument("--socket", required=True, help="the Unix socket the ranks connect to (their $RANKWATCH_NODE)")
    p.add_argument("--collector", help="collector URL (default: $RANKWATCH_COLLECTOR, else http://127.0.0.1:4318)")
    _token_file_option(p)
    p.set_defaults(func=cmd_node)

    p = sub.add_parser("simulate", help="a fleet of simulated ranks (DP x PP x TP) with injected faults")
    p.add_argument("--ranks", type=POSITIVE, required=True)
    p.add_argument("--dp", type=POSITIVE, help="data-parallel replicas (default: ranks / (pp x tp))")
    p.add_argument("--pp", type=POSITIVE, default=1, help="pipeline stages")
    p.add_argument("--tp", type=POSITIVE, default=1, help="tensor-parallel ranks")
    p.add_argument("--steps", type=POSITIVE, required=True)
    p.add_argument("--run", help="run id (default: made from the time)")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="fault, e.g. slow-stage:stage=3,slowdown=1.2 (repeatable)",
    )
    p.add_argument("--collector", help="send OTLP to this collector")
    p.add_argument(
        "--db",
        help="the collector's store file, whose token file beside it is the token sent "
        "(default: --token-file, $RANKWATCH_TOKEN, else ./rankwatch-data's)",
    )
    p.add_argument(
        "--out",
        type=_output_file,
        help="write a Parquet op trace instead (with a hang, it ends before the hang's step)",
    )
    p.add_argument(
        "--hang-for",
        type=_quantity(allow_zero=True),
        default=60.0,
        metavar="SECONDS",
        help="with a hang and --collector: how long the stuck ranks keep sending heartbeats "
        "(default 60, past the collector's default --hang-after of 30)",
    )
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument(
        "--power-caps",
        metavar="FILE.json",
        help="per-rank power limits, {rank: watts} or a `rankwatch power recommend --json` document",
    )
    _token_file_option(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("collector", help="run the OTLP/HTTP collector and store")
    p.add_argument("--db", help=f"store file ({_DEFAULT_DB})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=PORT, default=4318)
    p.add_argument(
        "--token",
        help="bearer token, 16 characters or more (default: $RANKWATCH_TOKEN, else the token file beside the DB)",
    )
    _token_file_option(p)
    p.add_argument("--workers", type=NON_NEGATIVE, help="decode processes (default: one per core; 0: none)")
    p.add_argument(
        "--max-queue-bytes",
        type=POSITIVE,
        default=128 * 2**20,
        help="request bytes (decompressed) waiting for commit before exports get 503 + Retry-After",
    )
    p.add_argument(
        "--writer-memory",
        type=POSITIVE,
        metavar="BYTES",
        help="memory the writer process (commits, analysis, queries) may take past what it maps at start; "
        "past it a query gets 400 and a commit 503 (default 1.5 GiB; raise it for jobs of tens of "
        "thousands of ranks)",
    )
    p.add_argument(
        "--max-reading-bytes",
        type=POSITIVE,
        default=64 * 2**20,
        help="request body bytes being read, all connections together, before exports get 503 + Retry-After",
    )
    p.add_argument(
        "--header-timeout",
        type=_quantity(allow_zero=False),
        default=10.0,
        metavar="SECONDS",
        help="a connection that has not sent its request headers this long is closed (default 10)",
    )
    p.add_argument(
        "--max-connections",
        type=POSITIVE,
        default=4096,
        help="open connections; past it the one waiting longest for its headers is closed (default 4096)",
    )
    p.add_argument(
        "--analyze-every",
        type=_quantity(allow_zero=False),
        default=5.0,
        metavar="SECONDS",
        help="how often the analyzers look at the runs that are sending (default 5)",
    )
    p.add_argument(
        "--hang-after",
        type=_quantity(allow_zero=False),
        default=30.0,
        metavar="SECONDS",
        help="the shortest stall reported as a hang; slower steps stretch it (default 30)",
    )
    p.add_argument(
        "--model",
        metavar="FILE",
        help="a step-time model (`rankwatch model fit`): what each straggler's state explains, and when the "
        "whole job computes slower than predicted",
    )
    p.add_argument(
        "--power-every",
        type=_quantity(allow_zero=True),
        default=60.0,
        metavar="SECONDS",
        help="how often power-cap recommendations are redrawn for the runs whose GPUs report power "
        "(default 60; 0: never)",
    )
    p.add_argument(
        "--no-auto-rollback",
        action="store_true",
        help="report anomalies (NaN, loss spikes) without sending the job a rollback",
    )
    p.add_argument(
        "--rollback-on",
        type=_rollback_kinds,
        default="nan,loss",
        metavar="KINDS",
        help="the anomalies rolled back, of nan, loss and grad (default nan,loss: a gradient-norm spike "
        "alone is reported as a warning)",
    )
    p.add_argument(
        "--alerts",
        metavar="FILE",
        help="alert receivers, TOML or JSON (default: alerts.toml beside the store, if it exists)",
    )
    _lake_options(p, "store into (--db's directory keeps this collector's token and alerts file)")
    p.add_argument(
        "--compact-every",
        type=_quantity(allow_zero=False),
        default=600.0,
        metavar="SECONDS",
        help="with --lake: how often one of the lake's collectors merges its small files and drops what no "
        "snapshot of the last hour reads (default 600)",
    )
    p.add_argument(
        "--retain-days",
        type=_quantity(allow_zero=False),
        metavar="DAYS",
        help="with --lake: telemetry older than this is deleted at each compaction (default: kept)",
    )
    p.set_defaults(func=cmd_collector)

    p = sub.add_parser("token", help="print a token scoped to ingest, query or control, made from the collector's")
    p.add_argument(
        "--scope",
        choices=SCOPES,
        required=True,
        help="ingest: send telemetry and take a run's commands (what a job needs); query: read; control: post "
        "commands, and read",
    )
    p.add_argument("--db", help=f"the collector's store file, the token file beside it the collector's ({_DEFAULT_DB})")
    _token_file_option(p)
    p.set_defaults(func=cmd_token)

    p = sub.add_parser("alerts", help="alert webhooks")
    alerts = p.add_subparsers(dest="alerts_command", required=True, parser_class=_Parser)
    p = alerts.add_parser("test", help="send a signed test alert to --url, or to every configured receiver")
    p.add_argument("--url", help="the receiver to test (default: every receiver in the alerts file)")
    p.add_argument("--secret", help="its Standard Webhooks secret, whsec_<base64>")
    p.add_argument("--alerts", metavar="FILE", help="receivers file (default: alerts.toml beside the store)")
    p.add_argument("--db", help="store file whose directory holds the default alerts file")
    p.set_defaults(func=cmd_alerts_test)

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
    p.add_argument("--db", help=f"store file ({_DEFAULT_DB})")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("analyze", help="the analyzers over a whole run, from a store file (read-only)")
    p.add_argument("run", help="run id")
    p.add_argument("--db", help=f"store file ({_DEFAULT_DB})")
    p.add_argument("--json", action="store_true", help="the report as one JSON document")
    p.add_argument(
        "--heatmap", metavar="FILE.png", type=_output_file, help="also write a rank x step heatmap of compute time"
    )
    p.add_argument(
        "--hang-after",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="least stall judged a hang, as the collector's --hang-after (default 30)",
    )
    p.add_argument(
        "--model",
        metavar="FILE",
        help="a step-time model (`rankwatch model fit`): how much of each straggler's slowdown its state "
        "explains, and whether the whole job computes slower than predicted",
    )
    _lake_options(p, "read the run from")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("model", help="the step-time model: NCPP fitted on stored runs, judged on runs it did not see")
    model = p.add_subparsers(dest="model_command", required=True, parser_class=_Parser)
    p = model.add_parser("fit", help="fit it on stored runs, judge it against its baselines, save it")
    p.add_argument("--run", action="append", required=True, help="a run to learn from (3 or more; repeatable)")
    p.add_argument("--out", required=True, metavar="FILE", type=_output_file, help="where to save the model")
    p.add_argument("--epochs", type=POSITIVE, default=60, help="passes over the rank-steps (default 60)")
    p.add_argument("--db", help=f"store file ({_DEFAULT_DB})")
    _lake_options(p, "read the runs from")
    p.set_defaults(func=cmd_model_fit)

    p = sub.add_parser("power", help="power-cap recommendations")
    power = p.add_subparsers(dest="power_command", required=True, parser_class=_Parser)
    p = power.add_parser(
        "recommend",
        help="power limits for the job and for each rank, and facility headroom, from a store file (read-only)",
    )
    p.add_argument("run", help="run id")
    p.add_argument("--db", help=f"store file ({_DEFAULT_DB})")
    p.add_argument(
        "--policy",
        default="max-slowdown:0.02",
        help="how the job's limit is picked: zeus:ETA, max-slowdown:FRACTION, min-energy or "
        "budget:WATTS (default max-slowdown:0.02)",
    )
    p.add_argument(
        "--facility-watts",
        type=_quantity(allow_zero=False),
        metavar="WATTS",
        help="the power the job's nodes may draw, for the headroom (default: their GPUs' nameplate)",
    )
    p.add_argument("--json", action="store_true", help="the report as one JSON document")
    p.add_argument("--plot", metavar="FILE.png", type=_output_file, help="also draw the time/energy trade-off")
    _lake_options(p, "read the run from")
    p.set_defaults(func=cmd_power_recommend)
    p = power.add_parser("apply", help="send a running job power caps through the collector's control API")
    p.add_argument("run", help="run id")
    p.add_argument(
        "--caps",
        metavar="FILE.json",
        help="per-rank caps: {rank: watts} or a `rankwatch power recommend --json` document",
    )
    p.add_argument(
        "--watts",
        type=_quantity(allow_zero=False),
        help="the cap of every rank --caps leaves out (of all, without --caps)",
    )
    p.add_argument("--collector", help="collector URL (default: $RANKWATCH_COLLECTOR, else http://127.0.0.1:4318)")
    _token_file_option(p)
    p.set_defaults(func=cmd_power_apply)

    p = sub.add_parser(
        "stacks", help="where every rank of a running job is: ask its ranks for their stacks, print them merged"
    )
    p.add_argument("run", help="run id")
    p.add_argument("--ranks", metavar="SPEC", help="the ranks to ask, as 0,3-5 (default: every rank)")
    p.add_argument(
        "--wait",
        type=_quantity(allow_zero=False),
        default=15.0,
        metavar="SECONDS",
        help="how long to wait for every rank's answer (default 15); those that came by then are shown",
    )
    p.add_argument("--json", action="store_true", help="the merged stacks as one JSON document")
    p.add_argument("--collector", help="collector URL (default: $RANKWATCH_COLLECTOR, else http://127.0.0.1:4318)")
    _token_file_option(p)
    p.set_defaults(func=cmd_stacks)

    p = sub.add_parser("query", help="run read-only SQL against a store file, or a running collector")
    p.add_argument("sql", help="one statement (several are refused: only the last one's rows would show)")
    _reading_options(p)
    p.set_defaults(func=cmd_query)

    p = sub.add_parser(
        "runs", help="the runs of a store file, or of a running collector: status, ranks, steps, worst finding"
    )
    _reading_options(p)
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser(
        "nodes", help="a run's nodes, their ranks and health: the unhealthy ones are a scheduler's drain list"
    )
    p.add_argument("run", help="run id")
    p.add_argument("--unhealthy", action="store_true", help="only the nodes to drain")
    p.add_argument("--json", action="store_true", help='one JSON document: {"run", "nodes": [...]}')
    p.add_argument(
        "--db", help=f"store file ({_DEFAULT_DB}); with --collector, its store, for the token file beside it"
    )
    p.add_argument("--collector", metavar="URL", help="ask a running collector's query API instead")
    _lake_options(p, "read")
    _token_file_option(p)
    p.set_defaults(func=cmd_nodes)

    p = sub.add_parser("dashboard", help="the Streamlit dashboard, on loopback")
    p.add_argument(
        "--db",
        help=f"a store file no collector holds, read-only ({_DEFAULT_DB}; through its collector when one holds "
        "it); with --collector, that collector's store, whose token file beside it is the token sent",
    )
    p.add_argument(
        "--collector",
        metavar="URL",
        help="a running collector, through its query API (token: --token-file, $RANKWATCH_TOKEN, else the "
        "token file beside the store); checked at start",
    )
    p.add_argument("--port", type=PORT, default=8501)
    _token_file_option(p)
    p.set_defaults(func=cmd_dashboard)
    return parser


def main(argv: list[str] | None = None) -> None:
    escape_logs()  # its log records may quote stored values, as its errors below may: both printed printable
    try:
        args = build_parser().parse_args(argv)
        args.func(args)
    except UsageError as e:
        print(f"{e.prog}: error: {printable(str(e))}", *[e.context] if e.context else [], sep="\n", file=sys.stderr)
        sys.exit(2)
    except (TokenError, UrlError) as e:  # a bad token file or collector URL, wherever a command read it
        print(f"rankwatch: error: {printable(str(e))}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # the reader stopped early (`rankwatch query ... | head`): nothing is left to say, and the exit
        # flush must not complain either; status 1, as rich's tables (analyze, power) end then
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
