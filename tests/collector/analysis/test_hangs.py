"""The hang analyzer on small frames: stall timeout, culprits by collective sequence, silent ranks. (On a
real torchrun job's stored steps and heartbeats: tests/collector/analysis/test_live_analysis.py, beside the live
verdict.)"""

import json

import pandas as pd
import pytest

from collector.analysis.analyzers.hangs import Settings, analyze
from tests.support.hang_frames import RANKS, S, beats, steps

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these


def test_no_finding_before_the_timeout():
    last_end = 20 * S
    hb = beats([(r, last_end + 25 * S, 10, "backward", "all_reduce", "world", 10, False) for r in RANKS])
    assert analyze(steps(), hb, now_ns=last_end + 25 * S) == []  # 25 s < floor of 30 s


def test_timeout_follows_the_step_time():
    # 20 s steps: the stall needs 5 x 20 = 100 s, not the 30 s floor
    st = steps(step_s=20.0)
    last_end = int(st["end_ts"].max())
    hb = beats([(r, last_end + 60 * S, 10, "backward", "all_reduce", "world", 10, False) for r in RANKS])
    assert analyze(st, hb, now_ns=last_end + 60 * S) == []
    hb = beats([(r, last_end + 110 * S, 10, "backward", "all_reduce", "world", 10, False) for r in RANKS])
    (finding,) = analyze(st, hb, now_ns=last_end + 110 * S)
    assert finding.evidence["timeout_s"] == pytest.approx(100.0)


def test_rank_that_never_entered_the_collective_is_the_culprit():
    now = 20 * S + 45 * S
    hb = beats(
        [
            (0, now - S, 10, "backward", "all_reduce", "world", 10, False),
            (1, now - S, 10, "forward", "all_reduce", "world", 9, True),  # stuck before collective #10
            (2, now - S, 10, "backward", "all_reduce", "world", 10, False),
            (3, now - S, 10, "backward", "all_reduce", "world", 10, False),
        ]
    )
    (finding,) = analyze(steps(), hb, now_ns=now)
    assert (finding.kind, finding.ranks, finding.severity) == ("hang", [1], "critical")
    assert finding.evidence["collective"] == {
        "op": "all_reduce",
        "group": "world",
        "seq": 10,
        "waiting_ranks": [0, 2, 3],
    }
    assert finding.evidence["culprit_last_seen"] == {1: {"step": 10, "phase": "forward"}}
    assert finding.step_start == 10 and "never entered" in finding.summary


def test_in_a_3d_job_the_waits_lead_through_groups_and_pipeline_peers_to_the_hung_rank():
    """8 ranks as (pp, dp, tp) = 2 x 2 x 2 (rank = 4 pp + 2 dp + tp): rank 5 hangs in its forward; its
    tensor-parallel peer 4 blocks in their all-reduce; stage 0's ranks 0 and 1 block receiving from 4 and
    5; the other replica's ranks block in data-parallel collectives of groups they share with those. The
    waits lead to rank 5 alone, and the pair blocked on it is named; no rank of another group is blamed
    for not entering a collective it is not in."""
    now = 20 * S + 45 * S
    rows = [  # rank, op, group, seq, done, peer, role
        (0, "recv", "pp0", 7, False, 4, "pp"),
        (1, "recv", "pp1", 7, False, 5, "pp"),
        (2, "reduce_scatter", "dp0", 3, False, None, "dp"),
        (3, "reduce_scatter", "dp1", 3, False, None, "dp"),
        (4, "all_reduce", "tp2", 12, False, None, "tp"),
        (5, "all_reduce", "tp2", 11, True, None, "tp"),
        (6, "all_gather", "dp2", 5, False, None, "dp"),
        (7, "all_gather", "dp3", 5, False, None, "dp"),
    ]
    hb = pd.DataFrame(
        [(r, now - S, 10, "forward", op, g, seq, done, peer, role) for r, op, g, seq, done, peer, role in rows],
        columns=["rank", "ts", "step", "phase", "op", "group", "seq", "done", "peer", "role"],
    )
    placement = pd.DataFrame(
        [(r, "h", (r // 2) % 2, r // 4, r % 2) for r in range(8)],
        columns=["rank", "host", "dp_rank", "pp_stage", "tp_rank"],
    )
    st = pd.DataFrame(
        [("r", rank, step, (step + 1) * 2 * S, 2.0) for step in range(10) for rank in range(8)],
        columns=["run_id", "rank", "step", "end_ts", "duration_s"],
    )
    (finding,) = analyze(st, hb, now_ns=now, placement=placement)
    assert finding.ranks == [5]
    assert finding.evidence["waiting_pairs"] == [
        [1, 5, "recv", "pp1"],
        [4, 5, "all_reduce", "tp2"],
        [7, 5, "all_gather", "dp3"],
    ]
    assert "rank 1 is blocked in recv of group pp1 with rank 5" in finding.summary
    assert "rank 5: in forward of step 10" in finding.summary


def test_rank_whose_heartbeats_stopped_is_the_culprit():
    now = 20 * S + 60 * S
    hb = beats(
        [(r, now - S, 10, "backward", "all_reduce", "world", 10, False) for r in (0, 1, 2)]
        + [(3, 20 * S + 5 * S, 10, "forward", "all_reduce", "world", 9, True)]
    )  # silent for 55 s
    (finding,) = analyze(steps(), hb, now_ns=now)
    assert finding.ranks == [3] and finding.evidence["silent_ranks"] == [3]


def test_a_job_that_ended_is_not_a_hang():
    now = 20 * S + 3600 * S  # an hour after the last step, every rank's heartbeats stopped with it
    hb = beats([(r, 20 * S + 2 * S, 10, "optimizer", "all_reduce", "world", 10, True) for r in RANKS])
    assert analyze(steps(), hb, now_ns=now) == []
    assert analyze(steps(), beats([]), now_ns=now) == []


def test_steps_lost_while_the_job_moves_on_are_no_hang():
    """A rank whose step spans stopped arriving holds the steps judged back (not every rank reported
    the next), while every rank's heartbeats say the job is steps further on: telemetry lost, not a stall."""
    now = 20 * S + 120 * S
    hb = beats([(r, now - S, 70, "backward", "all_reduce", "world", 69, True) for r in RANKS])
    assert analyze(steps(), hb, now_ns=now) == []


def test_without_collective_information_the_rank_behind_is_named():
    now = 20 * S + 45 * S
    hb = beats([(r, now - S, 10 if r != 2 else 9, "backward", None, None, None, None) for r in RANKS])
    (finding,) = analyze(steps(), hb, now_ns=now, settings=Settings())
    assert finding.ranks == [2]


def test_ranks_between_steps_are_placed_after_the_last_step_they_finished():
    """A heartbeat sent between two steps (a restore, a checkpoint, a data loader that hangs) names no
    step: the store's nullable column holds NA there. Such a rank is behind the ranks already in the
    next step; when every rank is between steps, none stands out."""
    now = 20 * S + 45 * S
    between = beats([(r, now - S, None, "", None, None, None, None) for r in RANKS])
    between["step"] = between["step"].astype("Int64")
    (finding,) = analyze(steps(), between, now_ns=now, settings=Settings())
    assert finding.ranks == [] and "no step has finished" in finding.summary
    one_behind = beats([(r, now - S, 10 if r != 2 else None, "forward", None, None, None, None) for r in RANKS])
    one_behind["step"] = one_behind["step"].astype("Int64")
    (finding,) = analyze(steps(), one_behind, now_ns=now, settings=Settings())
    assert finding.ranks == [2] and "rank 2: between steps, after step 9" in finding.summary, finding.summary


def test_a_heartbeat_of_a_step_its_rank_has_since_finished_says_nothing_of_where_it_is():
    """Rank 1 hung in step 5 and came back; the job ran its last steps (6 to 9) between two heartbeats,
    then ended, its end not yet arrived. The ranks' last heartbeats, of the hang, are steps behind the
    steps they finished: they say the ranks were alive, not that rank 0 is still blocked in all-reduce #5."""
    st = steps()
    last_end = int(st["end_ts"].max())
    hang = beats(
        [(0, last_end - 3 * S, 5, "backward", "all_reduce", "world", 5, False)]
        + [(r, last_end - 3 * S, 5, "forward", "all_reduce", "world", 4, True) for r in (1, 2, 3)]
    )
    assert analyze(st, hang, now_ns=last_end + 11 * S, settings=Settings(floor_s=10.0)) == []
    still = hang.assign(step=10)  # the same heartbeats, sent in the step after the last finished: a hang
    (finding,) = analyze(st, still, now_ns=last_end + 11 * S, settings=Settings(floor_s=10.0))
    assert finding.ranks == [1, 2, 3] and "not every rank has been heard from" in finding.summary
    # a hang in the step after: the rank whose last heartbeat is of the recovered hang is the one not there
    now = last_end + 11 * S
    lagging = beats(
        [(r, now - S, 10, "backward", "all_reduce", "world", 10, False) for r in (0, 1, 3)]
        + [(2, now - S, 5, "forward", "all_reduce", "world", 5, True)]
    )
    (finding,) = analyze(st, lagging, now_ns=now, settings=Settings(floor_s=10.0))
    assert finding.ranks == [2] and "rank 2 never entered" in finding.summary, finding.summary
    assert finding.evidence["culprit_last_seen"] == {2: {"step": None, "phase": None, "finished": 9}}
    json.dumps(finding.evidence, allow_nan=False)  # as the store keeps it


def test_silence_after_a_hang_is_no_recovery():
    """Rank 1 never entered all-reduce #10 and the others waited in it for 60 s; then every rank went
    quiet (killed, or its heartbeat thread gone): an hour later the job is hung still, as it stood when
    last heard from, and says since when it is silent."""
    last_end, heard = 20 * S, 20 * S + 60 * S
    hb = beats(
        [(r, heard, 10, "backward", "all_reduce", "world", 10, False) for r in (0, 2, 3)]
        + [(1, heard, 10, "forward", "all_reduce", "world", 9, True)]
    )
    (finding,) = analyze(steps(), hb, now_ns=last_end + 3600 * S)
    assert (finding.kind, finding.ranks, finding.step_start) == ("hang", [1], 10)
    assert finding.evidence["silent_since_ns"] == heard and finding.evidence["stalled_s"] == pytest.approx(3600)
    assert finding.summary.startswith("no step has finished for 3600 s: ranks 0, 2, 3 are blocked in all_reduce")
    assert finding.summary.endswith("every rank silent since 1970-01-01 00:01:20 UTC")


def test_a_stall_under_way_keeps_the_culprits_it_was_first_judged_with():
    """Rank 1 never entered all-reduce #10: the pass past the timeout names it. Then it comes back and
    the others run on while rank 3 lags behind them: the same stall, judged by later passes of the live
    engine, still names rank 1 (rank 3 is catching up, not hung), with the stall's length as of then."""
    from collector.analysis.analyzers import Frames
    from collector.analysis.analyzers.hangs import judge

    st, kept = steps(), {}
    first = beats(
        [(r, 20 * S + 40 * S, 10, "backward", "all_reduce", "world", 10, False) for r in (0, 2, 3)]
        + [(1, 20 * S + 40 * S, 10, "forward", "all_reduce", "world", 9, True)]
    )
    later = beats(
        [(r, 20 * S + 58 * S, 10, "backward", "all_reduce", "world", 12, False) for r in (0, 1, 2)]
        + [(3, 20 * S + 58 * S, 10, "forward", "all_reduce", "world", 11, True)]
    )

    def judged(heartbeats, now):
        frames = Frames("r", st, 10, 9, pd.DataFrame({"rank": list(RANKS)}), now, heartbeats=heartbeats, kept=kept)
        return judge(frames)

    (found,) = judged(first, 20 * S + 41 * S)
    assert found.ranks == [1]
    (again,) = judged(pd.concat([first, later]), 20 * S + 59 * S)
    assert again.ranks == [1] and again.evidence["stalled_s"] == pytest.approx(59)
    assert again.summary.startswith("no step has finished for 59 s: ranks 0, 2, 3 are blocked in all_reduce #10")


def test_a_stall_the_steps_closed_keeps_the_culprits_a_pass_named_while_it_was_under_way():
    """A pass just past the 30 s timeout names rank 1, never in all-reduce #10. A moment later rank 1 is
    back and rank 3 lags behind the others, still there a second past the timeout (the moment a stall
    the steps closed is judged at, where no pass saw it under way); then step 10 ends, 62 s after step 9.
    The pass that judges that step finds the stall rank 1's, as it stood past its timeout: rank 3 was
    catching up, not hung."""
    from collector.analysis.analyzers import Frames
    from collector.analysis.analyzers.hangs import judge

    st, kept = steps(), {}
    last_end = int(st["end_ts"].max())
    hung = beats(
        [(r, last_end + 30 * S, 10, "backward", "all_reduce", "world", 10, False) for r in (0, 2, 3)]
        + [(1, last_end + 30 * S, 10, "forward", "all_reduce", "world", 9, True)]
    )
    back = beats(
        [(r, last_end + 30.6 * S, 10, "backward", "all_reduce", "world", 12, False) for r in (0, 1, 2)]
        + [(3, last_end + 30.6 * S, 10, "forward", "all_reduce", "world", 11, True)]
    )
    ranks = pd.DataFrame({"rank": list(RANKS)})
    (found,) = judge(Frames("r", st, 10, 9, ranks, last_end + int(30.5 * S), heartbeats=hung, kept=kept))
    assert found.ranks == [1]

    closed = pd.concat([st, pd.DataFrame([("r", r, 10, last_end + 62 * S, 62.0) for r in RANKS], columns=st.columns)])
    heartbeats = pd.concat([hung, back])
    (judged,) = judge(Frames("r", closed, 10, 10, ranks, last_end + 63 * S, heartbeats=heartbeats, kept=kept))
    assert (judged.ranks, judged.step_start) == ([1], 10)
    assert judged.evidence["stalled_s"] == pytest.approx(31) and judged.evidence["first_judged_stalled_s"] < 31
    assert judged.summary.startswith("no step has finished for 31 s: ranks 0, 2, 3 are blocked in all_reduce #10")


def test_a_stall_nothing_was_heard_of_since_it_began_waits_for_the_ranks_heartbeats():
    """The pass past the timeout has only the heartbeats sent before the stall (delayed, or a collector
    that took the run over, or fell behind): every rank was in the last step's all-reduce then, alike.
    That is no hang yet (the telemetry may just be late) and nothing is kept: the next pass, with the
    stall's heartbeats come, names rank 1, never in all-reduce #10, and a pass after that keeps naming it."""
    from collector.analysis.analyzers import Frames
    from collector.analysis.analyzers.hangs import judge

    st, kept = steps(), {}
    last_end = int(st["end_ts"].max())
    before = beats([(r, last_end - S, 9, "backward", "all_reduce", "world", 9, False) for r in RANKS])
    during = beats(
        [(r, last_end + 11 * S, 10, "backward", "all_reduce", "world", 10, False) for r in (0, 2, 3)]
        + [(1, last_end + 11 * S, 10, "forward", "all_reduce", "world", 9, True)]
    )

    def judged(heartbeats, now):  # a 4 s floor: the 2 s steps' 10 s timeout, well within the heartbeats' 15 s
        frames = Frames("r", st, 10, 9, pd.DataFrame({"rank": list(RANKS)}), now, heartbeats=heartbeats, kept=kept)
        return judge(frames, Settings(floor_s=4.0))

    assert judged(before, last_end + 11 * S) == []
    (found,) = judged(pd.concat([before, during]), last_end + 12 * S)
    assert found.ranks == [1] and found.evidence["heard_in_stall"]
    (again,) = judged(pd.concat([before, during]), last_end + 14 * S)
    assert again.ranks == [1] and again.evidence["first_judged_stalled_s"] == pytest.approx(12)


def test_a_hang_of_16384_ranks_is_judged_in_seconds():
    """Every rank but one blocked in the same all-reduce: whom they wait for is worked out once for the
    collective, not once per rank over every other (which at this size takes minutes)."""
    import time

    import numpy as np

    n = 16384
    st = pd.DataFrame(
        {
            "run_id": "r",
            "rank": np.tile(np.arange(n), 10),
            "step": np.repeat(np.arange(10), n),
            "end_ts": (np.repeat(np.arange(10), n) + 1) * 2 * S,
            "duration_s": 2.0,
        }
    )
    now = 20 * S + 45 * S
    hb = beats([(r, now - S, 10, "backward", "all_reduce", "world", 10, False) for r in range(n)])
    hb.loc[7, ["seq", "done", "phase"]] = [9, True, "forward"]
    started = time.process_time()
    (finding,) = analyze(st, hb, now_ns=now)
    assert finding.ranks == [7] and len(finding.evidence["waiting_pairs"]) == 64  # the first 64 of them
    assert "are blocked in all_reduce #10 of group world, which rank 7 never entered" in finding.summary
    assert time.process_time() - started < 10
