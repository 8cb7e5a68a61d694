"""The link analyzer on small frames: a slow link is pinned on the rank whose groups are all slow,
or on the group's members when only one of its groups can be compared; noise never fires."""

import numpy as np
import pandas as pd
import pytest

from collector.analysis.analyzers.links import analyze


def frame(pp=4, dp=8, tp=2, steps=20, slow=None, jitter=0.03, seed=0):
    """Collectives of a Megatron-ordered job (rank = stage * dp * tp + replica * tp + tp rank): a
    data-parallel all-reduce per step in each (stage, tp rank) group, and a tensor-parallel one in
    each (stage, replica) group when tp > 1. `slow`: {rank: factor}, that rank's link divides
    the bandwidth of every group it is in."""
    rng = np.random.default_rng(seed)
    rows = []
    for rank in range(pp * dp * tp):
        stage, replica, t = rank // (dp * tp), (rank // tp) % dp, rank % tp
        groups = [(f"dp{stage}.{t}", dp, 100.0)] + ([(f"tp{stage}.{replica}", tp, 300.0)] if tp > 1 else [])
        for group, size, busbw in groups:
            members = [r for r in range(pp * dp * tp) if _group_of(r, dp, tp, group)]
            factor = max([f for r, f in (slow or {}).items() if r in members], default=1.0)
            for step in range(steps):
                bw = busbw * rng.lognormal(0, jitter) / factor
                rows.append(("r", rank, step, "all_reduce", group, size, 0.05 * 100.0 / bw, bw))
    return pd.DataFrame(
        rows, columns=["run_id", "rank", "step", "name", "comm_group", "group_size", "duration_s", "busbw_gbps"]
    )


def _group_of(rank, dp, tp, group):
    stage, replica, t = rank // (dp * tp), (rank // tp) % dp, rank % tp
    return group in (f"dp{stage}.{t}", f"tp{stage}.{replica}")


def test_slow_link_is_pinned_on_the_rank_its_groups_share():
    (finding,) = analyze(frame(slow={21: 3.0}), step_s=1.0)
    assert (finding.analyzer, finding.kind, finding.ranks) == ("links", "link", [21])
    assert finding.score == pytest.approx(3.0, rel=0.1)
    assert set(finding.evidence["groups"]) == {"dp1.1", "tp1.2"}
    # the data-parallel all-reduce takes 3x its 50 ms: ~100 ms more per step, plus the tensor-parallel one
    assert finding.evidence["lost_s_per_step"] == pytest.approx(0.1 + 0.1 / 3, rel=0.15)
    assert finding.evidence["lost_percent"] == pytest.approx(100 * finding.evidence["lost_s_per_step"])


def test_without_a_second_kind_of_group_the_slow_groups_members_are_named():
    (finding,) = analyze(frame(tp=1, slow={21: 2.0}))
    group = [r for r in range(32) if r // 8 == 21 // 8]
    assert (finding.kind, finding.ranks) == ("link", group)
    assert finding.score == pytest.approx(2.0, rel=0.1)


def test_a_straggler_in_a_group_is_not_a_slow_link():
    # the others of its group enter early and wait: their collectives look 3x slower, its own does not
    ops = frame()
    waited = (ops["comm_group"] == "dp1.1") & (ops["rank"] != 21)
    ops.loc[waited, "busbw_gbps"] /= 3
    ops.loc[waited, "duration_s"] *= 3
    assert analyze(ops) == []


def test_two_unrelated_slow_links_are_two_findings():
    findings = analyze(frame(pp=8, tp=1, slow={3: 2.0, 27: 2.0}))
    assert sorted(f.ranks for f in findings) == [list(range(8)), list(range(24, 32))]


@pytest.mark.parametrize("seed", range(5))
def test_clean_collectives_with_3_percent_jitter_have_no_finding(seed):
    assert analyze(frame(seed=seed)) == []


def test_a_mild_slowdown_under_the_threshold_is_not_a_finding():
    assert analyze(frame(slow={21: 1.1})) == []


def test_a_group_without_peers_is_not_judged():
    assert analyze(frame(pp=1, tp=1, slow={3: 3.0})) == []


def test_ops_without_group_or_bandwidth_are_ignored():
    ops = frame().assign(comm_group=None)
    assert analyze(ops) == []
