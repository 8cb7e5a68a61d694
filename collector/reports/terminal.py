"""Stored values in rich's output (`analyze`, `power`, `query`'s tables): printable (collector/printable.py:
a run id or a host name with terminal escape codes in it must not move the reader's cursor, clear the screen or
retitle the window), and what looks like rich markup in them taken literally."""

from rich.markup import escape

from collector.printable import printable


def markup_safe(value: object) -> str:
    """A value for a rich markup string or table cell: printable, and its brackets taken literally."""
    return escape(printable(str(value)))
