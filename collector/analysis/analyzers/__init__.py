"""Analyzers: pure functions from telemetry tables to findings.

The contract the analysis engine (collector/analysis/engine.py) runs them under: an analyzer module
names itself (`ANALYZER`), declares what it reads (`READS`) and judges a run's `Frames`
(`judge(frames, settings)`), returning the findings its judgement of the new steps draws
(collector/findings.py's `Finding`), one per episode (a conclusion held over consecutive steps), each
spanning the steps it held at. An
analyzer that speaks to the others' findings of a pass also has `revise(found, frames, settings)`,
run after every analyzer judged, given their findings by analyzer and returning them (the step-time
model's: how much of a straggler's slowdown its state explains).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from collector.analysis.stacks import Answers
from collector.findings import Finding


@dataclass(frozen=True)
class Reads:
    """What an analyzer reads of a run, so the engine reads nothing more.

    `history`: steps before the first new one its baseline needs (each new step is judged on
    those before it, as if it were the newest). `linger`: steps an episode stays firing after
    the last step that showed it (what merges two episodes into one, too); 0: only while it
    holds at the newest step. `every_pass`: judged on every pass, new steps or not (what the
    passing of time alone changes: a stall). `ends_with_run`: its findings resolve when the run
    ends (not those that say how it ended). The rest: frames it needs beside the steps."""

    history: int
    linger: int
    every_pass: bool = False
    ends_with_run: bool = True
    collectives: bool = False
    devices: bool = False
    heartbeats: bool = False
    failed_rollbacks: bool = False
    workload: bool = False
    tiers: bool = False
    failures: bool = False
    stacks: bool = False
    node_samples: bool = False

    def continues(self, episode_end: int, finding: Finding) -> bool:
        """Whether `finding` is the episode that ended at `episode_end` going on (same kind and ranks)."""
        assert finding.step_start is not None, "an episode goes on only in findings over steps"
        return finding.step_start <= episode_end + self.linger + 1

    def holds(self, episode_end: int, last: int, redrawn: bool) -> bool:
        """Whether an episode is still firing once the steps up to `last` are judged."""
        return (redrawn or self.linger > 0) and episode_end + self.linger > last


@dataclass(frozen=True)
class Tiers:
    """A run's memory tiers over the steps a pass reads (`Reads.tiers`). `steps`: rank, step, end_ts (ns),
    duration_s, transfer_s, exposed_s, transfer_cpu_s, host_s, on_cpu (the rank computes on the host's CPUs)
    of the rank-steps that moved data between tiers or stepped on the host (docs/telemetry.md); `transfers`:
    rank, step, src, dst, bytes, seconds, start_ns, end_ns; `probes`: rank, read_bps, write_bps of the disk
    each rank swaps to, timed at its start; `checkpoints`: rank, step, start_ns, end_ns of the checkpoints
    written to disk then."""

    steps: pd.DataFrame
    transfers: pd.DataFrame
    probes: pd.DataFrame
    checkpoints: pd.DataFrame


@dataclass
class Frames:
    """What one pass hands an analyzer about one run.

    `steps`: run_id, rank, step, end_ts (ns), duration_s, data_s, compute_s, comm_wait_s, loss,
    grad_norm, non_finite; one row per rank-step of the current trajectory, sorted by step and
    rank, from `history` steps before `first_new` to `last`. Given whole, or in parts by step (the
    engine's: the steps it kept, a part a pass, then the new ones), which are put together only
    for an analyzer that reads them whole: at 65,536 ranks, 96 steps are 6.3 million rows, and an
    analyzer that keeps what it derived (`kept`) reads the new steps alone (`new_steps`,
    `steps_after`). `first_new` ... `last`: the steps this pass judges, each once (none where
    `first_new > last`: only time has passed).
    `ranks`: rank, host, dp_rank, pp_stage, tp_rank (placement). `devices(since_ns, until_ns)`: rank, ts (ns), metric,
    value of the device samples then (read only when asked: evidence). `workload()`: rank, step, tokens,
    flops of the rank-steps of `steps` (what each rank-step's work was; read only when asked). `tiers()`: what
    moved between memory tiers over `steps` (Tiers; read only when asked). `failures`: the run's `rank_failed`
    events from shortly before `steps` (docs/telemetry.md), in time order: rank, ts (ns), step,
    body, cause, exception, message, signal, exit_code, attempt, and last_step, the newest step the rank stored
    by then (within the hour before). `stacks(since_ns, until_ns)`: the answers to the run's newest request for
    every rank's stacks made then (until None: now; collector/analysis/stacks.py's Answers, with the Flight Recorder
    entries they hold; engine.read_stacks; None where it has none; read only when asked).
    `node_samples(since_ns, until_ns, slice_ns, metrics)`: rank, ts (ns), metric, value, gpu, port (InfiniBand)
    of the device samples of `metrics` then, thinned to each series' last sample in each `slice_ns` (read only
    when asked: at 10 Hz a window of a large job is millions of samples). `now_ns`: the moment
    judged (a live pass: now; a run after the fact: when it was last heard from). `ended_ns`:
    when every rank said its training loop ended (None: not ended). `world_size`: the ranks the run
    says it has (None: unsaid; the ranks that reported so far may be only the first to). `resumed`:
    read with the heartbeats, the moments the job progressed that `steps` no longer shows, in ns: for
    each rollback applied, the end of the last step it abandoned and when training resumed. `kept`:
    what an analyzer derived from the steps of the run's last pass, by analyzer, for its next: the
    engine keeps it with those steps and drops it with them (a rollback, late steps), so what is in
    it always agrees with `steps`; empty for a pass with nothing kept (the first, after the fact)."""

    run_id: str
    rank_steps: pd.DataFrame | Sequence[pd.DataFrame]  # `steps`, whole or in parts (each sorted by step)
    first_new: int
    last: int
    ranks: pd.DataFrame
    now_ns: int
    ended_ns: int | None = None
    world_size: int | None = None
    collectives: pd.DataFrame | None = None
    heartbeats: pd.DataFrame | None = None
    resumed: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    failed_rollbacks: pd.DataFrame | None = None
    devices: Callable[[int, int], pd.DataFrame] | None = None
    workload: Callable[[], pd.DataFrame] | None = None
    tiers: Callable[[], Tiers] | None = None
    failures: pd.DataFrame | None = None
    stacks: Callable[[int, int | None], Answers | None] | None = None
    node_samples: Callable[[int, int, int, list[str]], pd.DataFrame] | None = None
    kept: dict[str, dict] = field(default_factory=dict)

    @cached_property
    def steps(self) -> pd.DataFrame:
        parts = self._parts
        return parts[0] if len(parts) == 1 else pd.concat(parts, ignore_index=True)

    @cached_property
    def first_step(self) -> int:
        """The first step of `steps`: the earliest of the history read."""
        first = self._parts[0]["step"]
        return int(first.min() if len(self._parts) == 1 else first.iat[0])

    @cached_property
    def new_steps(self) -> pd.DataFrame:
        return self.steps_after(self.first_new - 1)

    def steps_after(self, step: int) -> pd.DataFrame:
        """The rank-steps after `step`, from the parts that hold them alone."""
        if len(self._parts) == 1:
            whole = self._parts[0]
            return whole[whole["step"] > step]
        parts = [p for p in self._parts if p["step"].iat[-1] > step]
        if not parts:
            return self._parts[0].iloc[:0]
        parts[0] = parts[0].iloc[int(np.searchsorted(parts[0]["step"].to_numpy(), step, side="right")) :]
        return parts[0] if len(parts) == 1 else pd.concat(parts, ignore_index=True)

    @cached_property
    def _parts(self) -> list[pd.DataFrame]:
        if isinstance(self.rank_steps, pd.DataFrame):
            return [self.rank_steps]
        return [p for p in self.rank_steps if not p.empty] or list(self.rank_steps[:1])
