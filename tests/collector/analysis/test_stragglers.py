"""The straggler analyzer on small frames: culprits, patterns, noise immunity, cost."""

import re

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector.analysis.analyzers import Frames
from collector.analysis.analyzers.stragglers import analyze, judge
from rankwatch.agent import semconv as sc

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these

RANKS = 32  # four hosts of 8 ranks; four pipeline stages of 8 ranks, spread over the hosts


def frame(steps=40, jitter=0.02, slow=None, seed=0, compute=0.100, comm=0.020):
    """Rank-steps of a synchronous job: each step lasts as long as its slowest rank's compute,
    and every rank waits the difference. `slow`: {rank: (slowdown, from_step)}."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        c = compute * rng.lognormal(0, jitter, RANKS)
        for rank, (factor, start) in (slow or {}).items():
            if step >= start:
                c[rank] *= factor
        end = c.max()
        for rank in range(RANKS):
            wait = end - c[rank] + comm
            rows.append(("r", rank, step, c[rank] + wait, c[rank], wait))
    return pd.DataFrame(rows, columns=["run_id", "rank", "step", "duration_s", "compute_s", "comm_wait_s"])


PLACEMENT = pd.DataFrame(
    {"rank": range(RANKS), "host": [f"node{r // 8}" for r in range(RANKS)], "pp_stage": [r % 4 for r in range(RANKS)]}
)


def test_clean_run_with_2_percent_jitter_has_no_finding():
    for seed in range(5):
        assert analyze(frame(jitter=0.02, seed=seed), PLACEMENT) == []


@pytest.mark.parametrize("slowdown", [1.05, 1.10, 1.30])
def test_single_slow_rank_is_named_with_its_cost(slowdown):
    (finding,) = analyze(frame(slow={5: (slowdown, 20)}), PLACEMENT)
    assert (finding.kind, finding.ranks) == ("rank", [5])
    assert finding.score == pytest.approx(slowdown, rel=0.03)
    assert 12 <= finding.step_start <= 24
    # the others wait out the straggler's extra compute: about (slowdown - 1) x 100 ms per step
    assert finding.evidence["lost_s_per_step"] == pytest.approx((slowdown - 1) * 0.100, rel=0.5)
    assert finding.evidence["comm_wait_s"] < finding.evidence["peer_comm_wait_s"]


def test_a_frame_with_timestamps_and_data_times_some_ranks_lack_is_judged_alike():
    """As a caller may hand one (the demo's summary): steps' ends as timestamps, not nanoseconds, and a
    data time only some ranks report; the data times are the evidence's, without the missing ones."""
    steps = frame(slow={5: (1.3, 20)})
    timed = steps.assign(
        end_ts=pd.Timestamp("2026-01-01", tz="UTC") + pd.to_timedelta(steps["step"], unit="s"),
        data_s=np.where(steps["rank"] % 2 == 0, np.nan, 0.004),
    )
    (plain,), (finding,) = analyze(steps, PLACEMENT), analyze(timed, PLACEMENT)
    assert (finding.kind, finding.ranks, finding.step_start, finding.summary) == (
        plain.kind,
        plain.ranks,
        plain.step_start,
        plain.summary,
    )
    assert (finding.evidence["data_s"], finding.evidence["peer_data_s"]) == (0.004, 0.004)


def test_loop_without_phase_timings_is_judged_on_step_time_less_wait():
    steps = frame(slow={9: (1.2, 20)}).assign(compute_s=np.nan)
    (finding,) = analyze(steps, PLACEMENT)
    assert (finding.kind, finding.ranks) == ("rank", [9])
    assert finding.score == pytest.approx(1.2, rel=0.03)
    assert analyze(frame().assign(compute_s=np.nan), PLACEMENT) == []


def test_detected_within_ten_steps_of_onset():
    steps = frame(steps=40, slow={3: (1.05, 25)})
    found_at = next(s for s in range(25, 40) if analyze(steps[steps["step"] <= s], PLACEMENT))
    assert found_at - 25 < 10


def test_one_slow_step_never_fires():
    steps = frame()
    steps.loc[(steps["rank"] == 7) & (steps["step"] == 39), "compute_s"] *= 3
    assert analyze(steps, PLACEMENT) == []


def test_slow_node_is_named_as_a_node():
    (finding,) = analyze(frame(slow=dict.fromkeys(range(8, 16), (1.2, 10))), PLACEMENT)
    assert (finding.kind, finding.ranks) == ("node", list(range(8, 16)))
    assert "node1" in finding.summary


def test_slow_stage_is_named_as_a_stage():
    (finding,) = analyze(frame(slow=dict.fromkeys(range(1, RANKS, 4), (1.2, 10))), PLACEMENT)
    assert (finding.kind, finding.ranks) == ("stage", list(range(1, RANKS, 4)))


def test_random_slowness_is_widespread_not_a_rank():
    (finding,) = analyze(frame(jitter=0.3), PLACEMENT)
    assert finding.kind == "widespread"
    assert finding.evidence["cross_rank_cv"] > 0.2


def test_too_few_ranks_to_judge():
    assert analyze(frame()[lambda f: f["rank"] < 2], PLACEMENT) == []


def test_a_slow_node_reads_as_its_rank_range():
    (finding,) = analyze(frame(slow=dict.fromkeys(range(8, 16), (1.2, 10))), PLACEMENT)
    assert finding.summary.startswith("node node1 (ranks 8–15) computes ")


def samples(metric: str, values_by_rank: dict, per_rank: int = 10) -> list[tuple]:
    """Device samples (rank, metric, value): `per_rank` of each rank's value, or of its list of values."""
    rows = []
    for rank, value in values_by_rank.items():
        values = value if isinstance(value, list) else [value] * per_rank
        rows += [(rank, metric, v) for v in values]
    return rows


def devices(*groups) -> pd.DataFrame:
    return pd.DataFrame([row for group in groups for row in group], columns=["rank", "metric", "value"])


def test_hardware_evidence_explains_slow_ranks_by_their_gpus():
    """Rank 5's GPU is held back by heat, rank 9's memory is full and raises ECC errors and an
    XID; every GPU is power-capped, which explains no one rank."""
    ranks = range(RANKS)
    gpus = devices(
        samples(sc.CLOCK_EVENT_REASONS, {r: (0x4 | 0x20 | 0x40 if r == 5 else 0x4) for r in ranks}),
        samples(sc.FB_USED_MIB, {r: (81_000 if r == 9 else 60_000) for r in ranks}),
        samples(sc.FB_TOTAL_MIB, dict.fromkeys(ranks, 81_559)),
        samples(sc.ECC_SBE_VOLATILE, {r: ([4] * 5 + [10] * 5 if r == 9 else 0) for r in ranks}),
        samples(sc.ECC_DBE_VOLATILE, {r: ([0] * 5 + [1] * 5 if r == 9 else 0) for r in ranks}),
        [(9, sc.XID_ERRORS, 48.0)],
    )
    (finding,) = analyze(frame(slow={5: (1.3, 10), 9: (1.3, 10)}), PLACEMENT, devices=gpus)
    assert finding.ranks == [5, 9]
    assert finding.evidence["hardware"] == [
        {"cause": "clocks_held_back", "ranks": [5], "detail": "thermal slowdown, hardware thermal slowdown"},
        {"cause": "memory_full", "ranks": [9], "detail": "99% full"},
        {"cause": "ecc_errors", "ranks": [9], "detail": "6 corrected, 1 uncorrected ECC errors"},
        {"cause": "xid", "ranks": [9], "detail": "XID 48"},
    ]
    assert finding.summary.endswith(
        "; GPU clocks held back (thermal slowdown, hardware thermal slowdown) on rank 5; GPU memory 99% full on "
        "rank 9; 6 corrected, 1 uncorrected ECC errors on rank 9; XID 48 on rank 9"
    )


def test_no_hardware_evidence_where_every_gpu_is_alike():
    ranks = range(RANKS)
    gpus = devices(
        samples(sc.CLOCK_EVENT_REASONS, dict.fromkeys(ranks, 0x4)),  # the whole job capped
        samples(sc.FB_USED_MIB, dict.fromkeys(ranks, 81_000)),
        samples(sc.FB_TOTAL_MIB, dict.fromkeys(ranks, 81_559)),
    )
    (finding,) = analyze(frame(slow={5: (1.3, 10)}), PLACEMENT, devices=gpus)
    assert "hardware" not in finding.evidence and "; GPU" not in finding.summary


def pair(steps=80, jitter=0.02, slow=None, seed=0):
    """Rank-steps of a 2-rank synchronous job (`slow`: (slowdown, from_step) of rank 1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        c = 0.100 * rng.lognormal(0, jitter, 2)
        if slow and step >= slow[1]:
            c[1] *= slow[0]
        for rank in (0, 1):
            wait = c.max() - c[rank] + 0.02
            rows.append(("r", rank, step, c[rank] + wait, c[rank], wait))
    return pd.DataFrame(rows, columns=["run_id", "rank", "step", "duration_s", "compute_s", "comm_wait_s"])


def every_step(steps: pd.DataFrame) -> list:
    """The findings of every step judged on the steps before it, as the engine judges a run."""
    return judge(Frames("r", steps, 0, int(steps["step"].max()), pd.DataFrame({"rank": [0, 1]}), 0, world_size=2))


@settings(max_examples=30, deadline=None)
@given(jitter=st.floats(0.01, 0.05), seed=st.integers(0, 10**6))
def test_a_clean_pair_draws_no_finding_at_any_step(jitter, seed):
    assert every_step(pair(steps=150, jitter=jitter, seed=seed)) == []


@settings(max_examples=10, deadline=None)
@given(jitter=st.floats(0.01, 0.05), slowdown=st.floats(1.2, 2.0), seed=st.integers(0, 10**6))
def test_of_a_pair_the_rank_that_computes_longer_while_its_peer_waits_is_the_straggler(jitter, slowdown, seed):
    (finding,) = every_step(pair(steps=150, jitter=jitter, slow=(slowdown, 40), seed=seed))
    assert (finding.kind, finding.ranks, finding.step_end) == ("rank", [1], 149)
    assert abs(finding.step_start - 40) <= 6
    assert finding.evidence["comm_wait_s"] < finding.evidence["peer_comm_wait_s"]


def test_a_pair_whose_gap_is_under_the_floor_is_not_a_straggler():
    """5% between two ranks, steady and quiet: as often the host as a fault."""
    assert every_step(pair(steps=150, jitter=0.005, slow=(1.05, 0))) == []


def test_one_rank_is_not_judged_and_says_why():
    steps = frame()[lambda f: f["rank"] == 0]
    (finding,) = judge(Frames("r", steps, 0, 39, PLACEMENT, 0, world_size=1))
    assert (finding.kind, finding.severity) == ("not_judged", "info")
    assert "no peers" in finding.summary
    # a run whose other ranks have yet to report is not judged alone
    assert judge(Frames("r", steps, 0, 39, PLACEMENT, 0, world_size=32)) == []


def loader_frame(ranks: int, slow_rank: int, from_step: int, steps=40, data=0.0004, slow_data=0.050, seed=0):
    """Rank-steps of a synchronous job whose `slow_rank` waits `slow_data` for each batch from `from_step`
    on (a slow data loader) while its compute is its peers': the others wait for it in the all-reduce."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        compute = 0.060 * rng.lognormal(0, 0.02, ranks)
        waits_for_input = data * rng.lognormal(0, 0.1, ranks)
        if step >= from_step:
            waits_for_input[slow_rank] = slow_data * rng.lognormal(0, 0.02)
        busy = compute + waits_for_input
        for rank in range(ranks):
            wait = busy.max() - busy[rank] + 0.002
            rows.append(("r", rank, step, busy[rank] + wait, waits_for_input[rank], compute[rank], wait))
    columns = ["run_id", "rank", "step", "duration_s", "data_s", "compute_s", "comm_wait_s"]
    return pd.DataFrame(rows, columns=columns)


@pytest.mark.parametrize("ranks", [2, 4, 32])
def test_a_slow_data_loader_is_named_as_input_with_the_wait_it_costs_the_others(ranks):
    """A rank that waits 50 ms for each batch, its compute its peers': named, its phase input, and its cost
    the others' wait (about 50 ms per step), not the compute difference (about none)."""
    (finding,) = analyze(loader_frame(ranks, slow_rank=1, from_step=10))
    assert (finding.kind, finding.ranks, finding.evidence["phase"]) == ("rank", [1], "data")
    assert finding.evidence["phase_excess_s"] == pytest.approx(0.050, rel=0.1)
    assert finding.evidence["lost_s_per_step"] == pytest.approx(0.050, rel=0.2)
    assert finding.evidence["data_s"] > 20 * finding.evidence["peer_data_s"]
    assert "input (data loading)" in finding.summary and "ms per step" in finding.summary
    assert 4 <= finding.step_start <= 14


def handover_frame(ranks: int, until: int, slowdown: float, compute: float, seed: int) -> pd.DataFrame:
    """Rank-steps of a synchronous job whose rank 0 computes `slowdown` times longer than its peers up to step
    `until`, from where rank 1 waits 50 ms for each batch (a slow data loader) and rank 0 is its peers' like,
    for 40 steps."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(until + 40):
        c = compute * rng.lognormal(0, 0.05, ranks)
        data = np.full(ranks, 0.0002)
        if step < until:
            c[0] *= slowdown
        else:
            data[1] = 0.050
        busy = c + data
        for rank in range(ranks):
            wait = busy.max() - busy[rank] + 0.0005
            rows.append(("r", rank, step, busy[rank] + wait, data[rank], c[rank], wait))
    return pd.DataFrame(rows, columns=["run_id", "rank", "step", "duration_s", "data_s", "compute_s", "comm_wait_s"])


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.sampled_from([2, 4, 16]),
    until=st.integers(0, 30),
    slowdown=st.floats(1.3, 3.0),
    compute=st.floats(0.001, 0.015),
    seed=st.integers(0, 10**6),
)
def test_a_straggler_that_hands_over_to_a_slower_one_is_never_blamed_for_its_time(
    ranks, until, slowdown, compute, seed
):
    """Rank 0 slow at first, then rank 1's loader far slower: every step is judged as the engine does, and no
    finding names a rank the others did not wait for (its cost over its steps is positive: the window's medians
    lag the change, the others' wait does not); the job's last finding is rank 1's input, to its last step."""
    steps = handover_frame(ranks, until, slowdown, compute, seed)
    placement = pd.DataFrame({"rank": range(ranks)})
    found = judge(Frames("r", steps, 0, int(steps["step"].max()), placement, 0, world_size=ranks))
    assert all(f.evidence.get("lost_s_per_step", 1) > 0 for f in found), [f.summary for f in found]
    last = found[-1]
    assert (last.kind, last.ranks, last.evidence["phase"], last.step_end) == ("rank", [1], "data", until + 39), [
        f.summary for f in found
    ]


def test_a_slow_gpu_is_named_as_compute():
    (finding,) = analyze(frame(slow={5: (1.3, 20)}).assign(data_s=0.001), PLACEMENT)
    assert (finding.ranks, finding.evidence["phase"]) == ([5], "compute")
    said = re.search(r"rank 5 computes (\d+)% slower than its peers since step (\d+)", finding.summary)
    assert said and 27 <= int(said.group(1)) <= 33 and int(said.group(2)) == finding.step_start, finding.summary


@pytest.mark.parametrize("seed", range(8))
def test_a_noisy_jobs_straggler_is_never_called_widespread_once_it_slows(seed):
    """A job whose ranks' compute varies 15% step to step (widespread, and so said) gets a straggler 2x slow
    from step 30: from its fourth slow step on no verdict calls it uneven work, though its own verdict needs
    more slow steps to reach its z-score."""
    steps = frame(steps=48, jitter=0.15, slow={3: (2.0, 30)}, seed=seed)
    before = [f.kind for last in range(12, 30) for f in analyze(steps[steps["step"] <= last], PLACEMENT)]
    assert "widespread" in before
    for last in range(33, 48):
        found = analyze(steps[steps["step"] <= last], PLACEMENT)
        assert all(f.kind != "widespread" for f in found), (last, [f.summary for f in found])
