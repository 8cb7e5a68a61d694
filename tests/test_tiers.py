"""The memory-tier analyzer on small frames: swap-bound steps and the tier that limits them, a slow disk
against its peers, its own past or the probe, a checkpoint's cost to the swaps, and the overlap what-if."""

import numpy as np
import pandas as pd
import pytest

from collector.analysis.analyzers import Tiers
from collector.analysis.analyzers.tiers import CONTENTION, SLOW_DISK, SWAP_BOUND, analyze, whatif
from collector.quantities import duration

MB = 1e6
S = 10**9
STATE = 4 * MB  # bytes each way per step


def run(ranks=2, steps=24, bw=lambda rank, step: 600 * MB, compute_s=0.05, probe=(1500 * MB, 800 * MB), hosts=None):
    """A serial offload run: each rank-step computes, then reads and writes its state at `bw(rank, step)`
    bytes/s, exposed (after backward), and steps the optimizer on the host for 2 ms."""
    rows, moves = [], []
    for step in range(steps):
        for rank in range(ranks):
            seconds = STATE / bw(rank, step)
            start = step * S
            read_end = start + int((compute_s + seconds) * S)
            end = read_end + int((seconds + 0.002) * S)
            moves += [
                (rank, step, "disk", "host", STATE, seconds, start + int(compute_s * S), read_end),
                (rank, step, "host", "disk", STATE, seconds, read_end, read_end + int(seconds * S)),
            ]
            rows.append((rank, step, end, (end - start) / S, compute_s, 2 * seconds, 2 * seconds, 0.002))
    return Tiers(
        pd.DataFrame(
            rows, columns=["rank", "step", "end_ts", "duration_s", "compute_s", "transfer_s", "exposed_s", "host_s"]
        ),
        pd.DataFrame(moves, columns=["rank", "step", "src", "dst", "bytes", "seconds", "start_ns", "end_ns"]),
        pd.DataFrame([(r, *probe) for r in range(ranks)], columns=["rank", "read_bps", "write_bps"]),
        pd.DataFrame(columns=["rank", "step", "start_ns", "end_ns"]),
    )


def placement(ranks=2, per_host=8):
    return pd.DataFrame({"rank": range(ranks), "host": [f"node-{r // per_host}" for r in range(ranks)]})


def kinds(found):
    return {(f.kind, tuple(f.ranks)) for f in found}


def test_a_healthy_run_whose_swaps_compute_hides_has_no_finding():
    tiers = run(bw=lambda rank, step: 4000 * MB)  # 2 ms of swaps in 55 ms steps
    assert analyze("r", tiers, placement(), 23) == []


def test_a_slow_disk_is_named_against_its_peers_since_it_slowed():
    tiers = run(ranks=4, bw=lambda rank, step: 20 * MB if rank == 2 and step >= 15 else 600 * MB)
    (slow,) = [f for f in analyze("r", tiers, placement(4), 23) if f.kind == SLOW_DISK]
    assert (slow.ranks, slow.step_start) == ([2], 15)
    assert slow.summary.startswith("rank 2 swaps to disk at 20 MB/s since step 15, against 600 MB/s its peers'")
    assert analyze("r", tiers, placement(4), 14) == [] or SLOW_DISK not in {
        f.kind for f in analyze("r", tiers, placement(4), 14)
    }


def test_a_disk_slow_on_the_first_steps_alone_is_not_named():
    """The shared disk of a busy host is slow for a step or two at the start: over the first steps a window
    holds only those, so no verdict is drawn until a whole window is read."""
    tiers = run(ranks=2, bw=lambda rank, step: 60 * MB if rank == 1 and step < 2 else 600 * MB)
    for last in range(24):
        assert SLOW_DISK not in {f.kind for f in analyze("r", tiers, placement(2), last)}, last


def test_a_slow_disk_that_recovered_within_the_window_is_named_since_it_slowed():
    tiers = run(ranks=4, bw=lambda rank, step: 20 * MB if rank == 2 and 10 <= step <= 20 else 600 * MB)
    (slow,) = [f for f in analyze("r", tiers, placement(4), 23) if f.kind == SLOW_DISK]  # steps 16-20 of 16-23
    assert (slow.ranks, slow.step_start) == ([2], 10)


def test_a_lone_rank_is_judged_against_its_own_past_and_from_the_start_against_the_probe():
    slowed = run(ranks=1, bw=lambda rank, step: 20 * MB if step >= 12 else 600 * MB)
    (slow,) = [f for f in analyze("r", slowed, placement(1), 23) if f.kind == SLOW_DISK]
    assert slow.evidence["by_rank"]["0"]["reference"] == "before" and slow.step_start == 12
    always = run(ranks=1, bw=lambda rank, step: 20 * MB)
    (slow,) = [f for f in analyze("r", always, placement(1), 23) if f.kind == SLOW_DISK]
    assert slow.evidence["by_rank"]["0"]["reference"] == "probe"
    fair = run(ranks=1, bw=lambda rank, step: 400 * MB)  # a quarter of the probe: small blocks, not a slow disk
    assert SLOW_DISK not in {f.kind for f in analyze("r", fair, placement(1), 23)}


@pytest.mark.parametrize(
    "probed, tier", [(150 * MB, "disk"), (1200 * MB, "access_pattern")], ids=["near-the-probe", "far-below-it"]
)
def test_a_swap_bound_run_is_told_which_tier_limits_it_and_what_overlap_would_give(probed, tier):
    bw = 100 * MB
    tiers = run(bw=lambda rank, step: bw, probe=(probed, probed))
    (bound,) = analyze("r", tiers, placement(), 23)
    assert (bound.kind, bound.ranks, bound.evidence["limit"]["tier"]) == (SWAP_BOUND, [0, 1], tier)
    swaps = 2 * STATE / bw
    what = bound.evidence["whatif"]
    assert what["serial_s"] == pytest.approx(0.05 + swaps + 0.002, rel=1e-3)
    assert what["overlap_s"] == pytest.approx(max(0.05, swaps), rel=1e-3)
    assert f"a step would take {duration(what['overlap_s'])} against {duration(what['serial_s'])}" in bound.summary


def test_whatif_takes_the_slowest_rank_of_each_step():
    steps = pd.DataFrame(
        {
            "rank": [0, 1, 0, 1],
            "step": [0, 0, 1, 1],
            "duration_s": [0.10, 0.30, 0.10, 0.30],
            "exposed_s": [0.02, 0.20, 0.02, 0.20],
            "transfer_s": [0.05, 0.20, 0.05, 0.20],
            "host_s": [0.01, 0.05, 0.01, 0.05],
        }
    )
    what = whatif(steps)
    assert (what["serial_s"], what["overlap_s"], what["rest_s"]) == pytest.approx((0.30, 0.20, 0.05))


def test_a_checkpoint_written_while_its_hosts_ranks_swap_is_charged_with_the_bandwidth_it_cost():
    slowed = {(r, s) for r in (0, 1) for s in (20, 21)}
    tiers = run(ranks=3, bw=lambda rank, step: 150 * MB if (rank, step) in slowed else 600 * MB)
    checkpoint = pd.DataFrame(  # both ranks of the host write their share of it: one write of its disk
        [(0, 20, 20 * S, 21 * S), (1, 20, 20 * S + S // 2, 22 * S)], columns=["rank", "step", "start_ns", "end_ns"]
    )
    tiers = Tiers(tiers.steps, tiers.transfers, tiers.probes, checkpoint)
    found = analyze("r", tiers, placement(3, per_host=2), 23)
    (contention,) = [f for f in found if f.kind == CONTENTION]
    assert contention.ranks == [0, 1]  # rank 2 is on another host: its swaps are not on that disk
    assert contention.evidence["checkpoint_step"] == 20
    assert contention.evidence["during_bps"] == pytest.approx(150 * MB)
    assert contention.evidence["outside_bps"] == pytest.approx(600 * MB)
    assert contention.summary.startswith("the checkpoint of step 20, written to the disk ranks 0, 1 swap to")
    assert kinds(found) >= {(CONTENTION, (0, 1))}


def test_on_cpus_that_compute_the_copies_cpu_time_and_the_host_optimizer_do_not_hide():
    """A rank computing on the host's CPUs: overlapped, its page-cache copies' CPU time and its host
    optimizer stay on the compute's side; the copies' waiting (the disk's) still hides under it."""
    steps = pd.DataFrame(
        {
            "rank": [0, 0],
            "step": [0, 1],
            "duration_s": [0.10, 0.10],
            "exposed_s": [0.04, 0.04],
            "transfer_s": [0.04, 0.04],
            "transfer_cpu_s": [0.01, 0.01],
            "host_s": [0.01, 0.01],
            "on_cpu": [True, True],
        }
    )
    assert whatif(steps)["overlap_s"] == pytest.approx(0.05 + 0.01 + 0.01)  # the rest, the copies' CPU, the host's
    assert whatif(steps.assign(on_cpu=False))["overlap_s"] == pytest.approx(0.05)  # a device computes: all hidden


def test_each_ranks_peers_median_is_the_median_of_the_others():
    import numpy as np

    from collector.analysis.analyzers.tiers import _others_median

    rng = np.random.default_rng(0)
    for n in (2, 3, 4, 5, 10, 11, 64):
        values = np.round(rng.random(n), 1)  # ties too
        assert np.allclose(_others_median(values), [np.median(np.delete(values, i)) for i in range(n)])


@pytest.mark.parametrize("seed", range(6))
def test_a_slow_disks_onset_is_where_its_own_bandwidth_changes_level_whatever_the_machine_does(seed):
    """A loaded machine slows every rank's disk for a step now and then, before the fault as after it: the
    onset is the step the slow rank's own series drops at, not one of those noisy steps (a threshold set
    by peers a loaded disk slows too would take the first of them)."""
    rng = np.random.default_rng(seed)
    # steps the whole host's disk is busy (a third of its bandwidth), the one before the fault among them
    busy = {13, *rng.choice(np.arange(2, 13), size=2, replace=False).tolist()}
    noise = rng.lognormal(0, 0.1, (4, 24))

    def bw(rank, step):
        level = 40 * MB if rank == 2 and step >= 14 else 600 * MB
        return level * noise[rank, step] / (3.2 if step in busy else 1)

    (slow,) = [f for f in analyze("r", run(ranks=4, bw=bw), placement(4), 23) if f.kind == SLOW_DISK]
    assert (slow.ranks, slow.step_start) == ([2], 14)
