"""Rank sets as people read them: "ranks 0–7, 12", "stage 5 (ranks 160–191)".

One helper for findings' summaries, the dashboard and `rankwatch query`, so
that the 32 ranks of a slow stage, or the 511 ranks a hang waits on, read as
one short line wherever they are shown rather than as hundreds of numbers.
"""

from collections.abc import Iterable

MAX_RANGES = 6  # ranges spelled out before the rest is counted ("… and 40 more")
MAX_PARSED = 1 << 20  # ranks a typed set may name: more than any job has, few enough to list


def ranges(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ranks, (first, last) each, in order; duplicates ignored."""
    runs: list[list[int]] = []
    for rank in sorted({int(r) for r in ranks}):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return [(a, b) for a, b in runs]


def compact(ranks: Iterable[int], max_ranges: int = MAX_RANGES, dash: str = "–", sep: str = ", ") -> str:
    """ "0–7, 12": the ranks as ranges, the first `max_ranges` spelled out and the rest counted
    ("0, 2, 4, 6, 8, 10 and 250 more"); "" for none."""
    runs = ranges(ranks)
    text = sep.join(
        f"{a}" if a == b else f"{a}{dash}{b}" if b > a + 1 else f"{a}{sep}{b}" for a, b in runs[:max_ranges]
    )
    rest = sum(b - a + 1 for a, b in runs[max_ranges:])
    return text + (f" and {rest} more" if rest else "")


def phrase(ranks: Iterable[int], max_ranges: int = MAX_RANGES) -> str:
    """ "rank 5", "ranks 0–7, 12": the set with its noun, for a sentence."""
    ranks = sorted({int(r) for r in ranks})
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {compact(ranks, max_ranges)}"


def typed(ranks: Iterable[int]) -> str:
    """ "0-7,12": every rank, none counted, in the form `parse` reads back (a link's rank filter)."""
    ranks = sorted({int(r) for r in ranks})
    return compact(ranks, max_ranges=max(len(ranks), 1), dash="-", sep=",")


def parse(text: str) -> list[int]:
    """The ranks a person typed: "3", "3-7", "3,9", "0–7, 12" (ranges inclusive, as `compact` writes
    them); [] for blank text. ValueError names the part that is not a rank or a range."""
    ranks: set[int] = set()
    for part in text.replace("–", "-").replace(" ", "").split(","):
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{part!r} is not a rank or a range of ranks (3, 3-7)")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{part!r} runs backwards")
        if high - low >= MAX_PARSED:
            raise ValueError(f"{part!r} names more than {MAX_PARSED:,} ranks")
        ranks.update(range(low, high + 1))
    return sorted(ranks)
