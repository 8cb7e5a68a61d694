"""`rankwatch` command line: one subcommand per public job, a module per group of them (serving, launching,
simulation, imports, demo, reading, analysis, power), the options they share in `options`, the checks they
share in `checks`.

Bad input ends in a one-line `rankwatch: error: ...` on stderr and exit 2.
Subcommands import their machinery lazily, so `rankwatch train` never loads
duckdb and `rankwatch query` never loads torch.
"""

import os
import sys

from collector.printable import escape_logs, printable
from rankwatch.agent.config import TokenError, UrlError
from rankwatch.cli import analysis, demo, imports, launching, power, reading, serving, simulation
from rankwatch.cli.options import Parser, UsageError


def build_parser() -> Parser:
    parser = Parser(prog="rankwatch", description="Observability and diagnostics for distributed training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (  # in the order `rankwatch --help` lists them
        demo.add_demo,
        launching.add_train,
        launching.add_run,
        launching.add_node,
        simulation.add_simulate,
        serving.add_collector,
        serving.add_token,
        serving.add_alerts,
        imports.add_import,
        analysis.add_analyze,
        analysis.add_model,
        power.add_power,
        reading.add_stacks,
        reading.add_query,
        reading.add_runs,
        analysis.add_nodes,
        serving.add_dashboard,
    ):
        add(sub)
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
