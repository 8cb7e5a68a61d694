"""The exposed-communication arithmetic (rankwatch/agent/timeline.py) on synthetic and recorded timelines.

Covered: union, subtract and clip against a brute-force count on a ns grid
(hypothesis); the bounds of `exposed` (0 <= exposed <= step, <= the union of
the communication), equal to the union when no compute overlaps, zero when
compute covers it all; a stream's operations started no earlier than the one
before them ended; and a single-GPU DDP step's timeline, as CUDA events record
it, whose exposed wait is the last bucket's all-reduce alone.
"""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.agent.timeline import clip, exposed, length, serialized, subtract, union

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these

SETTINGS = settings(max_examples=200, deadline=None)
interval = st.tuples(st.integers(0, 200), st.integers(0, 60)).map(lambda t: (t[0], t[0] + t[1]))
intervals = st.lists(interval, max_size=12)


def covered(spans) -> set[int]:
    """The ns ticks [t, t + 1) the intervals cover."""
    return {t for s, e in spans for t in range(s, e)}


@SETTINGS
@given(intervals)
def test_union_is_disjoint_sorted_and_covers_the_same_time(spans):
    merged = union(spans)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(merged))
    assert all(s < e for s, e in merged)
    assert covered(merged) == covered(spans)
    assert length(spans) == len(covered(spans))


@SETTINGS
@given(intervals, intervals, interval)
def test_subtract_and_clip_match_a_count_on_the_grid(spans, holes, window):
    assert covered(subtract(spans, holes)) == covered(spans) - covered(holes)
    assert covered(clip(spans, window)) == covered(spans) & covered([window])


@SETTINGS
@given(intervals, intervals, interval)
def test_exposed_is_the_communication_no_compute_covers_within_the_step(comm, compute, step):
    wait = exposed(comm, compute, step)
    assert wait == len((covered(comm) - covered(compute)) & covered([step]))
    assert 0 <= wait <= step[1] - step[0]
    assert wait <= length(comm)


@SETTINGS
@given(intervals, interval)
def test_exposed_is_all_communication_without_compute_and_none_under_it(comm, step):
    inside = clip(comm, step)
    assert exposed(inside, [], step) == length(inside)
    assert exposed(inside, [step], step) == 0
    assert exposed(inside, inside, step) == 0


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100)), max_size=10))
def test_serialized_operations_run_one_at_a_time_in_issue_order(steps):
    launches, t = [], 0
    for gap, duration in steps:  # launched in order; each ends at least after its own launch
        t += gap
        launches.append((t, t + duration))
    ran = serialized(launches)
    for (launch, end), (start, finish) in zip(launches, ran):
        assert finish == end and launch <= start <= end
    assert all(a[1] <= b[0] or b[0] == b[1] for a, b in itertools.pairwise(ran))


def test_single_gpu_ddp_step_exposes_only_the_last_bucket():
    """One rank of DDP on one GPU, as its CUDA events would read (µs): backward's buckets are
    ready every 4 ms and each all-reduce (a copy, no peer) takes 30 µs on NCCL's stream; DDP's wait
    at the end of backward is the last bucket's all-reduce; then the optimizer."""
    us = 1000
    forward, backward_start, backward_end = (0, 10_000 * us), 10_000 * us, 30_030 * us
    ready = [backward_start + k * 4_000 * us for k in range(1, 6)]  # the last at 30 ms
    buckets = serialized([(r, r + 30 * us) for r in ready])
    compute = subtract(
        [forward, (backward_start, backward_end), (backward_end, 35_000 * us)], [(ready[-1], backward_end)]
    )
    assert exposed(buckets, compute, (0, 35_000 * us)) == 30 * us
