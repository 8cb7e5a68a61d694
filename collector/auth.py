"""The bearer token that guards ingest, control and query endpoints."""

import hmac
import os
import secrets
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse

from agent.config import TOKEN_FILE


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


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries the token (constant-time compare)."""
    scheme, _, presented = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token.encode())


def refused(request: Request, token: str) -> JSONResponse | None:
    """The JSON APIs' 401 for a request without the token, before anything of it is read; None
    for one with it."""
    if authorized(request.headers.get("authorization"), token):
        return None
    return JSONResponse({"error": "missing or wrong bearer token"}, 401, {"WWW-Authenticate": "Bearer"})
