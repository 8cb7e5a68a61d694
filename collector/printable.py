"""Text that clients wrote, made safe to show. Telemetry is written by whoever holds the token, so a run id,
a host name or a process group's name may carry terminal escape codes (that move the reader's cursor,
clear the screen or retitle the window), line breaks (that start what reads as a line of its own, a log
record included) or Unicode's bidirectional controls (that show text in another order than it is stored:
U+202E turns what follows around). `printable` writes each of them as its Python escape; the collector's
processes and the `rankwatch` command pass every log record through it (`escape_logs`), the commands that
print stored values pass them through it (collector/reports/terminal.py), and so does the dashboard
before Markdown (dashboard/ui.py).
"""

import logging
import re
import traceback

# C0 controls (line feed and tab too), DEL, C1 controls (some terminals act on 0x9b as on ESC [), the line and
# paragraph separators, and the bidirectional controls: Arabic letter mark, the implicit marks, embeddings,
# overrides and isolates
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}  # the escapes people know these by
TRACEBACK_INDENT = "    "  # before each line of a log record's traceback: only a record's first line starts a line


def _escape(match: re.Match) -> str:
    character = match.group()
    if character in _SHORT:
        return _SHORT[character]
    code = ord(character)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with each control, line break and bidirectional control written as its Python escape
    (ESC as \\x1b, a line feed as \\n, U+202E as \\u202e), on one line; printable text comes back unchanged."""
    return _UNPRINTABLE.sub(_escape, text)


class EscapedRecord(logging.LogRecord):
    """A log record whose message is printable, and whose traceback (an exception's text may quote what
    a client sent) has its lines printable and indented: a record is one line at the left margin, its
    traceback's lines under it, and no value can start a line that passes for a record of its own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.exc_info and self.exc_info[1] is not None:  # formatters show exc_text, where it is set
            lines = "".join(traceback.format_exception(*self.exc_info)).rstrip("\n").split("\n")
            self.exc_text = "\n".join(TRACEBACK_INDENT + printable(line) for line in lines)

    def getMessage(self) -> str:
        return printable(super().getMessage())


def escape_logs() -> None:
    """Make every log record of this process an EscapedRecord, whichever handler and formatter show it
    (uvicorn's, the default one to stderr): called first thing in each of the collector's processes and
    in the `rankwatch` command."""
    logging.setLogRecordFactory(EscapedRecord)
