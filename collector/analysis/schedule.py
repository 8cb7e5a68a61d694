"""When the live analysis's passes come (collector/analysis/live.py), and which runs each judges.

Passes are driven by commits: the writer hands over each commit's tables, the schedule takes from them
the runs the commit brought steps (or ranks' ends: `ended` or `rank_failed` events) for and wakes the
analysis thread, and the pass judges those runs' new steps at once, so a finding exists within a pass of
the commit of the step that shows it (the commit that brings its last rank's report of it), whatever the
step rate. A timer wakes it too (every `interval_s`), for what time alone changes: a run that stopped
sending steps (a stall), a job stopped by its rollback budget, a stacks request whose time is up. A run
nothing came for in ACTIVE_FOR_S is no longer judged.

The writer thread tells the schedule of commits and the analysis thread takes the runs due: they meet
under its lock, and neither waits for the other's work.
"""

import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from collector.analysis.engine import ENDED, add_steps
from rankwatch.agent import semconv as sc

ACTIVE_FOR_S = 3600  # a run silent this long is no longer analysed (a hang has fired long before)
_ENDS = pa.array([ENDED, sc.EVENT_RANK_FAILED])  # a rank's end: its training loop ended, or it failed


@dataclass(frozen=True)
class Due:
    """What a pass judges: `runs`, in the order it judges them; the runs with steps (`stepped`) and with
    ranks' ends (`ended`: `ended` or `rank_failed` events) committed since the last pass; and the runs gone
    quiet (`quiet`: no longer judged, the steps kept for them may go)."""

    runs: list[str]
    stepped: set[str]
    ended: set[str]
    quiet: list[str]


class PassSchedule:
    """The runs under analysis, what the commits brought each since its last pass, and the timer."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.heard_at: dict[str, float] = {}  # the runs under analysis -> when a commit last brought them something
        self.with_new_steps: set[str] = set()  # runs with steps committed since the last pass
        self.with_new_ends: set[str] = set()  # runs with ranks' ends committed since the last pass
        self.awaiting_ranks: set[str] = set()  # runs with steps reported that not every rank has reported yet
        self.committed_steps: dict[str, list[tuple[int, int]]] = {}  # run -> the steps committed since its pass
        self.timer_at = time.monotonic() + interval_s  # when every run is next judged, new steps or not
        self.taken_at = 0.0  # when the last pass took the runs it judges
        self._threading()

    def _threading(self) -> None:
        """Made anew in the writer process (the schedule is handed to it pickled, without them)."""
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_wake")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._threading()

    def heard(self, run_ids: Collection[str], steps: bool, ended: Iterable[str] = ()) -> None:
        """Runs a commit brought something for (`steps`: rank-steps, else only events such as
        heartbeats; `ended`: runs among them with ranks' ends); new steps or ends wake a pass."""
        with self._lock:
            now = time.monotonic()  # under the lock: ordered with a pass taking its runs (ended())
            self.heard_at.update((run_id, now) for run_id in run_ids)
            if steps:
                self.with_new_steps.update(run_ids)
            self.with_new_ends.update(ended)
        if steps or ended:
            self.wake()

    def take(self, tables: Mapping[str, Sequence[pa.Table]]) -> None:
        """A commit's tables (its steps: run_id, step; its events: run_id, event): the runs it brought
        steps or events for, and the steps it brought each (the engine judges those that came below
        steps already judged)."""
        for part in tables.get("steps", ()):
            for run_id, ranges in _step_ranges(part).items():
                self.add_steps(run_id, ranges)
        for table in ("steps", "events"):
            run_ids = {run_id for part in tables.get(table, ()) for run_id in pc.unique(part["run_id"]).to_pylist()}
            ended = {
                run_id
                for part in tables.get(table, ())
                if table == "events"
                for run_id in pc.unique(part.filter(pc.is_in(part["event"], _ENDS))["run_id"]).to_pylist()
            }
            self.heard(run_ids, steps=table == "steps", ended=ended)

    def add_steps(self, run_id: str, ranges: list[tuple[int, int]]) -> None:
        """Steps committed for a run (ranges): its next pass is told."""
        if ranges:
            with self._lock:
                self.committed_steps[run_id] = add_steps(self.committed_steps.get(run_id, ()), ranges)

    def steps_of(self, run_id: str) -> list[tuple[int, int]]:
        """The steps committed for a run since its last pass, taken for this one."""
        with self._lock:
            return self.committed_steps.pop(run_id, [])

    def drop_steps(self, run_id: str) -> None:
        """Forget the steps committed for a run another collector judges (in a lake)."""
        with self._lock:
            self.committed_steps.pop(run_id, None)

    def due(self, every: bool, last: bool, judged: Collection[str]) -> Due:
        """The runs a pass judges. `every`: every run under analysis, those with new steps first (the
        timer's pass: it restarts the timer); else those with new steps or ends. `last`: the runs with
        steps not yet judged: new ones, those awaiting a rank, and those not `judged` yet (runs with a
        cursor); the timer's passes judged the others' stalls."""
        if every or last:
            self.timer_at = time.monotonic() + self.interval_s
        cutoff = time.monotonic() - ACTIVE_FOR_S
        with self._lock:
            self.taken_at = time.monotonic()
            quiet = [run for run, t in self.heard_at.items() if t <= cutoff]
            self.heard_at = {run: t for run, t in self.heard_at.items() if t > cutoff}
            stepped, self.with_new_steps = self.with_new_steps, set()
            ended, self.with_new_ends = self.with_new_ends, set()
            if every and not last:
                runs = sorted(self.heard_at, key=lambda run: run not in stepped)
            else:
                waiting = stepped | ended | self.awaiting_ranks | (set(self.heard_at) - set(judged))
                runs = sorted(waiting & set(self.heard_at))
        return Due(runs, stepped, ended, quiet)

    def active(self) -> set[str]:
        """The runs under analysis."""
        with self._lock:
            return set(self.heard_at)

    def awaits_ranks(self, run_id: str, awaiting: bool) -> None:
        """Whether a run has steps reported that not every rank has reported yet (judged once they have)."""
        with self._lock:
            (self.awaiting_ranks.add if awaiting else self.awaiting_ranks.discard)(run_id)

    def ended(self, run_id: str) -> None:
        """A run judged to its end: no longer under analysis, unless a commit brought it something while
        the pass judged it (a rank's last report of the telemetry its agent dropped, say): the next pass
        reads that too."""
        with self._lock:
            if self.heard_at.get(run_id, 0.0) <= self.taken_at:
                self.heard_at.pop(run_id, None)

    def again(self, run_id: str) -> None:
        """A run with steps left after its pass: judged again at once."""
        with self._lock:
            self.with_new_steps.add(run_id)
        self.wake()

    def due_in(self) -> float:
        """Seconds until the timer's next pass."""
        return max(self.timer_at - time.monotonic(), 0.0)

    def wait(self, at_most: float | None = None) -> None:
        """Until a commit or a report wakes the analysis thread, or the timer's pass is due (or `at_most`)."""
        self._wake.wait(self.due_in() if at_most is None else min(self.due_in(), at_most))
        self._wake.clear()

    def wake(self) -> None:
        """Wake the analysis thread for a pass at once (a commit's runs, a report, a backlog, the collector's stop)."""
        self._wake.set()


def _step_ranges(steps: pa.Table) -> dict[str, list[tuple[int, int]]]:
    """The steps of a commit's rows, by run, as ranges of consecutive steps (one a rank's batch)."""
    if steps.num_rows == 0:  # a commit of spans without steps (a batch of collectives alone)
        return {}
    pairs = steps.group_by(["run_id", "step"]).aggregate([]).sort_by([("run_id", "ascending"), ("step", "ascending")])
    runs, numbers = pairs["run_id"].to_numpy(zero_copy_only=False), pairs["step"].to_numpy()
    starts = np.flatnonzero(np.r_[True, (runs[1:] != runs[:-1]) | (numbers[1:] != numbers[:-1] + 1)])
    ranges: dict[str, list[tuple[int, int]]] = {}
    for start, end in zip(starts, np.r_[starts[1:], len(numbers)] - 1, strict=True):
        ranges.setdefault(runs[start], []).append((int(numbers[start]), int(numbers[end])))
    return ranges
