"""A run's telemetry loss, as the collector keeps it (`telemetry_loss`, one row a run) and says it: the
rank-steps it never got (`Gaps`) and what the ranks' agents dropped before export (`Loss`).

It imports nothing of the analysis: the gaps analyzer (collector/analysis/analyzers/gaps.py) draws the
gaps, the live passes (collector/analysis/losses.py) record them, and `rankwatch analyze` and the dashboard
say them from here.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from collector import ranksets

NOT_SETTLED = -1  # no step settled yet (steps are never negative)
BLOCK_FIELDS = ("first_rank", "last_rank", "first_step", "last_step", "rank_steps")  # a gap's, in JSON


@dataclass(frozen=True)
class Gaps:
    """A run's missing rank-steps through `settled_step`. `blocks`: [first rank, last rank, first step,
    last step, rank-steps missing], each a run of consecutive ranks lacking every step their peers
    reported between the two steps, the largest kept (analyzers/gaps.py's MAX_BLOCKS), in step order;
    `left_out`: rank-steps missing in the smaller blocks past them."""

    settled_step: int = NOT_SETTLED
    ranks: int = 0  # the ranks expected: the run's ranks seen
    expected: int = 0  # rank-steps expected through settled_step
    missing: int = 0
    blocks: list[list[int]] = field(default_factory=list)
    left_out: int = 0

    @property
    def share(self) -> float:
        return self.missing / self.expected if self.expected else 0.0

    def summary(self, max_ranges: int = 4) -> str:
        """ "telemetry lost: 29,952 of 204,800 rank-steps (14.6%) never arrived; ranks 768–1023 from
        step 41", the ranges of ranks that lost most first; "" where none was lost."""
        if not self.missing:
            return ""
        by_ranks: dict[tuple[int, int], list[list[int]]] = {}
        for block in self.blocks:
            by_ranks.setdefault((block[0], block[1]), []).append(block)
        ranked = sorted(by_ranks.items(), key=lambda kv: -sum(b[4] for b in kv[1]))[:max_ranges]
        where = [f"{ranksets.phrase(range(r0, r1 + 1))} {self._steps(blocks)}" for (r0, r1), blocks in ranked]
        rest = self.missing - sum(b[4] for _, blocks in ranked for b in blocks)
        return (
            f"telemetry lost: {self.missing:,} of {self.expected:,} rank-steps ({100 * self.share:.1f}%) never "
            f"arrived; " + "; ".join(where) + (f"; {rest:,} more elsewhere" if rest else "")
        )

    def _steps(self, blocks: list[list[int]]) -> str:
        """The steps a range of ranks lacks, in words."""
        first, last = min(b[2] for b in blocks), max(b[3] for b in blocks)
        if len(blocks) > 1:
            return f"lack {sum(b[4] for b in blocks):,} rank-steps in {len(blocks)} stretches of steps {first}–{last}"
        if last == self.settled_step:
            return f"from step {first}"
        return f"step {first}" if first == last else f"steps {first}–{last}"


@dataclass(frozen=True)
class Loss:
    """A run's telemetry loss: the rank-steps the collector never got, and what the agents dropped."""

    gaps: Gaps
    spans_dropped: int = 0  # reported by the agents
    rank_steps_dropped: int = 0

    @classmethod
    def stored(cls, row: Mapping) -> "Loss":
        """The loss a `telemetry_loss` row holds, by its columns' names (`gaps` read from its JSON)."""
        gaps = Gaps(
            row["settled_step"], row["ranks"], row["expected"], row["missing"], row["gaps"], row["gaps_left_out"]
        )
        return cls(gaps, int(row["agent_spans_dropped"]), int(row["agent_rank_steps_dropped"]))

    @property
    def any(self) -> bool:
        return bool(self.gaps.missing or self.spans_dropped or self.rank_steps_dropped)

    def summary(self) -> str:
        """One line for people; "" where nothing was lost."""
        parts = [self.gaps.summary()] if self.gaps.missing else []
        if self.spans_dropped or self.rank_steps_dropped:
            parts.append(
                f"the ranks' agents dropped {self.spans_dropped:,} spans ({self.rank_steps_dropped:,} rank-steps) "
                "before export"
            )
        return "; ".join(parts)

    def as_dict(self) -> dict:
        g = self.gaps
        return {
            "rank_steps_expected": g.expected,
            "rank_steps_missing": g.missing,
            "missing_share": g.share,
            "settled_step": g.settled_step,
            "gaps": [dict(zip(BLOCK_FIELDS, b)) for b in g.blocks],
            "gaps_left_out": g.left_out,
            "agent_spans_dropped": self.spans_dropped,
            "agent_rank_steps_dropped": self.rank_steps_dropped,
            "partial_data": self.any,  # conclusions drawn on this run are drawn on partial data
            "summary": self.summary(),
        }
