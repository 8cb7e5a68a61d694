"""Request bodies read within a cap, and JSON bodies held to what the store can keep and send back.

A body is read as a stream and never held past its cap, so no client makes
the server hold more; where a Budget is given, the bodies being read on all
connections together hold at most its bytes, so many partial uploads cannot
add up to more either, and a deadline lets none hold its share for ever.
A JSON body is parsed strictly: numbers finite and integers within 64 bits
(DuckDB's BIGINT, and what an answer can carry back), nesting bounded (deep
values cannot cross the writer process's queue), text that UTF-8 can carry.
Whatever passes can be stored and answered as JSON.
"""

import asyncio
import json
import math

from starlette.requests import Request

_DRAIN = 4  # a body over its cap is read on to this many times the cap, so the client sees the 413
_INT64 = 2**63


class Refused(Exception):
    """A body the server refuses, with its HTTP status: 400 malformed, 408 too slow, 413 too large,
    503 the budget of bodies being read is spent."""

    def __init__(self, status: int, message: str):
        super().__init__(status, message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message


class Budget:
    """Bytes of request bodies held across all connections (one event loop: no lock)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0

    def take(self, nbytes: int) -> bool:
        """Hold `nbytes` more, or False (nothing held) when that would pass the limit."""
        if self.held + nbytes > self.limit:
            return False
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.held -= nbytes


async def read(request: Request, cap: int, budget: Budget | None = None, timeout_s: float | None = None) -> bytes:
    """The body, or Refused(413) when it is over `cap` bytes; never holds more than `cap`.

    One declared (Content-Length) far over is refused unread; one a little over is
    read on, and dropped, so that a client still sending gets the answer. With a
    `budget`, the body's bytes are taken from it as they arrive (Refused(503) once it
    is spent) and stay taken: the caller gives back len(body) when done with it.
    Refused(408) when the body has not arrived within `timeout_s`."""
    too_large = Refused(413, f"body larger than {cap} bytes")
    length = request.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > _DRAIN * cap:
        raise too_large
    chunks: list[bytes] = []
    size = held = 0
    kept = False  # whether the caller gets the body, and with it the bytes held
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size <= cap:
                    if budget is not None:
                        if not budget.take(len(chunk)):
                            raise Refused(503, "the collector is reading as many request bodies as it holds; retry")
                        held += len(chunk)
                    chunks.append(chunk)
                elif size > _DRAIN * cap:
                    break
        kept = size <= cap
    except TimeoutError:
        raise Refused(408, f"the body did not arrive within {timeout_s} s") from None
    finally:
        if budget is not None and not kept:
            budget.give(held)
    if not kept:
        raise too_large
    return b"".join(chunks)


def parse_json(body: bytes, max_depth: int):
    """`body` as JSON, or Refused(400) with one line, naming where: not JSON, a number that is not
    finite (NaN, Infinity, 1e999) or an integer outside 64 bits, nesting deeper than `max_depth`,
    or text UTF-8 cannot carry."""
    try:
        value = json.loads(body)
    except RecursionError:  # deeper than the parser recurses: deeper than any bound
        raise Refused(400, f"the body is nested deeper than {max_depth}") from None
    except ValueError as e:
        raise Refused(400, f"the body is not JSON: {e}") from None
    _check(value, max_depth)
    return value


def _check(value, max_depth: int) -> None:
    """Refused(400) for the first part of `value` the store could not keep or send back. Walked
    without recursion, containers alone on the stack, each with the way to it (a linked list of
    keys, spelled out only on refusal)."""
    _scalar(value, None)
    stack: list[tuple[dict | list, int, tuple | None]] = [(value, 1, None)] if isinstance(value, (dict, list)) else []
    while stack:
        container, depth, where = stack.pop()
        if depth > max_depth:
            raise Refused(400, f"{_spelled(where)} is nested deeper than {max_depth}")
        pairs = container.items() if isinstance(container, dict) else enumerate(container)
        for key, child in pairs:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, (where, key)))
            elif not isinstance(child, (bool, type(None))):
                _scalar(child, (where, key))
            if isinstance(key, str):
                _scalar(key, (where, key))


def _scalar(item, where) -> None:
    """Refused(400) for a number that is not finite, an integer outside 64 bits, or text with a lone surrogate."""
    if isinstance(item, float) and not math.isfinite(item):
        raise Refused(400, f"{_spelled(where)}: numbers must be finite, not {item}")
    if isinstance(item, int) and not -_INT64 <= item < _INT64:
        raise Refused(400, f"{_spelled(where)}: integers must fit in 64 bits")
    if isinstance(item, str) and not utf8(item):
        raise Refused(400, f"{_spelled(where)}: text must be valid UTF-8 (no lone surrogates such as \\ud800)")


def utf8(text: str) -> bool:
    """Whether `text` has no lone surrogate (JSON's \\ud800 escape), which UTF-8, and so DuckDB, cannot take."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _spelled(where) -> str:
    """A part's way from the top, as `body["args"]["watts"]` (each key cut short, escaped: one line)."""
    keys = []
    while where is not None:
        where, key = where
        keys.append(f"[{key}]" if isinstance(key, int) else f"[{json.dumps(key)[:40]}]")
    return "body" + "".join(reversed(keys))
