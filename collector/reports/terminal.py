"""Stored values made safe to print: telemetry is written by whoever holds the token, and a run id or
a host name with terminal escape codes in it must not move the reader's cursor, clear the screen or
retitle the window. Every command that prints stored values as text passes them through here."""

import re

from rich.markup import escape

# C0 controls but newline and tab, DEL, and C1 controls (some terminals act on 0x9b as on ESC [)
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with each control character written as its Python escape (ESC as \\x1b)."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def markup_safe(value: object) -> str:
    """A value for a rich markup string or table cell: printable, and its brackets taken literally."""
    return escape(printable(str(value)))
