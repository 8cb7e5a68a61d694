"""The client of the collector's JSON APIs (control, query, /healthz): the bearer token, JSON in and
out, a time limit on every call, and one error that says in a line why a call failed. The agent's
command poller, the command line, the dashboard and the query CLI all call the collector through
it. A leaf: the standard library only, so the agent imports it without loading anything else.
"""

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

TIMEOUT_S = 30.0  # a call's default time limit: the collector answers in milliseconds unless the host is stuck


class ApiError(Exception):
    """A call that failed, as one line. `status`: the HTTP status the collector refused it with (the
    message is then the API's own reason), or None when no answer came (`kind` then names why:
    the exception's type, e.g. ConnectionRefusedError or TimeoutError)."""

    def __init__(self, message: str, status: int | None = None, kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.kind = f"HTTP {status}" if status is not None else kind or "error"


class ApiClient:
    """Calls to one collector (`url`, e.g. http://127.0.0.1:4318) with its token (None: no header).
    Safe to share between threads: every call is a request of its own."""

    def __init__(self, url: str, token: str | None, timeout_s: float = TIMEOUT_S):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Accept": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})

    def get(self, path: str, params: dict[str, str] | None = None, timeout_s: float | None = None) -> Any:
        """GET `path` (with `params` as its query string): the answer's JSON."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return self._call("GET", path + query, None, timeout_s)

    def post(self, path: str, body: Any, timeout_s: float | None = None) -> Any:
        """POST `body` as JSON to `path`: the answer's JSON."""
        try:
            data = json.dumps(body, allow_nan=False).encode()
        except (TypeError, ValueError) as e:  # NaN, Infinity or an object JSON has no form for
            raise ApiError(f"cannot send {body!r:.80} as JSON: {e}", kind="not JSON") from None
        return self._call("POST", path, data, timeout_s)

    def _call(self, method: str, path: str, data: bytes | None, timeout_s: float | None) -> Any:
        headers = self._headers | ({"Content-Type": "application/json"} if data is not None else {})
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s if timeout_s is None else timeout_s) as answer:
                body = answer.read()
        except urllib.error.HTTPError as e:
            raise ApiError(_reason(e), e.code) from None
        except (OSError, ValueError, http.client.HTTPException) as e:  # refused, unreachable, timed out, cut off
            cause = e.reason if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException) else e
            raise ApiError(
                f"cannot reach the collector at {self.url}: {type(cause).__name__}: {cause}", kind=type(cause).__name__
            ) from None
        try:
            return json.loads(body)
        except ValueError:
            raise ApiError(
                f"the collector at {self.url} answered {method} {path.partition('?')[0]} with "
                f"something other than JSON: {body[:80]!r}",
                kind="not JSON",
            ) from None


def _reason(error: urllib.error.HTTPError) -> str:
    """A refusal's reason: the API's {"error": ...}, else its status and first words."""
    try:
        body = error.read()
    except OSError:
        body = b""
    try:
        reason = json.loads(body)["error"]
        if isinstance(reason, str):
            return reason
    except (ValueError, KeyError, TypeError):
        pass
    text = body.decode("utf-8", "replace").strip()[:200]
    return f"HTTP {error.code}" + (f": {text}" if text else f" {error.reason}")
