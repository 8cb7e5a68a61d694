"""The bearer token that guards ingest, control and query endpoints: made once, checked in one place
(`refusal`), whichever endpoint and answer format."""

import hmac
import os
import secrets
import tempfile
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse

from agent.config import TokenError, read_token
from agent.paths import TOKEN_FILE

TOKEN_PREFIX = "rw_"


def load_or_create_token(data_dir: Path) -> str:
    """The token stored beside the DB, checked (agent.config.TokenError when empty or short), or made on
    first start: written whole to a private temporary file and linked into place, so a crash or a full
    disk never leaves an empty token file behind."""
    path = data_dir / TOKEN_FILE
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        try:
            return read_token(path)
        except TokenError as e:  # left by an older collector, or written by hand
            raise TokenError(f"{e} (remove it, and the collector writes a new one)") from None
    # the prefix names it to secret scanners, and a token never starts with "-", which a command line
    # (`--token -x...`) would read as an option
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    fd, temporary = tempfile.mkstemp(prefix=f".{TOKEN_FILE}-", dir=data_dir)  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.link(temporary, path)  # never replaces: of two first starts, the one that links first wins
    except FileExistsError:
        return read_token(path)
    finally:
        os.unlink(temporary)
    return token


CHALLENGE = {"WWW-Authenticate": "Bearer"}  # every 401's header: how to authenticate


def refusal(request: Request, token: str) -> str | None:
    """None when the request's Authorization header carries the token (constant-time compare); else
    the reason of its 401, which every endpoint answers before reading anything of the request."""
    scheme, _, presented = (request.headers.get("authorization") or "").partition(" ")
    presented = presented.strip()
    if scheme.lower() == "bearer" and presented and token and hmac.compare_digest(presented.encode(), token.encode()):
        return None
    return "missing or wrong bearer token"


def refused(request: Request, token: str) -> JSONResponse | None:
    """The JSON APIs' 401 for a request without the token; None for one with it."""
    reason = refusal(request, token)
    return None if reason is None else JSONResponse({"error": reason}, 401, CHALLENGE)
