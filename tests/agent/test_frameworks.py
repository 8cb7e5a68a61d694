"""Zero-code instrumentation on the frameworks users train with: `rankwatch run -- torchrun` (2 ranks,
gloo) of a stock Hugging Face Trainer job and of a stock Lightning job (tests/jobs/, which import
nothing of rankwatch) records every optimizer step of each rank once, with the loss the framework
itself reports for it (under gradient accumulation, the mean of the micro-batches' losses, not the
last one's share), its gradient norm and learning rate, and the phases in their order: a forward and
a backward per micro-batch, then the optimizer, also where the optimizer step runs the forward and
backward itself (Lightning's closure; torch's LBFGS, which calls its closure again to search its line:
the loss of such a step is the first call's). The jobs run one after another against one collector,
which is then stopped so that its store can be read."""

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.collectors import job_collector
from tests.support.otlp_payloads import query
from tests.support.paths import JOBS
from tests.support.zero_code import rankwatch_run, torchrun

pytestmark = [pytest.mark.long, pytest.mark.timeout(5 * 300)]  # the 5 jobs run in one fixture: 300 s each

STEPS = 8

# The frameworks' jobs: run id -> (script, micro-batches a step, the packages it needs)
FRAMEWORK_JOBS = {
    "lightning-1": ("lightning_ddp.py", 1, ("lightning",)),
    "lightning-4": ("lightning_ddp.py", 4, ("lightning",)),
    "hf-trainer": ("hf_trainer.py", 4, ("transformers", "accelerate")),
}


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def needs(package: str):
    return pytest.mark.skipif(not installed(package), reason=f"{package} is not installed (pip install {package})")


@dataclass
class Jobs:
    """The module's jobs, run: the store they sent to, each job's outcome by run id, and the directory where
    each framework's job wrote what it saw (OUT/RUN/rank-<rank>.json)."""

    db: Path
    done: dict[str, subprocess.CompletedProcess]
    out: Path


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Jobs:
    """Each job of the module under `rankwatch run` in turn (a framework's where its packages are installed), all
    sending to one collector, which is then stopped, so that its store can be read (a collector costs seconds
    of CPU to start)."""
    directory = tmp_path_factory.mktemp("frameworks")
    done = {}
    with job_collector(directory) as collector:
        for run_id, (script, accum, packages) in FRAMEWORK_JOBS.items():
            if all(map(installed, packages)):
                args = ("--steps", str(STEPS), "--accum", str(accum), "--out", str(directory / run_id))
                done[run_id] = rankwatch_run(collector, run_id, *torchrun(JOBS / script, *args))
        for run_id, code in (("scaled", SCALED_JOB), ("lbfgs", LBFGS_JOB)):
            done[run_id] = rankwatch_run(collector, run_id, sys.executable, "-c", code)
    return Jobs(collector.db, done, directory)


def seen(jobs: Jobs, run_id: str) -> dict[int, list[dict]]:
    """What the framework saw at each optimizer step of the job, by rank, once the job is checked to have ended
    well, instrumented."""
    job = jobs.done[run_id]
    assert job.returncode == 0, job.stderr[-3000:]
    assert "not instrumented" not in job.stderr, job.stderr[-3000:]
    return {rank: json.loads((jobs.out / run_id / f"rank-{rank}.json").read_text())["steps"] for rank in (0, 1)}


def recorded(db: Path, run_id: str, accum: int) -> dict[int, list[tuple]]:
    """Each rank's steps as stored, (step, loss, grad_norm, lr) in order, once the phases of every step are
    checked: data (from the step before's end, so none in the first), a forward and a backward for each
    micro-batch, then the optimizer, each of them lasting, none overlapping the next."""
    phases = query(
        db,
        """SELECT rank, step, list(name ORDER BY start_ts), bool_and(duration_s > 0),
                  bool_and(NOT overlapping) FROM (
               SELECT *, coalesce(lead(start_ts) OVER w < end_ts, false) AS overlapping FROM ops
               WHERE run_id = ? AND kind = 'phase' WINDOW w AS (PARTITION BY rank, step ORDER BY start_ts))
           GROUP BY rank, step ORDER BY rank, step""",
        [run_id],
    )
    micro = ["forward", "backward"] * accum
    assert phases == [
        (rank, step, ["data"] * (step > 0) + [*micro, "optimizer"], True, True)
        for rank in (0, 1)
        for step in range(STEPS)
    ]
    rows = query(
        db,
        "SELECT rank, step, loss, grad_norm, lr FROM steps WHERE run_id = ? ORDER BY rank, step",
        [run_id],
    )
    by_rank = {rank: [row[1:] for row in rows if row[0] == rank] for rank in (0, 1)}
    for rank, steps in by_rank.items():  # every optimizer step once, with all its values
        assert [step for step, *_ in steps] == list(range(STEPS)), (rank, steps)
        assert all(value is not None for row in steps for value in row), (rank, steps)
    return by_rank


@needs("lightning")
@pytest.mark.parametrize("accum", [1, 4])
def test_a_lightning_job_with_its_closure_optimizer_is_seen_step_by_step_with_its_own_loss(jobs, accum):
    """Lightning's automatic optimization runs the (last) micro-batch's forward and backward inside
    `optimizer.step(closure)`: they are timed as forward and backward, and the optimizer phase is what
    follows them; each rank's loss is what Lightning optimized at that step, on that rank."""
    run_id = f"lightning-{accum}"
    saw = seen(jobs, run_id)
    for rank, steps in recorded(jobs.db, run_id, accum).items():
        assert [loss for _, loss, *_ in steps] == pytest.approx([s["loss"] for s in saw[rank]], rel=1e-4), rank
        assert {lr for *_, lr in steps} == {0.01}  # the script's SGD learning rate


@needs("transformers")
@needs("accelerate")
def test_a_hugging_face_trainer_job_accumulating_gradients_is_seen_with_the_loss_it_logs(jobs):
    """Four micro-batches a step, each loss scaled by the Trainer: the step's loss is their sum, which the
    Trainer logs (averaged over the ranks, rounded to 4 decimals), not the last micro-batch's share of it;
    its gradient norm the one the Trainer clipped to."""
    saw = seen(jobs, "hf-trainer")
    stored = recorded(jobs.db, "hf-trainer", 4)
    logged = saw[0]
    assert [s["loss"] for s in logged] == [s["loss"] for s in saw[1]]  # the Trainer logs the ranks' mean
    means = [(a[1] + b[1]) / 2 for a, b in zip(stored[0], stored[1])]
    assert means == pytest.approx([s["loss"] for s in logged], rel=1e-4, abs=1e-4)
    for steps in stored.values():
        assert [norm for _, _, norm, _ in steps] == pytest.approx([s["grad_norm"] for s in logged], rel=1e-5)


LBFGS_JOB = """
import json, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
x, y = torch.randn(64, 8), torch.randn(64, 1)
optimizer = torch.optim.LBFGS(model.parameters(), max_iter=4)
def closure():
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss
print(json.dumps([optimizer.step(closure).item() for _ in range(4)]))
"""


def one_process(jobs: Jobs, run_id: str) -> tuple[list[float], list[float]]:
    """The job of one Python process under `rankwatch run`: the losses it printed (its last line, JSON) and those
    stored for its steps, in order."""
    job = jobs.done[run_id]
    assert job.returncode == 0, job.stderr[-3000:]
    stored = query(jobs.db, "SELECT loss FROM steps WHERE run_id = ? ORDER BY step", [run_id])
    return json.loads(job.stdout.strip().splitlines()[-1]), [loss for (loss,) in stored]


SCALED_JOB = """
import json, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
losses = []
for _ in range(4):
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    losses.append(loss.item())
print(json.dumps(losses))
"""


def test_a_loss_scaled_for_mixed_precision_is_stored_as_it_was_before_scaling(jobs):
    """Mixed precision's grad scaler multiplies the loss before its backward (by 1,024 here): the step's loss
    is the loss, not the scaled one the backward starts from."""
    returned, stored = one_process(jobs, "scaled")
    assert stored == pytest.approx(returned, rel=1e-6)


def test_an_lbfgs_step_calling_its_closure_again_is_one_step_with_its_first_loss(jobs):
    """LBFGS evaluates its closure several times a step: one step, its evaluations' phases in turn, and
    the loss the step started from (what `step` returns), not the sum of the evaluations'."""
    returned, stored = one_process(jobs, "lbfgs")
    assert stored == pytest.approx(returned, rel=1e-6)
    phases = query(
        jobs.db,
        "SELECT step, list(name ORDER BY start_ts) FROM ops WHERE run_id = 'lbfgs' AND kind = 'phase' GROUP BY ALL",
    )
    evaluations = {step: (len(names) - (step > 0)) // 3 for step, names in phases}
    assert sorted(phases) == [
        (step, ["data"] * (step > 0) + ["forward", "backward", "optimizer"] * evaluations[step]) for step in range(4)
    ]
    assert evaluations[0] > 1  # the line search called the closure again
