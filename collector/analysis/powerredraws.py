"""A running job's power recommendations, redrawn as it goes (collector/analysis/live.py's passes).

The power analyzer (analyzers/power.py) costs seconds at a thousand ranks (a bootstrap over the ranks),
so a run's report is drawn on a thread of its own, on a cursor of its own, and no pass waits for it: a
timer pass starts it where the run stepped since its report was last drawn, at most every `every_s`
(power moves slowly, and commit-driven passes stay light), and a later pass records its findings. At most
one report per run is being drawn at a time. How a report is read from the store is given to it
(collector/server.py gives collector/reports/powercaps.py's `live_report`).
"""

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import duckdb

from collector.analysis.analyzers import power
from collector.store import lake

# A run's live power report drawn from the store (None where its GPUs report no power)
DrawReport = Callable[[duckdb.DuckDBPyConnection, str], power.PowerReport | None]


class PowerRedraws:
    """The runs' power reports: when each is next drawn, and those being drawn."""

    def __init__(self, draw: DrawReport | None, every_s: float | None):
        """`draw`: how a run's report is drawn; `every_s`: how often at most; either None: never."""
        self.draw = draw
        self.every_s = every_s if draw is not None else None
        self.next_at: dict[str, float] = {}  # run -> when its report may next be drawn (monotonic)
        self.stepped: set[str] = set()  # runs that stepped since their report was last drawn
        self.drawing: dict[str, Future] = {}  # run -> its report, being drawn
        self._thread: ThreadPoolExecutor | None = None  # made in the writer process, on first use

    def note_stepped(self, runs: Iterable[str]) -> None:
        self.stepped.update(runs)

    def keep_only(self, runs: set[str]) -> None:
        """Forget when the reports of runs no longer under analysis were due."""
        self.next_at = {run: t for run, t in self.next_at.items() if run in runs}

    def redraw_if_due(self, con: duckdb.DuckDBPyConnection, run_id: str) -> None:
        """Start drawing a run's report where it stepped since the last and its time has come."""
        if self.every_s is None or run_id not in self.stepped or time.monotonic() < self.next_at.get(run_id, 0.0):
            return
        self.next_at[run_id] = time.monotonic() + self.every_s
        self.stepped.discard(run_id)
        if run_id in self.drawing:
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="rankwatch-power")
        self.drawing[run_id] = self._thread.submit(self._drawn_on, lake.cursor(con), run_id)

    def _drawn_on(self, cursor: duckdb.DuckDBPyConnection, run_id: str) -> power.PowerReport | None:
        assert self.draw is not None  # (only started with one)
        try:
            return self.draw(cursor, run_id)
        finally:
            cursor.close()

    def finished(self) -> list[tuple[str, Future]]:
        """The reports drawn since the last call, by run (a result raises what its drawing raised)."""
        done = [(run_id, drawing) for run_id, drawing in self.drawing.items() if drawing.done()]
        for run_id, _ in done:
            del self.drawing[run_id]
        return done

    def stop(self) -> None:
        """No report is started any more; the one being drawn finishes first (a later pass records it)."""
        self.every_s = None
        if self._thread is not None:
            self._thread.shutdown(cancel_futures=True)
