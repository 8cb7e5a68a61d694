"""Power caps: `rankwatch power recommend` (from a stored run) and `rankwatch power apply` (to a running job,
through the collector's control API)."""

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rankwatch.cli import checks, options
from rankwatch.cli.analysis import print_findings, ranks_text
from rankwatch.cli.options import QUANTITY, UsageError

if TYPE_CHECKING:
    from rankwatch.agent.apiclient import ApiClient


def cmd_power_recommend(args: argparse.Namespace) -> None:
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
        con = checks.reader(args)
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
    print_findings(report.findings, console)


def cmd_power_apply(args: argparse.Namespace) -> None:
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
    api = ApiClient(collector_url(args.collector), checks.sent_token(args))
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
    checks.check_running(run_id, ranks, ended, last_ns)
    caps = body.get("caps")
    if not isinstance(caps, dict):
        caps = {}
    targets = [(f"rank {r}", r, w) for r, w in caps.items()] + (
        [("every other rank", None, body["watts"])] if "watts" in body else []
    )
    for name, rank, watts in targets:
        if rank is not None and str(rank).isdigit() and int(rank) not in ranks:
            raise UsageError(f"run {run_id} has no rank {rank} (its ranks: {ranks_text(ranks)})")
        if isinstance(watts, (int, float)) and low is not None and high is not None and not low <= watts <= high:
            raise UsageError(f"{watts:g} W for {name} is outside the {low:g}-{high:g} W its GPUs accept")


def add_power(sub: options.Commands) -> None:
    p = sub.add_parser("power", help="power-cap recommendations")
    power = p.add_subparsers(dest="power_command", required=True, parser_class=options.Parser)
    p = power.add_parser(
        "recommend",
        help="power limits for the job and for each rank, and facility headroom, from a store file (read-only)",
    )
    p.add_argument("run", help="run id")
    options.db(p)
    p.add_argument(
        "--policy",
        default="max-slowdown:0.02",
        help="how the job's limit is picked: zeus:ETA, max-slowdown:FRACTION, min-energy or "
        "budget:WATTS (default max-slowdown:0.02)",
    )
    p.add_argument(
        "--facility-watts",
        type=QUANTITY,
        metavar="WATTS",
        help="the power the job's nodes may draw, for the headroom (default: their GPUs' nameplate)",
    )
    options.as_json(p)
    p.add_argument("--plot", metavar="FILE.png", type=options.output_file, help="also draw the time/energy trade-off")
    options.lake(p, "read the run from")
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
        type=QUANTITY,
        help="the cap of every rank --caps leaves out (of all, without --caps)",
    )
    options.collector(p)
    options.token_file(p)
    p.set_defaults(func=cmd_power_apply)
