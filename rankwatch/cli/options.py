"""The options several commands take, each defined here once, and the types that check their values.

A value is checked where argparse reads it, by the same type function for every command that takes the
option, so bad input is one line (`UsageError`) before any work. An option that sets a field of the
collector's Config (collector/config.py) has no default or help of its own: both are the field's.
"""

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn, TypeAlias

from rankwatch.agent.config import COLLECTOR_ENV, DASHBOARD_PORT, DEFAULT_COLLECTOR
from rankwatch.agent.paths import DB_ENV, DEFAULT_DB


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2; `context`, lines printed under it as they
    are (already printable: where in the SQL DuckDB refused it, collector/reports/query.py)."""

    def __init__(self, message: str, prog: str = "rankwatch", context: str | None = None):
        super().__init__(message)
        self.prog = prog
        self.context = context


class Parser(argparse.ArgumentParser):
    """A command's parser: its errors are usage errors, and the help of an option drawn from a config
    dataclass is read from it only when help is printed (`config_field`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.drawn_help: dict[argparse.Action, Callable[[], str]] = {}

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.prog)

    def format_help(self) -> str:
        for action, drawn in self.drawn_help.items():
            action.help = drawn()
        return super().format_help()


Commands: TypeAlias = "argparse._SubParsersAction[Parser]"  # where each command module adds its subcommands


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
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


def _quantity(allow_zero: bool) -> Callable[[str], float]:
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
QUANTITY, QUANTITY_OR_ZERO = _quantity(allow_zero=False), _quantity(allow_zero=True)


def output_file(text: str) -> str:
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


DEFAULT_STORE = f"default: {DEFAULT_DB}, or ${DB_ENV}"
TOKEN_BESIDE = "with --collector, its store, for the token file beside it"  # --db beside --collector
SENDS_TO = f"collector URL (default: ${COLLECTOR_ENV}, else {DEFAULT_COLLECTOR})"  # --collector of what sends


def db(p: argparse.ArgumentParser, what: str = "store file", then: str = "") -> None:
    """--db, the store file (checked by rankwatch/cli/checks.py's `store`): `what` it is to the command, then
    the default, then what else it is for."""
    p.add_argument("--db", help=f"{what} ({DEFAULT_STORE}){then}")


def collector(p: argparse.ArgumentParser, what: str = SENDS_TO) -> None:
    """--collector, a collector's URL (checked by rankwatch/agent/config.py's `collector_url`)."""
    p.add_argument("--collector", metavar="URL", help=what)


def token_file(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--token-file",
        metavar="PATH",
        help="read the bearer token from this file (unlike a token on the command line, it does not show in ps)",
    )


def lake(p: argparse.ArgumentParser, what: str) -> None:
    """--lake and --data-path, which go together (checked by rankwatch/cli/checks.py's `lake`)."""
    p.add_argument(
        "--lake",
        metavar="CATALOG",
        help=f"{what} a lake shared by several collectors, whose catalog is this PostgreSQL database "
        "(a libpq connection string: 'host=H port=P dbname=D user=U' or postgresql://U@H:P/D; its password "
        "from ~/.pgpass or $PGPASSWORD, never here)",
    )
    p.add_argument("--data-path", metavar="DIR", help="with --lake: the directory of the lake's Parquet files")


def output_format(p: argparse.ArgumentParser) -> None:
    """--format of a listing (collector/reports/query.py's FORMATS: named here too, since the parser is built
    before any command and must not load DuckDB)."""
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")


def as_json(p: argparse.ArgumentParser, what: str = "the report as one JSON document") -> None:
    p.add_argument("--json", action="store_true", help=what)


def run_id(p: argparse.ArgumentParser) -> None:
    """--run of a command that starts a run."""
    p.add_argument("--run", help="run id (default: made from the time)")


def faults(p: argparse.ArgumentParser, example: str) -> None:
    """--inject of a command that runs a job, repeatable (trainer/faults.py parses each)."""
    p.add_argument("--inject", action="append", default=[], metavar="SPEC", help=f"fault, e.g. {example} (repeatable)")


def step_model(p: argparse.ArgumentParser, what: str) -> None:
    """--model, a step-time model file (`rankwatch model fit`; checked by rankwatch/cli/checks.py)."""
    p.add_argument("--model", metavar="FILE", help=f"a step-time model (`rankwatch model fit`): {what}")


def dashboard_port(p: argparse.ArgumentParser, flag: str = "--port") -> None:
    p.add_argument(flag, type=PORT, default=DASHBOARD_PORT, help=f"the dashboard's port (default {DASHBOARD_PORT})")


def plain(value: object) -> str:
    """A default as a user types it: 5.0 as 5."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def binary_size(size: int) -> str:
    """A size in bytes in the largest binary unit it fills: 134217728 as 128 MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} bytes"


def config_field(
    p: Parser, flag: str, name: str, shown: Callable[[Any], str] = plain, note: str = "", **kwargs: Any
) -> None:
    """An option that sets field `name` of the collector's Config: left out, the field's default stands, so the
    command line keeps no copy of it; its help is the field's one-line doc and default (`shown` as text, with
    `note` on how the option says it), read from Config only when help is printed, since Config's module loads
    the whole collector, which `rankwatch train` or `query` must not wait for."""
    action = p.add_argument(flag, dest=name, default=argparse.SUPPRESS, **kwargs)
    p.drawn_help[action] = lambda: _config_help(name, shown, note)
    p.set_defaults(config_fields=(*(p.get_default("config_fields") or ()), name))


def _config_help(name: str, shown: Callable[[Any], str], note: str) -> str:
    from collector.config import Config

    (field,) = (f for f in fields(Config) if f.name == name)
    told = [note] if note else []
    if field.default is not None:  # where it is None, the doc says what unset means
        told.append(f"default {shown(field.default)}")
    return f"{field.metadata['doc']} ({'; '.join(told)})" if told else field.metadata["doc"]


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The Config fields whose options (`config_field`) the command line gave, with their values."""
    return {name: getattr(args, name) for name in getattr(args, "config_fields", ()) if name in args}


def hang_after(p: Parser) -> None:
    """--hang-after: the collector's hang floor, which `rankwatch analyze` judges a stored run by too."""
    config_field(p, "--hang-after", "hang_after_s", type=QUANTITY, metavar="SECONDS")
