"""Where a rank finds its collector, token and run id: arguments, then the environment,
then the defaults a newcomer gets (which the collector shares). Files: rankwatch/agent/paths.py."""

import base64
import hashlib
import hmac
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

from rankwatch.agent import paths

# The defaults every process of rankwatch shares, set here alone (a module of the standard library and paths.py):
# a rank, its node's sidecar, the collector, the dashboard and the command line read them, so none can disagree.
OTLP_PORT = 4318  # the collector's port: OTLP/HTTP's own
DASHBOARD_PORT = 8501  # the dashboard's port: Streamlit's own
HEARTBEAT_S = 5.0  # how often a rank says which step and phase it is in, between its steps too
HANG_FLOOR_S = 30.0  # the shortest stall judged a hang (slower steps stretch it)
ANALYZE_EVERY_S = 5.0  # how often the collector's analyzers judge each run that is sending
DEFAULT_COLLECTOR = f"http://127.0.0.1:{OTLP_PORT}"
COLLECTOR_ENV, TOKEN_ENV, TOKEN_FILE_ENV = "RANKWATCH_COLLECTOR", "RANKWATCH_TOKEN", "RANKWATCH_TOKEN_FILE"
MIN_TOKEN_CHARS = 16  # shorter is guessable; an empty one is what a crash between creating and writing leaves
# "1": a rank without an NVML GPU simulates one (its samples say so); unset, it has no device telemetry
SIMULATE_GPU_ENV = "RANKWATCH_SIMULATE_GPU"
NODE_ENV = "RANKWATCH_NODE"  # the socket of the node's sidecar (`rankwatch node`), which a rank hands its telemetry
UNDELIVERED_ENV = "RANKWATCH_UNDELIVERED"  # where a rank notes the telemetry it never delivered (rankwatch train)
# torch's Flight Recorder: a ring of each process's last collectives, which a rank's answer to a stacks request
# carries (rankwatch/agent/stacks.py). A job that `rankwatch run` or `train` starts keeps the ring on, at torch
# 2.13's own default size (a torch whose default was 0 records nothing), unless it sets either name itself.
FLIGHT_RECORDER_ENV, FLIGHT_RECORDER_OLD_ENV, FLIGHT_RECORDER_ENTRIES = (
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "2000",
)


def flight_recorder(environ: dict[str, str]) -> dict[str, str]:
    """What a job's environment gets for torch's Flight Recorder: its ring's size where `environ` sets none."""
    if FLIGHT_RECORDER_ENV in environ or FLIGHT_RECORDER_OLD_ENV in environ:
        return {}
    return {FLIGHT_RECORDER_ENV: FLIGHT_RECORDER_ENTRIES}


def simulate_gpu() -> bool:
    """Whether a rank without an NVML GPU simulates one ($RANKWATCH_SIMULATE_GPU, set by `--simulate-gpu`):
    never by default, since a simulated GPU's watts and joules read as hardware's to whoever forgets."""
    return os.environ.get(SIMULATE_GPU_ENV, "") not in ("", "0")


class UrlError(ValueError):
    """A collector address that is no http(s) URL; the message says which and where, in one line."""


def collector_urls(explicit: str | None = None) -> str:
    """Given, $RANKWATCH_COLLECTOR, or the default: one collector URL, or several comma-separated (the
    collectors of one lake: a rank sends to one of them, rankwatch/agent/route.py); each checked (`checked_url`),
    so that a typo is one line here rather than a connection error from deep inside a client."""
    given, where = (explicit, "--collector") if explicit else (os.environ.get(COLLECTOR_ENV), f"${COLLECTOR_ENV}")
    if not given:
        return DEFAULT_COLLECTOR
    return ",".join(checked_url(url, where) for url in given.split(","))


def collector_url(explicit: str | None = None) -> str:
    """The first of `collector_urls`: the collector a command asks (any collector of a lake answers for
    all of it)."""
    return collector_urls(explicit).split(",")[0]


def checked_url(url: str, where: str) -> str:
    """`url` without its trailing slash, or UrlError unless it is http:// or https://, a host, an optional port
    and an optional path (a collector behind a proxy's prefix)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # ValueError when not a number in 0..65535
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise UrlError(f"{where} {url!r} is not a collector URL such as {DEFAULT_COLLECTOR}")
    if parts.query or parts.fragment:
        raise UrlError(f"{where} {url!r}: a collector URL has no ?query or #fragment")
    return url.strip().rstrip("/")


class TokenError(ValueError):
    """A token that must not be used (empty, short, unreadable); the message says which and where, in one line."""


class TokenRefused(TokenError):
    """The collector answered 401 or 403 to the token: nothing sent with it would be stored."""


# What a token may do. The collector's own token may do all of it; a scoped token, one scope's share:
# INGEST sends telemetry and takes its run's commands (polls them, reports how they went), what a job's
# processes need; QUERY reads (the query API, the commands); CONTROL posts commands, and reads, since
# a command is decided on what is read (`rankwatch power apply` checks the run first).
INGEST, QUERY, CONTROL = "ingest", "query", "control"
SCOPES = (INGEST, QUERY, CONTROL)
# Every token rankwatch makes starts so, for secret scanners to spot (and never with "-", which a command
# line would read as an option): the collector's as rw_<random>, a scoped one as rw_<scope>_<MAC>.
TOKEN_PREFIX = "rw_"


def scoped_token(token: str, scope: str) -> str:
    """The token of `scope` made from the collector's own `token`: an HMAC-SHA256 keyed by it, so that
    only a holder of the collector's token can make one, every collector taking that token (a lake's)
    takes it, and a new collector token revokes every scoped one."""
    mac = hmac.new(token.encode(), f"rankwatch {scope} token".encode(), hashlib.sha256).digest()
    return f"{TOKEN_PREFIX}{scope}_{base64.urlsafe_b64encode(mac).decode().rstrip('=')}"


def token_scope(token: str) -> str | None:
    """The scope of a scoped token; None for a collector's own token."""
    return next((scope for scope in SCOPES if token.startswith(f"{TOKEN_PREFIX}{scope}_")), None)


def checked_token(token: str, where: str) -> str:
    """`token` stripped, or TokenError when it is too short to be a secret."""
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(
            f"the token in {where} is {'empty' if not token else f'{len(token)} characters'}; it needs at least "
            f"{MIN_TOKEN_CHARS}"
        )
    return token


def read_token(path: str | os.PathLike) -> str:
    """The token in file `path`, checked; TokenError when it cannot be read or is empty or short."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise TokenError(f"cannot read the token file {path}: {e.strerror or e}") from None
    return checked_token(text, str(path))


def token(
    explicit: str | None = None, file: str | os.PathLike | None = None, store: str | Path | None = None
) -> str | None:
    """The token a client sends: given, read from `file`, $RANKWATCH_TOKEN, read from $RANKWATCH_TOKEN_FILE, or
    the token file beside `store` (default: the default store) if there is one. A file's token is checked
    (TokenError), so a truncated file is reported rather than sent as an empty token."""
    if explicit:
        return explicit
    if not file and os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if file := file or os.environ.get(TOKEN_FILE_ENV):
        return read_token(file)
    path = paths.store_path(store).parent / paths.TOKEN_FILE
    return read_token(path) if path.exists() else None


def run_id(explicit: str | None = None) -> str:
    """Given, $RANKWATCH_RUN_ID, torchrun's rendezvous id, or one made from the time."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    return (
        explicit
        or os.environ.get("RANKWATCH_RUN_ID")
        or (elastic if elastic not in (None, "", "none") else None)
        or time.strftime("run-%Y%m%d-%H%M%S")
    )
