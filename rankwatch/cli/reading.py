"""Reading what is stored or happening: `rankwatch query` (read-only SQL), `rankwatch runs` (the runs and their
status), from a store file or a running collector, and `rankwatch stacks` (where every rank of a running job is)."""

import argparse
import sys
import time

from collector.printable import printable
from rankwatch.cli import checks, options
from rankwatch.cli.analysis import ranks_text
from rankwatch.cli.options import QUANTITY, UsageError

_RUNNING = """SELECT (SELECT list(rank ORDER BY rank) FROM ranks WHERE run_id = $run),
                      (SELECT count(DISTINCT rank) FROM events WHERE run_id = $run AND event = $ended),
                      greatest((SELECT epoch_ns(max(ts)) FROM events WHERE run_id = $run),
                               (SELECT epoch_ns(max(end_ts)) FROM steps WHERE run_id = $run))"""
STACKS_POLL_S = 0.5  # how often `rankwatch stacks` looks for the answers


def _answer(args: argparse.Namespace, sql: str) -> dict:
    """The query API's answer to `sql`, from the collector of --collector or else the store file of --db."""
    from collector.reports.query import QueryError, ask, run_sql
    from collector.store.db import StoreLocked
    from rankwatch.agent.config import collector_url

    try:
        if args.collector:
            return ask(collector_url(args.collector), checks.sent_token(args), sql)
        return run_sql(checks.store(args, existing=True), sql)
    except QueryError as e:
        raise UsageError(str(e), context=e.context) from None
    except StoreLocked as e:
        raise UsageError(str(e)) from None


def cmd_query(args: argparse.Namespace) -> None:
    from collector.reports.query import write

    answer = _answer(args, args.sql)
    if answer["truncated"]:
        print(f"rankwatch query: the first {len(answer['rows'])} rows only (the query API's cap)", file=sys.stderr)
    write(answer["columns"], answer["rows"], args.format, types=answer["types"])


def cmd_runs(args: argparse.Namespace) -> None:
    import pandas as pd

    from collector.reports.query import write
    from collector.reports.runs import listing
    from dashboard.queries import RUNS
    from dashboard.source import to_frame

    # read through a collector, a run may be running now; a store file open here is one no collector writes
    runs = listing(to_frame(_answer(args, RUNS)), live=bool(args.collector), at=pd.Timestamp.now(tz="UTC"))
    write(list(runs.columns), list(runs.itertuples(index=False)), args.format)


def cmd_stacks(args: argparse.Namespace) -> None:
    import json
    from urllib.parse import quote

    from collector import ranksets
    from collector.analysis import stacks
    from collector.reports import queryapi
    from rankwatch.agent import semconv as sc
    from rankwatch.agent.apiclient import ApiClient, ApiError
    from rankwatch.agent.config import collector_url

    url, token = collector_url(args.collector), checks.sent_token(args)
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
        raise UsageError(f"run {args.run} has no {ranksets.phrase(missing)} (its ranks: {ranks_text(known)})")
    checks.check_running(args.run, known, ended, last_ns, "its ranks would never answer", "answer a stacks request")
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
        raise (checks.refused(e, token) if e.status in (401, 403) else UsageError(str(e))) from None
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


def _reading_options(p: argparse.ArgumentParser) -> None:
    """Where `query` and `runs` read, and how they print it."""
    options.db(p, then=f"; {options.TOKEN_BESIDE}")
    options.collector(
        p,
        "ask a running collector's query API instead (token: --token-file, $RANKWATCH_TOKEN, else the "
        "token file beside the store)",
    )
    options.output_format(p)
    options.token_file(p)


def add_stacks(sub: options.Commands) -> None:
    p = sub.add_parser(
        "stacks", help="where every rank of a running job is: ask its ranks for their stacks, print them merged"
    )
    p.add_argument("run", help="run id")
    p.add_argument("--ranks", metavar="SPEC", help="the ranks to ask, as 0,3-5 (default: every rank)")
    p.add_argument(
        "--wait",
        type=QUANTITY,
        default=15.0,
        metavar="SECONDS",
        help="how long to wait for every rank's answer (default 15); those that came by then are shown",
    )
    options.as_json(p, "the merged stacks as one JSON document")
    options.collector(p)
    options.token_file(p)
    p.set_defaults(func=cmd_stacks)


def add_query(sub: options.Commands) -> None:
    p = sub.add_parser("query", help="run read-only SQL against a store file, or a running collector")
    p.add_argument("sql", help="one statement (several are refused: only the last one's rows would show)")
    _reading_options(p)
    p.set_defaults(func=cmd_query)


def add_runs(sub: options.Commands) -> None:
    p = sub.add_parser(
        "runs", help="the runs of a store file, or of a running collector: status, ranks, steps, worst finding"
    )
    _reading_options(p)
    p.set_defaults(func=cmd_runs)
