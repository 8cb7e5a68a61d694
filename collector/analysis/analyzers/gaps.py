"""Telemetry gaps: the rank-steps a run's collector expected but never got.

A rank of the run silent at a step its peers reported lost that step's telemetry on the way
(dropped before export, refused, never sent): a synchronous job cannot finish a step's
collectives without every rank, so its peers' reports say the step happened there too. (A rank
that hangs stops its peers with it: that is a stall, the hang analyzer's.)

A pure function of one window of settled steps (collector/analysis/losses.py chooses them and
records the result): the rank-steps missing in it, as blocks of consecutive ranks that lack the
same run of steps, merged with the blocks of the windows before. 256 ranks silent for a thousand
steps are one block, not 256,000 rows, at 16,384 ranks as at 8; the counts are exact whatever
the number of blocks kept. What they are and their words: collector/telemetryloss.py.
"""

from dataclasses import replace

import numpy as np
import pandas as pd

from collector.telemetryloss import Gaps

MAX_BLOCKS = 256  # blocks kept per run; the rank-steps of those past it are counted (`left_out`)


def judge(before: Gaps, missing: pd.DataFrame, steps: np.ndarray, ranks: int) -> Gaps:
    """`before` extended by one window: `steps`, the distinct steps any rank reported in it (sorted,
    all after `before.settled_step`); `missing`: rank, step of each expected rank-step not reported
    among them; `ranks`: the ranks expected."""
    if len(steps) == 0:
        return before
    blocks, beyond = _blocks(
        missing["rank"].to_numpy(np.int64), np.searchsorted(steps, missing["step"].to_numpy()), steps
    )
    kept = [list(b) for b in before.blocks]
    open_ = {(b[0], b[1]): b for b in kept if b[3] == before.settled_step}  # may go on into this window
    for block in blocks:
        going_on = open_.get((block[0], block[1])) if block[2] == steps[0] else None
        if going_on is not None:
            going_on[3], going_on[4] = block[3], going_on[4] + block[4]
        else:
            kept.append(block)
    kept, left_out = _largest(kept, before.left_out + beyond)
    return replace(
        before,
        settled_step=int(steps[-1]),
        ranks=ranks,
        expected=before.expected + ranks * len(steps),
        missing=before.missing + len(missing),
        blocks=kept,
        left_out=left_out,
    )


def regapped(before: Gaps, blocks: list[list[int]], left_out: int) -> Gaps:
    """`before` with its kept blocks drawn anew, once rank-steps counted missing in them came after all
    (`left_out`: the rank-steps missing past those blocks)."""
    kept, left_out = _largest(blocks, left_out)
    return replace(before, missing=left_out + sum(b[4] for b in kept), blocks=kept, left_out=left_out)


def _largest(blocks: list[list[int]], left_out: int) -> tuple[list[list[int]], int]:
    """The MAX_BLOCKS largest blocks (what a person must see first), in step order, and `left_out` with
    the rank-steps of the others."""
    ranked = sorted(blocks, key=lambda b: -b[4])
    return sorted(ranked[:MAX_BLOCKS], key=lambda b: (b[2], b[0])), left_out + sum(b[4] for b in ranked[MAX_BLOCKS:])


def _blocks(rank: np.ndarray, index: np.ndarray, steps: np.ndarray) -> tuple[list[list[int]], int]:
    """Missing rank-steps (rank, index of the step in `steps`) as blocks, in order of first step
    and first rank: each rank's runs of consecutive steps, then the runs of consecutive ranks with
    the same run of steps. Only the blocks that may be kept are made (those from the window's
    first step, which may go on from the window before, and the MAX_BLOCKS largest); the
    rank-steps of the rest are counted."""
    if len(rank) == 0:
        return [], 0
    order = np.lexsort((index, rank))
    rank, index = rank[order], index[order]
    starts = np.flatnonzero(np.r_[True, (np.diff(rank) != 0) | (np.diff(index) != 1)])
    r, lo = rank[starts], index[starts]
    hi = index[np.r_[starts[1:], len(rank)] - 1]
    order = np.lexsort((r, hi, lo))
    r, lo, hi = r[order], lo[order], hi[order]
    firsts = np.flatnonzero(np.r_[True, (np.diff(lo) != 0) | (np.diff(hi) != 0) | (np.diff(r) != 1)])
    lasts = np.r_[firsts[1:], len(r)] - 1
    sizes = (lasts - firsts + 1) * (hi[firsts] - lo[firsts] + 1)
    # made: those that may go on from the window before (from its first step) and the MAX_BLOCKS largest
    made = np.flatnonzero(lo[firsts] == 0)
    made = np.union1d(made, np.argsort(-sizes, kind="stable")[:MAX_BLOCKS])
    blocks = [
        [int(r[firsts[i]]), int(r[lasts[i]]), int(steps[lo[firsts[i]]]), int(steps[hi[firsts[i]]]), int(sizes[i])]
        for i in made
    ]
    return blocks, int(sizes.sum() - sizes[made].sum())
