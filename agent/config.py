"""Where a rank finds its collector, token and run id: arguments, then the environment,
then the defaults a newcomer gets (which the collector shares). Files: agent/paths.py."""

import os
import time
from pathlib import Path

from agent import paths

DEFAULT_COLLECTOR = "http://127.0.0.1:4318"
TOKEN_ENV, TOKEN_FILE_ENV = "RANKWATCH_TOKEN", "RANKWATCH_TOKEN_FILE"
MIN_TOKEN_CHARS = 16  # shorter is guessable; an empty one is what a crash between creating and writing leaves
UNDELIVERED_ENV = "RANKWATCH_UNDELIVERED"  # where a rank notes the telemetry it never delivered (rankwatch train)


def collector_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("RANKWATCH_COLLECTOR") or DEFAULT_COLLECTOR


class TokenError(ValueError):
    """A token that must not be used (empty, short, unreadable); the message says which and where, in one line."""


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
