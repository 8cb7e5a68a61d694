"""Collective matching on small frames: the earliest open collective of a group, the members missing
from it or mismatched in it, groups that share a name, and the cases with no culprit."""

import json

import pandas as pd
import pytest

from collector.analysis.analyzers.collectives import analyze

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these

MB4 = [[1024, 1024]]


def e(
    rank: int,
    seq: int,
    state: str = "completed",
    op: str = "all_reduce",
    sizes: list = MB4,
    output: list | None = None,
    group: str = "0",
) -> tuple:
    """One entry as the store gives it: sizes and dtypes as JSON text."""
    return (
        rank,
        group,
        seq,
        op,
        state,
        json.dumps(sizes),
        json.dumps(sizes if output is None else output),
        '["Float"]',
        '["Float"]',
    )


def rows(*entries: tuple) -> pd.DataFrame:
    return pd.DataFrame(
        entries,
        columns=["rank", "group", "seq", "op", "state", "input_sizes", "output_sizes", "input_dtypes", "output_dtypes"],
    )


def history(ranks, upto: int) -> list[tuple]:
    """all_reduce #1..upto completed on each of `ranks`."""
    return [e(r, s) for r in ranks for s in range(1, upto + 1)]


def groups(*members: tuple[str, list[int]], ranks=range(4), desc: str = "default_pg") -> pd.DataFrame:
    """Each of `ranks` lists the groups it belongs to, with their members."""
    return pd.DataFrame(
        [(r, name, desc, m) for r in ranks for name, m in members if r in m],
        columns=["rank", "group", "desc", "members"],
    )


WORLD = groups(("0", [0, 1, 2, 3]))


def test_rank_that_never_entered_is_named_and_the_others_wait():
    entries = rows(*history(range(4), 6), e(0, 7, "started"), e(1, 7, "started"), e(3, 7, "scheduled"))
    (finding,) = analyze("r", entries, WORLD, range(4))
    assert (finding.analyzer, finding.kind, finding.ranks, finding.severity) == ("hangs", "hang", [2], "critical")
    assert finding.evidence["collective"] == {"op": "all_reduce", "group": "0", "seq": 7, "waiting_ranks": [0, 1, 3]}
    assert finding.evidence["missing_ranks"] == [2] and finding.evidence["mismatched"] == []
    assert finding.score == pytest.approx(3 / 4)
    assert finding.step_start is None


def test_the_earliest_open_collective_is_judged_not_the_latest_enqueued():
    # rank 0 enqueued #8 and #9 behind #7, ranks 1 and 3 #8: a later one cannot run before #7
    entries = rows(
        *history(range(4), 6),
        *[e(0, s, "scheduled") for s in (7, 8, 9)],
        *[e(r, s, "scheduled") for r in (1, 3) for s in (7, 8)],
    )
    (finding,) = analyze("r", entries, WORLD, range(4))
    assert finding.ranks == [2]
    assert finding.evidence["collective"]["seq"] == 7
    assert finding.evidence["collective"]["waiting_ranks"] == [0, 1, 3]


def test_rank_that_entered_with_other_sizes_is_mismatched():
    entries = rows(
        *history(range(4), 6), *[e(r, 7, "started") for r in (0, 2, 3)], e(1, 7, "started", sizes=[[1024, 512]])
    )
    (finding,) = analyze("r", entries, WORLD, range(4))
    assert finding.ranks == [1]
    assert finding.evidence["missing_ranks"] == []
    assert finding.evidence["mismatched"] == [
        {
            "rank": 1,
            "op": "all_reduce",
            "input_sizes": [[1024, 512]],
            "output_sizes": [[1024, 512]],
            "input_dtypes": ["Float"],
            "output_dtypes": ["Float"],
        }
    ]
    assert finding.evidence["expected"]["input_sizes"] == MB4
    assert finding.evidence["collective"]["waiting_ranks"] == [0, 2, 3]


def test_all_to_all_sizes_differ_by_rank_without_a_mismatch():
    entries = rows(*[e(r, 1, "started", "all_to_all", [[r + 1, 8]], [[4 - r, 8]]) for r in range(4)])
    assert analyze("r", entries, WORLD, range(4)) == []


@pytest.mark.parametrize("state", ["completed", "started"])
def test_no_finding_when_every_member_entered_alike(state):
    # all completed: a clean dump; all inside it: an on-demand dump, or a stall no rank explains
    entries = rows(*history(range(4), 6), *[e(r, 7, state) for r in range(4)])
    assert analyze("r", entries, WORLD, range(4)) == []


def test_member_without_a_dump_is_missing_and_said_so():
    entries = rows(*history(range(3), 6), *[e(r, 7, "started") for r in range(3)])
    (finding,) = analyze("r", entries, groups(("0", [0, 1, 2, 3]), ranks=range(3)), range(3))
    assert finding.ranks == [3]
    assert finding.evidence["no_dump_ranks"] == [3]
    assert "no dump from rank 3)" in finding.summary


def test_groups_that_share_a_name_are_told_apart_by_their_members():
    # two tp groups both named "5": {0, 1} did 2 collectives, {2, 3} is inside its 4th
    tp = groups(("5", [0, 1]), ("5", [2, 3]), desc="tp")
    entries = rows(
        *[e(r, s, group="5") for r in (0, 1) for s in (1, 2)],
        *[e(r, s, group="5") for r in (2, 3) for s in (1, 2, 3)],
        *[e(r, 4, "started", group="5") for r in (2, 3)],
    )
    assert analyze("r", entries, tp, range(4)) == []
    # rank 3 falls behind: only {2, 3} is blocked, on rank 3
    (finding,) = analyze("r", entries[~((entries["rank"] == 3) & (entries["seq"] == 4))], tp, range(4))
    assert finding.ranks == [3]
    assert (finding.evidence["group_size"], finding.evidence["collective"]["waiting_ranks"]) == (2, [2])


def test_without_membership_the_members_are_the_ranks_that_recorded_the_group():
    entries = rows(*history(range(4), 6), *[e(r, 7, "started") for r in (0, 1, 3)])
    no_groups = pd.DataFrame(columns=["rank", "group", "desc", "members"])
    (finding,) = analyze("r", entries, no_groups, range(4))
    assert finding.ranks == [2]
    assert finding.evidence["group_desc"] is None
