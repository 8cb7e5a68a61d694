"""The bearer token that guards ingest, control and query endpoints: made once, checked in one place
(`refusal`), whichever endpoint and answer format."""

import hmac
import os
import secrets
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse

from agent.paths import TOKEN_FILE


def load_or_create_token(data_dir: Path) -> str:
    """The token stored beside the DB, created (mode 0600) on first start."""
    path = data_dir / TOKEN_FILE
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


CHALLENGE = {"WWW-Authenticate": "Bearer"}  # every 401's header: how to authenticate


def refusal(request: Request, token: str) -> str | None:
    """None when the request's Authorization header carries the token (constant-time compare); else
    the reason of its 401, which every endpoint answers before reading anything of the request."""
    scheme, _, presented = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token.encode()):
        return None
    return "missing or wrong bearer token"


def refused(request: Request, token: str) -> JSONResponse | None:
    """The JSON APIs' 401 for a request without the token; None for one with it."""
    reason = refusal(request, token)
    return None if reason is None else JSONResponse({"error": reason}, 401, CHALLENGE)
