"""Zero-code instrumentation end to end: `rankwatch run -- torchrun ... script.py` on an unmodified
plain-PyTorch DDP script (tests/jobs/plain_ddp.py, which imports nothing of rankwatch; nor does this
file import the agent) sends a real collector every rank-step with its phases, loss, gradient norm
and learning rate, DDP's gradient all-reduces, and the straggler the script makes of its rank 1 is
named; the launcher and the processes that never train start no session. An FSDP2 script's
all-gathers and reduce-scatters are each seen in their step. A command that is missing, or not
found, is refused in one line. The jobs on CPUs run one after another against one collector, which
is then stopped so that its store can be read."""

import subprocess
from pathlib import Path

import pytest

from tests.support.collectors import job_collector
from tests.support.commands import rankwatch_cli
from tests.support.otlp_payloads import query
from tests.support.paths import JOBS
from tests.support.zero_code import SCRIPT, rankwatch_run, torchrun, two_ranks

pytestmark = [pytest.mark.long, pytest.mark.timeout(4 * 300)]  # the 4 jobs on CPUs run in one fixture: 300 s each

STEPS = 40
FSDP_STEPS = 12
STEPS_3D = 10

# The module's jobs on CPUs, each a run of its own: run id -> the command `rankwatch run` starts. The slow
# loader's script also registers DDP's fp16 compression hook, which its comm-hook test checks.
JOBS_ON_CPUS = {
    "zero-code": torchrun(SCRIPT, "--steps", str(STEPS), "--slow-rank", "1"),
    "slow-loader": torchrun(SCRIPT, "--steps", str(STEPS), "--slow-loader", "1", "--slow-from", "10", "--fp16-comm"),
    "zero-code-fsdp": torchrun(JOBS / "plain_fsdp.py", "--steps", str(FSDP_STEPS)),
    "zero-code-3d": torchrun(JOBS / "plain_3d.py", "--steps", str(STEPS_3D), nproc=4),
}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The module's collector, stopped at the module's end (a collector costs seconds of CPU to start)."""
    with job_collector(tmp_path_factory.mktemp("zero-code")) as collector:
        yield collector


@pytest.fixture(scope="module")
def jobs(live) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """Each job of JOBS_ON_CPUS under `rankwatch run` in turn, all sending to the module's collector, which is
    then stopped, so that its store can be read (its last analysis pass judged every run): the store, and
    each job's outcome by run id."""
    done = {run_id: rankwatch_run(live, run_id, *command) for run_id, command in JOBS_ON_CPUS.items()}
    live.stop()
    return live.db, done


@pytest.fixture
def running(live):
    """The module's collector, running: started again on its store where the jobs' fixture stopped it (the
    tests that need it running come first in this file, so that a run of the whole file starts it once)."""
    if live.process.poll() is not None:
        live.start()
    return live


@pytest.mark.parametrize(
    "command, said",
    [
        ([], "rankwatch: error: give the job's command after --, e.g. rankwatch run -- torchrun"),
        (["--", "no-such-command-here"], "rankwatch: error: 'no-such-command-here': no such command"),
    ],
)
def test_a_command_that_is_missing_or_not_found_is_refused_in_one_line(running, command, said):
    result = rankwatch_cli("run", "--collector", running.url, *command, env={"RANKWATCH_TOKEN": running.token})
    assert result.returncode == 2 and result.stderr.startswith(said) and result.stderr.count("\n") == 1, result.stderr


def test_an_unmodified_ddp_script_is_seen_step_by_step_and_its_straggler_named(jobs):
    db, done = jobs
    job = done["zero-code"]
    assert job.returncode == 0, job.stderr[-3000:]
    assert "rankwatch run: run zero-code, telemetry to" in job.stdout
    # every optimizer step is one step of each rank, numbered from 0, with the loss and gradient norm it had
    steps = query(
        db,
        """SELECT rank, list(step ORDER BY step), count(loss), count(grad_norm), list(DISTINCT lr),
                  median(compute_s), median(comm_wait_s)
           FROM steps WHERE run_id = 'zero-code' GROUP BY rank ORDER BY rank""",
    )
    assert [(rank, numbers, losses, norms, lr) for rank, numbers, losses, norms, lr, *_ in steps] == [
        (rank, list(range(STEPS)), STEPS, STEPS, [0.01])
        for rank in (0, 1)  # the script's SGD learning rate
    ]
    (*_, fast_compute, fast_wait), (*_, slow_compute, slow_wait) = steps
    assert slow_compute > fast_compute + 0.02 and fast_wait > slow_wait + 0.01  # rank 0 waits out rank 1's 30 ms
    # the phases of each step: data (from the step before's optimizer step, so none in the first), forward,
    # backward, optimizer; and one gradient all-reduce per step (the small model is one DDP bucket)
    ops = query(
        db,
        "SELECT kind, name, count(*) FROM ops WHERE run_id = 'zero-code' GROUP BY ALL ORDER BY ALL",
    )
    assert ops == [
        ("comm", "all_reduce", 2 * STEPS),
        ("phase", "backward", 2 * STEPS),
        ("phase", "data", 2 * (STEPS - 1)),
        ("phase", "forward", 2 * STEPS),
        ("phase", "optimizer", 2 * STEPS),
    ]
    assert query(db, "SELECT rank FROM ranks WHERE run_id = 'zero-code' ORDER BY rank") == [(0,), (1,)]
    # the analyzers judge it as any run: rank 1 is the straggler
    stragglers = query(
        db,
        """SELECT kind, ranks FROM findings
           WHERE run_id = 'zero-code' AND analyzer = 'stragglers' AND severity <> 'info'""",
    )
    assert stragglers and {(kind, tuple(ranks)) for kind, ranks in stragglers} == {("rank", (1,))}, stragglers


def test_a_slow_data_loader_is_named_as_such_and_a_job_on_cpus_shows_no_gpu(jobs):
    """Rank 1 waits 50 ms for each batch from step 10: the finding names it and its input, costs the others'
    wait, and says since when; and the job, on CPUs, stores no GPU samples and no step energy."""
    db, done = jobs
    job = done["slow-loader"]
    assert job.returncode == 0, job.stderr[-3000:]
    found = query(
        db,
        """SELECT kind, ranks, step_start, summary, evidence->>'phase', CAST(evidence->>'lost_s_per_step' AS DOUBLE)
           FROM findings WHERE run_id = 'slow-loader' AND analyzer = 'stragglers' AND severity <> 'info'""",
    )
    assert [(kind, ranks, phase) for kind, ranks, _, _, phase, _ in found] == [("rank", [1], "data")], found
    ((_, _, onset, summary, _, lost),) = found
    assert 5 <= onset <= 12 and f"since step {onset}" in summary and "input (data loading)" in summary, summary
    assert lost > 0.03, summary  # rank 0 waits out the 50 ms in its all-reduce
    gpu = query(
        db,
        """SELECT count(*) FILTER (metric LIKE 'DCGM%' OR source = 'simulated'),
                  (SELECT count(energy_j) FROM steps WHERE run_id = 'slow-loader')
           FROM device_samples WHERE run_id = 'slow-loader'""",
    )
    assert gpu == [(0, 0)]


def test_a_ddp_scripts_own_comm_hook_is_kept_and_each_bucket_timed_once(jobs):
    """The script registers DDP's fp16 compression hook (in the slow loader's job): the agent's bucket timing
    goes around it, and the all-reduce the hook launches is the bucket's, not a second collective."""
    db, done = jobs
    job = done["slow-loader"]
    assert job.returncode == 0, job.stderr[-3000:]
    assert query(
        db,
        """SELECT rank, count(DISTINCT step), count(*) FROM ops
           WHERE run_id = 'slow-loader' AND kind = 'comm' GROUP BY rank ORDER BY rank""",
    ) == [(rank, STEPS, STEPS) for rank in (0, 1)]


def test_an_unmodified_fsdp2_script_is_seen_with_its_all_gathers_and_reduce_scatters(jobs):
    """FSDP2 (`fully_shard` on each of two layers) issues its collectives from Python: each step of each
    rank all-gathers each layer for the forward and again for the backward, and reduce-scatters each
    layer's gradients; all of them are timed, in the step that made them."""
    steps = FSDP_STEPS
    db, done = jobs
    job = done["zero-code-fsdp"]
    assert job.returncode == 0, job.stderr[-3000:]
    assert query(
        db,
        "SELECT rank, count(*), count(loss) FROM steps WHERE run_id = 'zero-code-fsdp' GROUP BY rank ORDER BY rank",
    ) == [(rank, steps, steps) for rank in (0, 1)]
    per_step = query(
        db,
        """SELECT name, min(n), max(n) FROM (SELECT name, rank, step, count(*) AS n FROM ops
           WHERE run_id = 'zero-code-fsdp' AND kind = 'comm' GROUP BY ALL) GROUP BY name ORDER BY name""",
    )
    assert per_step == [("all_gather", 4, 4), ("reduce_scatter", 2, 2)]
    # each with the DeviceMesh dimension it runs over (the script's mesh names its one dimension "dp")
    assert query(
        db,
        """SELECT DISTINCT attrs->>'$."rankwatch.comm.role"' FROM ops
           WHERE run_id = 'zero-code-fsdp' AND kind = 'comm'""",
    ) == [("dp",)]
    # and each step's exposed communication wait, that of its one dimension's groups
    ((steps_with_it, differing),) = query(
        db,
        """SELECT count(attrs->>'$."rankwatch.comm_wait_s.dp"'),
                  count(*) FILTER (WHERE abs((attrs->>'$."rankwatch.comm_wait_s.dp"')::DOUBLE - comm_wait_s) > 1e-9)
           FROM steps WHERE run_id = 'zero-code-fsdp'""",
    )
    assert (steps_with_it, differing) == (2 * steps, 0)
    ((in_steps,),) = query(
        db,
        "SELECT count(*) FROM ops WHERE run_id = 'zero-code-fsdp' AND kind = 'comm' AND step IS NOT NULL",
    )
    assert in_steps == 2 * steps * 6


def test_an_unmodified_tensor_and_pipeline_parallel_script_is_seen_with_its_mesh(jobs):
    """4 ranks, a ("pp", "tp") mesh of 2 x 2 (tests/jobs/plain_3d.py): every step of every rank has its
    tensor-parallel functional all-reduces (forward and backward, 4 microbatches) over tp and its
    stage's sends and receives over pp with the peer stage's rank; from the schedule's second step each
    step's `pipeline` phase holds its 4 forward and 4 backward chunks, and the step its bubble."""
    steps = STEPS_3D
    db, done = jobs
    job = done["zero-code-3d"]
    assert job.returncode == 0, job.stderr[-3000:]
    assert "not instrumented" not in job.stderr, job.stderr[-3000:]
    assert query(db, "SELECT count(*), count(DISTINCT rank) FROM steps WHERE run_id = 'zero-code-3d'") == [
        (4 * steps, 4)
    ]
    per_step = query(
        db,
        """SELECT name, role, min(n), max(n), min(peer), max(peer) FROM (
               SELECT rank, step, name, attrs->>'$."rankwatch.comm.role"' AS role, count(*) AS n,
                      min(CAST(attrs->>'$."rankwatch.comm.peer"' AS INTEGER) - rank) AS peer
               FROM ops WHERE run_id = 'zero-code-3d' AND kind = 'comm' AND step > 0 GROUP BY ALL)
           GROUP BY ALL ORDER BY ALL""",
    )
    assert [row[2:4] for row in per_step if row[:2] == ("all_reduce", "tp")] == [(4, 8)], per_step
    # by stage: stage 0's input needs no gradient, so its backward all-reduces none
    by_stage = query(
        db,
        """SELECT rank // 2, count(*) // count(DISTINCT (rank, step)) FROM ops WHERE run_id = 'zero-code-3d'
           AND kind = 'comm' AND step > 0 AND (attrs->>'$."rankwatch.comm.role"') = 'tp' GROUP BY ALL ORDER BY 1""",
    )
    assert by_stage == [(0, 4), (1, 8)]
    p2p = [row for row in per_step if row[1] == "pp"]
    assert p2p and all(abs(lo) == abs(hi) == 2 for *_, lo, hi in p2p), per_step  # rank r and r +- 2 (pp peers)
    phases = query(
        db,
        """SELECT name, min(n), max(n) FROM (SELECT rank, step, name, count(*) AS n FROM ops
           WHERE run_id = 'zero-code-3d' AND kind = 'phase' AND step > 0 GROUP BY ALL) GROUP BY name ORDER BY name""",
    )
    assert {name: (lo, hi) for name, lo, hi in phases if name in ("pipeline", "forward", "backward")} == {
        "pipeline": (1, 1),
        "forward": (4, 4),
        "backward": (4, 4),
    }, phases
    ((bubbles,),) = query(
        db,
        """SELECT count(*) FROM steps WHERE run_id = 'zero-code-3d' AND step > 0
           AND CAST(attrs->>'$."rankwatch.pipeline_bubble_s"' AS DOUBLE) > 0""",
    )
    assert bubbles == 4 * (steps - 1)


@pytest.mark.cuda
def test_an_unmodified_gpu_script_is_timed_on_its_gpu_without_a_sync(collector):
    """On a GPU (NCCL, one rank): the script makes any host-device sync from its fourth step an error,
    so the job finishing says the agent never synced; its phases are CUDA-event times on the GPU's
    timeline, which add up to the step, and its all-reduce, waiting for no peer, exposes no wait."""
    steps = 30
    job = two_ranks(collector, "zero-code-gpu", SCRIPT, "--steps", str(steps), "--cuda", "--sync-check", nproc=1)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "not instrumented" not in job.stderr, job.stderr[-3000:]
    assert query(
        collector.db,
        """SELECT count(*), count(loss), count(grad_norm), median(comm_wait_s) FILTER (WHERE step >= 5) < 1e-3
           FROM steps WHERE run_id = 'zero-code-gpu'""",
    ) == [(steps, steps, steps, True)]
    assert query(
        collector.db,
        "SELECT count(DISTINCT step) FROM ops WHERE run_id = 'zero-code-gpu' AND kind = 'comm' AND name = 'all_reduce'",
    ) == [(steps,)]
    ((covered,),) = query(
        collector.db,
        """SELECT median(p.phases / s.duration_s) FROM steps s JOIN
             (SELECT step, sum(duration_s) AS phases FROM ops WHERE run_id = 'zero-code-gpu' AND kind = 'phase'
              GROUP BY step) p USING (step)
           WHERE s.run_id = 'zero-code-gpu' AND s.step > 0""",
    )
    # data, forward, backward and optimizer tile the step, but for the host's time between one phase's
    # end and the next's start, which events on a GPU this small a model leaves idle read
    assert 0.8 < covered <= 1.0 + 1e-6, covered
