"""The analysis of stored runs: `rankwatch analyze` (a run's report and findings), `rankwatch nodes` (its nodes'
health) and `rankwatch model fit` (the step-time model), and how their reports and findings are printed."""

import argparse
from pathlib import Path

from rankwatch.cli import checks, options
from rankwatch.cli.options import POSITIVE, UsageError


def ranks_text(ranks: list[int]) -> str:
    """Ranks as ranges (0-3,8), or - for none."""
    from collector import ranksets

    return ranksets.compact(ranks) or "-"


def cmd_analyze(args: argparse.Namespace) -> None:
    import json
    from dataclasses import asdict

    from collector.analysis.analyzers import hangs
    from collector.reports.postmortem import analyze_run
    from collector.store.db import StoreLocked
    from collector.store.runs import UnknownRun

    model = checks.step_model(args.model) if args.model else None
    hang_settings = hangs.Settings(floor_s=args.hang_after_s) if "hang_after_s" in args else hangs.Settings()
    try:
        con = checks.reader(args)
        report = analyze_run(con, args.run, hang_settings=hang_settings, model=model)
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
        print_findings(report.findings, console)
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
    print_findings(report.findings, console)


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


def _counted(found: list) -> str:
    """ "2 findings, 1 recommendation": what went wrong apart from advice (severity info, such as power caps)."""
    from collector.findings import NOT_JUDGED

    advice = sum(f.severity == "info" and f.kind != NOT_JUDGED for f in found)
    problems = len(found) - advice
    told = f"{problems} finding{'s' * (problems != 1)}"
    return told + (f", {advice} recommendation{'s' * (advice != 1)}" if advice else "")


def print_findings(found: list, console) -> None:
    from rich.table import Table

    from collector.findings import NOT_JUDGED
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
        findings.add_row(*map(markup_safe, (f.analyzer, f.kind, ranks_text(f.ranks), steps, f.severity, f.summary)))
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


def cmd_nodes(args: argparse.Namespace) -> None:
    import json
    from urllib.parse import quote

    from collector.reports import nodes, queryapi
    from collector.store.db import StoreLocked

    if args.collector:
        from rankwatch.agent.apiclient import ApiClient, ApiError
        from rankwatch.agent.config import collector_url

        token = checks.sent_token(args)
        path = queryapi.NODES_PATH.replace("{run_id:path}", quote(args.run, safe=""))
        try:
            listed = ApiClient(collector_url(args.collector), token).get(path, {"unhealthy": str(int(args.unhealthy))})
        except ApiError as e:
            raise (checks.refused(e, token) if e.status in (401, 403) else UsageError(str(e))) from None
    else:
        try:
            listed = nodes.read(checks.reader(args), args.run, args.unhealthy)
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
            *map(markup_safe, (str(node["host"]), ranks_text(node["ranks"]), node["state"])),
            "-" if since is None else str(since),
            "-" if score is None else f"{score:.1f}",
            markup_safe(apart) or "-",
        )
    console.print(table)


def cmd_model_fit(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from collector.predict.stepmodel import TooLittleData, fit
    from collector.store.db import StoreLocked

    try:
        fitted = fit(checks.reader(args), args.run, epochs=args.epochs)
    except (StoreLocked, TooLittleData) as e:
        raise UsageError(str(e)) from None
    fitted.save(Path(args.out))
    console = Console()
    table = Table("predictor", "MAPE %", "P90 %", "within 5%", "R² (log)", title="each run held out in turn")
    for name, m in fitted.figures.items():
        table.add_row(name, f"{m['mape']:.1f}", f"{m['p90']:.1f}", f"{m['within5']:.0%}", f"{m['r2_log']:.3f}")
    console.print(table)
    print(f"saved {args.out}: {fitted.verdict}")


def add_analyze(sub: options.Commands) -> None:
    p = sub.add_parser("analyze", help="the analyzers over a whole run, from a store file (read-only)")
    p.add_argument("run", help="run id")
    options.db(p)
    options.as_json(p)
    p.add_argument(
        "--heatmap",
        metavar="FILE.png",
        type=options.output_file,
        help="also write a rank x step heatmap of compute time",
    )
    options.hang_after(p)
    options.step_model(
        p,
        "how much of each straggler's slowdown its state explains, and whether the whole job computes slower "
        "than predicted",
    )
    options.lake(p, "read the run from")
    p.set_defaults(func=cmd_analyze)


def add_model(sub: options.Commands) -> None:
    p = sub.add_parser("model", help="the step-time model: NCPP fitted on stored runs, judged on runs it did not see")
    model = p.add_subparsers(dest="model_command", required=True, parser_class=options.Parser)
    p = model.add_parser("fit", help="fit it on stored runs, judge it against its baselines, save it")
    p.add_argument("--run", action="append", required=True, help="a run to learn from (3 or more; repeatable)")
    p.add_argument("--out", required=True, metavar="FILE", type=options.output_file, help="where to save the model")
    p.add_argument("--epochs", type=POSITIVE, default=60, help="passes over the rank-steps (default 60)")
    options.db(p)
    options.lake(p, "read the runs from")
    p.set_defaults(func=cmd_model_fit)


def add_nodes(sub: options.Commands) -> None:
    p = sub.add_parser(
        "nodes", help="a run's nodes, their ranks and health: the unhealthy ones are a scheduler's drain list"
    )
    p.add_argument("run", help="run id")
    p.add_argument("--unhealthy", action="store_true", help="only the nodes to drain")
    options.as_json(p, 'one JSON document: {"run", "nodes": [...]}')
    options.db(p, then=f"; {options.TOKEN_BESIDE}")
    options.collector(p, "ask a running collector's query API instead")
    options.lake(p, "read")
    options.token_file(p)
    p.set_defaults(func=cmd_nodes)
