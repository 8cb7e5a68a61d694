"""The bearer tokens that guard ingest, control and query endpoints: the collector's own, made once,
and the scoped tokens made from it (agent.config.scoped_token); checked in one place (`Tokens.refusal`),
whichever endpoint and answer format."""

import hmac
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse

from rankwatch.agent.config import (
    CONTROL,
    QUERY,
    SCOPES,
    TOKEN_PREFIX,
    TokenError,
    read_token,
    scoped_token,
    token_scope,
)
from rankwatch.agent.paths import TOKEN_FILE


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
# What each scope's token may do: its own scope's requests, and control's those of query too.
_GRANTS = {scope: frozenset({scope, QUERY} if scope == CONTROL else {scope}) for scope in SCOPES}


@dataclass(frozen=True)
class Refusal:
    """A request refused before anything of it is read: 401 for a token the collector does not take,
    403 for one without the scope the request needs (RFC 6750's insufficient_scope); one line of reason."""

    status: int
    reason: str
    headers: dict[str, str]


class Tokens:
    """The tokens a collector takes: its own, which may do everything, and each scope's, made from it."""

    def __init__(self, token: str):
        """TokenError when `token` is itself a scoped token: a collector holding one would take every scope's
        token made from it, and so raise a scoped token's holder to all of them. An empty `token` takes none."""
        if scope := token_scope(token):
            raise TokenError(
                f"the collector's token is scoped to {scope} (`rankwatch token` made it); give the collector "
                "the token scoped ones are made from"
            )
        self._known = (
            [(token.encode(), frozenset(SCOPES))] + [(scoped_token(token, s).encode(), _GRANTS[s]) for s in SCOPES]
            if token
            else []
        )

    def scopes(self, request: Request) -> frozenset[str] | None:
        """The scopes of the request's bearer token; None when it carries none the collector takes (an
        empty one never passes). Every token is compared, each in constant time."""
        scheme, _, presented = (request.headers.get("authorization") or "").partition(" ")
        given = presented.strip().encode()
        if scheme.lower() != "bearer" or not given:
            return None
        granted = None
        for known, scopes in self._known:
            if hmac.compare_digest(given, known):
                granted = scopes
        return granted

    def refusal(self, request: Request, *needs: str) -> Refusal | None:
        """None when the request's token has one of the scopes `needs`; else why it is refused."""
        granted = self.scopes(request)
        if granted is None:
            return Refusal(401, "missing or wrong bearer token", CHALLENGE)
        if granted & set(needs):
            return None
        return Refusal(
            403,
            f"{request.method} {request.url.path} takes a token with the {' or '.join(needs)} scope, or the "
            f"collector's own; this token is scoped to {' and '.join(sorted(granted))}",
            {"WWW-Authenticate": f'Bearer error="insufficient_scope", scope="{" ".join(needs)}"'},
        )

    def refused(self, request: Request, *needs: str) -> JSONResponse | None:
        """The JSON APIs' 401 or 403 for a request without a token of one of the scopes `needs`; None for one
        with it."""
        refusal = self.refusal(request, *needs)
        return None if refusal is None else JSONResponse({"error": refusal.reason}, refusal.status, refusal.headers)
