"""Stored text as Streamlit's Markdown shows it: character for character, never as Markdown. Telemetry is
written by whoever holds the token, so every stored value a page shows where Streamlit reads Markdown goes
through here (dashboard/ui.py and dashboard/evidence.py)."""

import re

import pandas as pd

from collector.printable import printable

_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")  # ASCII punctuation, which Markdown takes as itself after a backslash


def literal(value: object) -> str:
    """`value` as Streamlit's Markdown shows it, character for character: printable (collector/printable.py),
    each ASCII punctuation character backslash-escaped, so that it makes no link, image, heading, emphasis,
    colour, icon or formula. Telemetry is written by whoever holds the token: every stored value (a run id,
    a host name, a finding's summary), every value of a link's parameters and every error's text that a
    title, header, caption, alert, widget label or `st.table` cell shows goes through here."""
    return _PUNCTUATION.sub(r"\\\1", printable(str(value)))


def literal_table(table: pd.DataFrame) -> pd.DataFrame:
    """`table` as `st.table` shows it, which reads Markdown in every cell and header: each text `literal`."""

    def text(value: object) -> object:
        return literal(value) if isinstance(value, str) else value

    shown = table.map(text)
    shown.index, shown.columns = shown.index.map(text), shown.columns.map(text)
    return shown
