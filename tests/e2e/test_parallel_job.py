"""The reference trainer in 3D end to end: one real 8-rank torchrun job (`rankwatch train --nproc 8
--dp 2 --tp 2 --pp 2`: FSDP2 over dp, DTensor tensor parallelism over tp, a 1F1B pipeline over pp, on
gloo) sending through the agent to a real collector that analyzes it live, with a fault for each
analyzer in turn:

  steps  2-11  stage 1 computes 3x longer                (slow-stage:stage=1)
  steps 14-    rank 2 computes 3x longer                  (straggler: one rank of one dp replica)
  step  22     the loss spikes 50x                        (rolled back by the collector, restored sharded)
  steps 26-    rank 5's tensor-parallel all-reduces 4x    (slow-link:group=tp)
  step  34     rank 6 stops for 25 s in its forward       (hang: the stages and groups around it block)

Each test reads what it checks from the store after the job: every collective of the job with its
mesh dimension, the pipeline's bubble, each analyzer's finding, the rollback, the what-if. The
machine has 2 cores for 8 ranks, so compute is noisy: the straggler runs to the end, so that it is
slow in most of any window the analyzer judges it over (stragglers.py grows its window with the noise).
"""

import json

import pytest

from rankwatch.launch import train
from tests.support.collectors import job_collector
from tests.support.commands import rankwatch_in_process
from tests.support.otlp_payloads import query

pytestmark = [pytest.mark.long, pytest.mark.timeout(2 * 300)]  # one job of 8 ranks: 182 s seen under load

RUN = "run-3d"
STEPS = 38
STAGE, STRAGGLER, SPIKE, LINK, HANG = (2, 12), 14, 22, 26, 34
HANG_S = 25  # a stall is five typical steps at least: ~10 s here, and twice that on a loaded machine
FAULTS = [
    f"slow-stage:stage=1,slowdown=3,from={STAGE[0]},to={STAGE[1]}",
    f"straggler:rank=2,slowdown=3,from={STRAGGLER}",
    f"spike:at={SPIKE},scale=50",
    f"slow-link:rank=5,factor=4,group=tp,from={LINK}",
    f"hang:rank=6,at={HANG},seconds={HANG_S}",
]


def coordinates(rank: int) -> tuple[int, int, int]:
    """(pp stage, dp replica, tp rank) of a rank of the (pp, dp, tp) = (2, 2, 2) mesh."""
    return rank // 4, rank // 2 % 2, rank % 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    directory = tmp_path_factory.mktemp("parallel-job")
    with job_collector(directory, "--analyze-every", "0.5", "--hang-after", "7") as collector:
        status = train(
            nproc=8,
            steps=STEPS,
            run_id=RUN,
            faults=FAULTS,
            collector=collector.url,
            token=collector.token,
            store=collector.db,
            trainer_args=["--dp", "2", "--tp", "2", "--pp", "2", "--snapshot-every", "2", "--ckpt-every", "20"],
        )
    assert status == 0
    return collector.db


def findings(db, analyzer: str) -> list[tuple]:
    return [
        (kind, list(ranks), start, end, summary, json.loads(evidence))
        for kind, ranks, start, end, summary, evidence in query(
            db,
            "SELECT kind, ranks, step_start, step_end, summary, evidence FROM findings "
            "WHERE run_id = ? AND analyzer = ? ORDER BY step_start",
            [RUN, analyzer],
        )
    ]


def test_every_rank_knows_its_place_in_the_mesh(job):
    placement = query(job, "SELECT rank, pp_stage, dp_rank, tp_rank FROM ranks WHERE run_id = ? ORDER BY rank", [RUN])
    assert placement == [(r, *coordinates(r)) for r in range(8)]


def test_every_collective_is_recorded_with_its_mesh_dimension(job):
    """FSDP2's all-gathers and reduce-scatters over dp, tensor parallelism's functional all-reduces over tp
    (in forward and backward: 4 a microbatch on this one-block stage), the stages' sends and receives
    over pp with their peer; on every rank, every step."""
    rows = query(
        job,
        """SELECT rank, name, attrs->>'$."rankwatch.comm.role"' AS role, count(DISTINCT step),
                  count(*) FILTER (WHERE attrs->>'$."rankwatch.comm.peer"' IS NOT NULL),
                  min(CAST(attrs->>'$."rankwatch.comm.peer"' AS INTEGER)), max(group_size)
           FROM ops WHERE run_id = ? AND kind = 'comm' AND step > 0 AND step < ? GROUP BY ALL""",
        [RUN, HANG],
    )
    seen = {(rank, name, role): (steps, peered, peer, size) for rank, name, role, steps, peered, peer, size in rows}
    for rank in range(8):
        stage = coordinates(rank)[0]
        every = HANG - 1  # steps 1 to the hang's, each once
        assert seen[(rank, "all_gather", "dp")][0] == every and seen[(rank, "all_gather", "dp")][3] == 2
        assert seen[(rank, "reduce_scatter", "dp")][0] == every
        assert seen[(rank, "all_reduce", "tp")][0] == every
        pipeline = {name: v for (r, name, role), v in seen.items() if r == rank and role == "pp" and v[1]}
        assert pipeline, f"rank {rank} recorded no send or receive with a peer"
        assert all(peer == rank + (4 if stage == 0 else -4) for _, _, peer, _ in pipeline.values())
    per_step = query(
        job,
        """SELECT count(*) FROM ops WHERE run_id = ? AND rank = 0 AND step = 10 AND kind = 'comm'
           AND name = 'all_reduce' AND (attrs->>'$."rankwatch.comm.role"') = 'tp' AND bytes > 64""",
        [RUN],
    )
    assert per_step == [(4 * 4,)]  # 4 microbatches; forward and backward of attention and MLP


def test_each_step_has_its_bubble_and_exposed_wait_per_dimension(job):
    """While stage 1 is slow, stage 0 waits for it in the schedule: its bubble is most of its step, and
    stage 1's is small, its step spent computing rather than waiting on the pipeline; the exposed wait
    is split by dimension, pp's the largest on stage 0. (Stage 1's dp and tp waits grow with the load of
    this 2-core machine, so its compute is compared with the pipeline's part, not with the whole step.)"""
    rows = query(
        job,
        """SELECT rank, median(CAST(attrs->>'$."rankwatch.pipeline_bubble_s"' AS DOUBLE)),
                  median(CAST(attrs->>'$."rankwatch.comm_wait_s.pp"' AS DOUBLE)),
                  median(CAST(attrs->>'$."rankwatch.comm_wait_s.dp"' AS DOUBLE)) IS NOT NULL,
                  median(CAST(attrs->>'$."rankwatch.comm_wait_s.tp"' AS DOUBLE)) IS NOT NULL,
                  median(duration_s), median(compute_s)
           FROM steps WHERE run_id = ? AND step BETWEEN ? AND ? GROUP BY rank ORDER BY rank""",
        [RUN, STAGE[0] + 2, STAGE[1] - 1],
    )
    for rank, bubble, pp_wait, has_dp, has_tp, duration, compute in rows:
        assert has_dp and has_tp
        if coordinates(rank)[0] == 0:
            assert bubble > 0.5 * duration and pp_wait > 0.5 * duration, (rank, bubble, pp_wait, duration)
        else:
            assert bubble < 0.2 * duration and compute > 2 * bubble + pp_wait, (rank, bubble, pp_wait, compute)
    losses = query(job, "SELECT rank, count(loss) FROM steps WHERE run_id = ? GROUP BY rank ORDER BY rank", [RUN])
    assert [n > 0 for _, n in losses] == [False] * 4 + [True] * 4  # the loss is the last stage's


def test_a_slow_stage_is_named_as_the_stage(job):
    stages = [f for f in findings(job, "stragglers") if f[0] == "stage"]
    assert stages and all(ranks == [4, 5, 6, 7] for _, ranks, *_ in stages), stages
    _, _, start, end, summary, evidence = stages[0]
    assert start < STAGE[1] and end >= STAGE[1] - 2 and summary.startswith("stage 1 (ranks 4–7) computes")
    assert evidence["lost_s_per_step"] > 0


def test_a_straggler_in_one_replica_is_named_against_its_stage(job):
    ranks_found = [f for f in findings(job, "stragglers") if f[0] == "rank"]
    assert [ranks for _, ranks, *_ in ranks_found] == [[2]], ranks_found
    _, _, start, end, _, evidence = ranks_found[0]
    assert STRAGGLER - 4 <= start <= STRAGGLER + 6 and end == STEPS - 1
    assert evidence["time_ratio_by_rank"]["2"] > 2  # against its stage's ranks, not the job's


def test_a_slow_tensor_parallel_link_is_named(job):
    links = findings(job, "links")
    slow = [f for f in links if 5 in f[1]]
    assert slow and all(ranks == [4, 5] for _, ranks, *_ in slow), links
    _, _, _, end, summary, evidence = slow[0]
    assert end >= LINK and "all_reduce in group" in summary
    (group,) = evidence["groups"].values()
    assert group["members"] == [4, 5] and group["busbw_gbps"] < 0.8 * group["peer_busbw_gbps"]


def test_a_hang_in_the_pipeline_names_the_hung_rank_and_who_waits_for_it(job):
    hangs = findings(job, "hangs")
    assert hangs and all(ranks == [6] for _, ranks, *_ in hangs), hangs
    _, _, start, _, summary, evidence = hangs[0]
    assert start == HANG
    pairs = {tuple(p[:2]): p[2] for p in evidence["waiting_pairs"]}
    assert pairs.get((2, 6), "").endswith(("recv", "send", "batch_isend_irecv")), pairs  # its stage-0 peer
    assert (7, 6) in pairs  # its tensor-parallel peer
    assert "rank 6 never reached" in summary and f"rank 6: in forward of step {HANG}" in summary


def test_the_spike_is_rolled_back_and_the_sharded_state_restored_on_every_rank(job):
    ((state, args, result),) = query(
        job, "SELECT state, args, result FROM commands WHERE run_id = ? AND kind = 'rollback'", [RUN]
    )
    result = json.loads(result)
    # the rollback policy's margin is 5 steps; the newest snapshot before it, every 2 steps
    assert state == "applied" and json.loads(args)["before_step"] == SPIKE - 5 and result["restored_step"] == 16
    restored = query(
        job,
        """SELECT rank, step, attrs->>'$."rankwatch.checkpoint.tier"' FROM events
           WHERE run_id = ? AND event = 'checkpoint_restored' ORDER BY rank""",
        [RUN],
    )
    assert restored == [(r, result["restored_step"], "memory") for r in range(8)]
    kept = query(
        job, "SELECT count(*), count(DISTINCT (rank, step)), max(loss) FROM current_steps WHERE run_id = ?", [RUN]
    )
    assert kept[0][0] == kept[0][1] == 8 * STEPS and kept[0][2] < 10


def test_the_what_if_analysis_runs_on_the_jobs_own_ops(job):
    """The post-mortem replays the job's own rank-steps: the hung rank (its 25 s step) or the straggler
    explains the most of the slowdown; the straggler more than each clean rank of its stage; each stage
    has its share."""
    result = rankwatch_in_process("analyze", "--db", str(job), "--json", RUN)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ranks"] == 8 and report["steps"] == STEPS and report["slowdown"] > 1.2
    workers = {w["rank"]: w for w in report["workers"]}
    assert report["workers"][0]["rank"] in (2, 6), report["workers"]
    assert all(workers[2]["slowdown"] > workers[r]["slowdown"] for r in (0, 1, 3))
    assert (workers[2]["pp_stage"], workers[2]["dp_rank"]) == (0, 1)
    assert {s["pp_stage"] for s in report["stages"]} == {0, 1}
