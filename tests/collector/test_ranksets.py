"""Rank sets in words: ranges of consecutive ranks, the long tail counted, the same sets back."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector import ranksets
from collector.alerts.rules import short_ranks

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these


def test_ranges_read_as_people_write_them():
    assert ranksets.compact(range(160, 192)) == "160–191"
    assert ranksets.compact([12, *range(8)]) == "0–7, 12"
    assert ranksets.compact([3, 4]) == "3, 4"  # a pair is not a range
    assert ranksets.phrase([5]) == "rank 5" and ranksets.phrase([5, 5, 6, 7]) == "ranks 5–7"
    assert ranksets.compact(range(0, 512, 2)) == "0, 2, 4, 6, 8, 10 and 250 more"
    assert ranksets.compact([]) == ""
    assert short_ranks([3, 7, 9, 10, 11]) == "3,7,9-11"  # alert labels: the same ranges, ASCII


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 2000), max_size=300))
def test_compact_names_every_rank_once_and_no_other(ranks):
    text = ranksets.compact(ranks, max_ranges=len(ranks) + 1)
    back = set()
    for part in filter(None, text.split(", ")):
        a, _, b = part.partition("–")
        back |= set(range(int(a), int(b or a) + 1))
    assert back == ranks
    shown = ranksets.compact(ranks)
    assert shown.count(", ") < 2 * ranksets.MAX_RANGES  # bounded however many ranks (a pair is two)
    if match := re.search(r" and (\d+) more$", shown):
        assert int(match[1]) < len(ranks)
    assert ranksets.parse(ranksets.typed(ranks)) == sorted(ranks)  # a link's rank filter names the same set


def test_typed_rank_sets_read_as_people_type_them():
    assert ranksets.parse("3") == [3]
    assert ranksets.parse("3-7") == [3, 4, 5, 6, 7]
    assert ranksets.parse("3,9") == [3, 9]
    assert ranksets.parse(" 0–2, 12 ,") == [0, 1, 2, 12]  # as `compact` writes them, blanks and a trailing comma
    assert ranksets.parse("") == []
    for bad in ("x", "3-", "-3", "7-3", "3.5", f"0-{ranksets.MAX_PARSED}"):
        with pytest.raises(ValueError):
            ranksets.parse(bad)
