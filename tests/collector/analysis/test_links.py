"""The link analyzer on small frames: a slow link is pinned on the rank whose groups are all slow,
or on the group's members when only one of its groups can be compared; noise never fires."""

import numpy as np
import pandas as pd
import pytest

from collector.analysis.analyzers.links import analyze

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these


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


def test_among_few_noisy_peers_a_group_at_a_third_of_their_bandwidth_is_slow():
    """Four tensor-parallel groups (a 2 x 2 x 2 job's) whose bandwidth jitters 25% from step to step:
    the MAD of four is too loose for the z-score, but a group at a third of its peers' bandwidth is
    slow; a noisy group at 80% of them is not."""

    def job(slow: float):
        ops = frame(pp=2, dp=2, tp=2, jitter=0.25, slow={5: slow}, seed=1)
        return ops[ops["comm_group"].str.startswith("tp")].assign(role="tp")

    (finding,) = analyze(job(3.0))
    assert finding.ranks == [4, 5] and set(finding.evidence["groups"]) == {"tp1.0"}
    assert analyze(job(1.25)) == []


def test_groups_of_different_mesh_dimensions_are_not_each_others_peers():
    """A 2 x 2 x 2 job's data- and tensor-parallel groups both have 2 ranks; the tensor-parallel ones run
    at 3x the bandwidth: compared with each other as peers, every data-parallel group would look slow."""
    ops = frame(pp=2, dp=2, tp=2, jitter=0.03)
    assert analyze(ops.assign(role=ops["comm_group"].str[:2])) == []


def test_latency_bound_and_point_to_point_operations_are_not_judged():
    """A gradient norm's 4-byte all-reduce and a pipeline's receives (which last until the peer sends)
    say nothing of a link's bandwidth, however slow they look."""
    ops = frame(slow={21: 3.0}).assign(bytes=4)
    assert analyze(ops) == []
    assert analyze(frame(slow={21: 3.0}).assign(name="recv")) == []
