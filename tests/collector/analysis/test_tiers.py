"""The memory-tier analyzer on small frames: swap-bound steps and the tier that limits them, a slow disk
against its peers, its own past or the probe, a checkpoint's cost to the swaps, host-bound steps, and the
overlap what-if."""

import numpy as np
import pandas as pd
import pytest

from collector.analysis.analyzers import Frames, Tiers
from collector.analysis.analyzers.tiers import CONTENTION, HOST_BOUND, SLOW_DISK, SWAP_BOUND, analyze, judge, whatif
from collector.quantities import duration

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these

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


@pytest.mark.parametrize("seed", range(8))
def test_a_slow_disks_onset_is_where_it_fell_behind_its_peers_whatever_the_machine_does(seed):
    """A loaded machine slows every rank's disk for a step now and then, before the fault as after it, by up to
    a sixth: the onset is the step the slow rank fell behind its peers at, not one of those busy steps (a
    threshold set by peers a loaded disk slows too would take the first of them; the rank's own series, the
    busy step just before the fault, where its bandwidth falls as far as the fault's)."""
    rng = np.random.default_rng(seed)
    # steps the whole host's disk is busy, the one before the fault among them
    busy = {13, *rng.choice(np.arange(2, 13), size=2, replace=False).tolist()}
    busy_by = rng.uniform(2, 6)
    noise = rng.lognormal(0, 0.1, (4, 24))

    def bw(rank, step):
        level = 40 * MB if rank == 2 and step >= 14 else 300 * MB
        return level * noise[rank, step] / (busy_by if step in busy else 1)

    (slow,) = [f for f in analyze("r", run(ranks=4, bw=bw), placement(4), 23) if f.kind == SLOW_DISK]
    assert (slow.ranks, slow.step_start) == ([2], 14)


def host_run(ranks=2, steps=24, host_s=lambda rank, step: 0.7, rest_s=0.25, copies_s=0.03, on_cpu=False):
    """An offloaded run whose optimizer steps on the host: each rank-step computes for `rest_s`, copies its
    gradients and parameters between GPU and pinned memory (`copies_s`, exposed) and steps AdamW on the host
    for `host_s(rank, step)`, back to back."""
    rows = []
    for step in range(steps):
        for rank in range(ranks):
            seconds = rest_s + copies_s + host_s(rank, step)
            rows.append((rank, step, (step + 1) * S, seconds, copies_s, copies_s, 0.0, host_s(rank, step), on_cpu))
    columns = ["rank", "step", "end_ts", "duration_s", "transfer_s", "exposed_s", "transfer_cpu_s", "host_s", "on_cpu"]
    empty = pd.DataFrame(columns=["rank", "step", "src", "dst", "bytes", "seconds", "start_ns", "end_ns"])
    return Tiers(
        pd.DataFrame(rows, columns=columns),
        empty,
        pd.DataFrame(columns=["rank", "read_bps", "write_bps"]),
        pd.DataFrame(columns=["rank", "step", "start_ns", "end_ns"]),
    )


def test_a_step_mostly_host_work_is_host_bound_with_what_overlap_and_a_faster_host_would_give():
    """712 ms of host optimizer in a 982 ms step (an offloaded AdamW on a GPU host): the ranks, the host
    work's share and time per step, and the step overlapped (the longest part) or with a host twice as fast."""
    tiers = host_run(host_s=lambda rank, step: 0.712 if step >= 10 else 0.1)
    (bound,) = analyze("r", tiers, placement(), 23)
    assert (bound.kind, bound.ranks, bound.step_start, bound.severity) == (HOST_BOUND, [0, 1], 16, "warning")
    assert bound.score == pytest.approx(0.712 / 0.992)
    what, faster = bound.evidence["whatif"], bound.evidence["faster_host"]
    assert what["serial_s"] == pytest.approx(0.992) and what["overlap_s"] == pytest.approx(0.712)
    assert faster["serial_s"] == pytest.approx(0.25 + 0.03 + 0.356) and faster["overlap_s"] == pytest.approx(0.356)
    assert bound.evidence["host_s"] == pytest.approx(0.712)
    assert bound.summary.startswith(
        "ranks 0, 1 spend 72% of each step on host work (712 ms per step) since step 16; overlapped with the rest "
        "of the step a step would take 712 ms against 992 ms back to back, and with a host twice as fast 356 ms "
        "(636 ms back to back)"
    ), bound.summary
    earlier = [f for f in analyze("r", tiers, placement(), 9) if f.kind == HOST_BOUND]
    assert earlier == []  # 100 ms of 380: the device's work is the step's most


def test_host_bound_names_the_ranks_whose_host_work_is_most_of_the_step_alone():
    tiers = host_run(ranks=4, host_s=lambda rank, step: 0.5 if rank == 3 else 0.05)
    assert kinds(analyze("r", tiers, placement(4), 23)) == {(HOST_BOUND, (3,))}


def test_on_cpus_that_compute_the_step_overlap_hides_no_host_work():
    (bound,) = analyze("r", host_run(on_cpu=True), placement(), 23)
    assert bound.evidence["whatif"]["overlap_s"] == pytest.approx(0.25 + 0.7)  # the copies alone hide
    assert "on CPUs that also compute the step, overlap hides none of it" in bound.summary


def test_a_judged_pass_draws_one_host_bound_episode_since_its_onset():
    tiers = host_run(host_s=lambda rank, step: 0.712 if step >= 10 else 0.1)
    (bound,) = judge(Frames("r", tiers.steps, 0, 23, placement(), 0, tiers=lambda: tiers))
    assert (bound.kind, bound.step_start, bound.step_end) == (HOST_BOUND, 10, 23)
