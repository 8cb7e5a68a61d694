"""A hung job's ranks as their agents and a node's sidecar speak for them, for the tests of the collector's side
of the stacks protocol (tests/collector/analysis/test_stacks_collector.py,
tests/collector/analysis/test_flight_recorder_live.py): steps and a heartbeat
a second through the agent's exporter, and every rank's answer to each stacks request, found with the held poll a
sidecar makes; and the frames a rank's answer gives, blocked in a collective or hung in its forward."""

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource

from rankwatch.agent import semconv as sc
from rankwatch.agent.config import INGEST, scoped_token
from rankwatch.agent.export import Exporter
from tests.support import loopback
from tests.support.collectors import Collector
from tests.support.waits import wait_until

LIB = "/opt/venv/lib/python3.11/site-packages/torch/"


def frame(file: str, line: int, function: str, code: str = "") -> dict:
    return {"file": file, "line": line, "function": function, "code": code}


# The training loop's frames, outermost first (as an answer gives them): blocked in a collective, and hung in
# the model's forward (nn.Module's call machinery between the loop and the model's code)
OUTER = [frame("/job/train.py", 200, "<module>"), frame("/job/train.py", 98, "main", "train_step(batch)")]
BLOCKED = [
    *OUTER,
    frame("/job/train.py", 120, "train_step", "dist.all_reduce(t)"),
    frame(LIB + "distributed/c10d_logger.py", 83, "wrapper"),
    frame(LIB + "distributed/distributed_c10d.py", 2800, "all_reduce", "work.wait()"),
]
IN_FORWARD = [
    *OUTER,
    frame("/job/train.py", 110, "train_step", "loss = model(x)"),
    frame(LIB + "nn/modules/module.py", 1773, "_wrapped_call_impl"),
    frame(LIB + "nn/modules/module.py", 1784, "_call_impl"),
    frame("/job/model.py", 50, "forward", "time.sleep(3600)"),
]
AT_ALL_REDUCE = "`all_reduce` at train.py:120 <- `train_step` at train.py:98 <- `main` at train.py:200"
AT_FORWARD = "in `forward` at model.py:50 <- `forward` at train.py:110 <- `train_step` at train.py:98"


@dataclass(frozen=True)
class Hung:
    """A hung job: run `run` of `ranks` ranks, `steps` steps of a second each, the last ended 30 s ago; then rank
    `hung` in its forward and the others blocked in all-reduce #`steps` of group "world"; each rank's answer to a
    stacks request has the body `body(rank)`, and rank `silent` answers only the requests it is told to
    (Job.late)."""

    run: str
    ranks: int
    hung: int
    steps: int
    body: Callable[[int], str]
    silent: int | None = None


class Job(threading.Thread):
    """The hung job's ranks, as their agents and a node's sidecar speak for them, through the agent's exporter:
    a heartbeat a second from every rank, and an answer from every rank asked (but the silent one) to each stacks
    request, found with the held poll a sidecar makes (an ingest token, kind stacks, after the last answered);
    `late`: requests the silent rank answers too, late."""

    def __init__(self, collector: Collector, job: Hung):
        super().__init__(daemon=True)
        self.job = job
        self.exporter = Exporter(collector.url, collector.token, {sc.RUN_ID: job.run})
        self.resources = [
            Resource.create({sc.RUN_ID: job.run, sc.RANK: r, sc.WORLD_SIZE: job.ranks, sc.HOST_NAME: f"node-{r // 4}"})
            for r in range(job.ranks)
        ]
        self.poll = loopback.Client(
            base_url=collector.url,
            headers={"Authorization": f"Bearer {scoped_token(collector.token, INGEST)}"},
            timeout=30,
        )
        self.late: set[int] = set()
        self.answered: set[tuple[int, int]] = set()
        self.stop = threading.Event()
        self.failure: BaseException | None = None

    def steps(self) -> None:
        """The job's steps, one second each, the last ended 30 s ago: the job has been stuck since."""
        t0 = time.time_ns() - (30 + self.job.steps) * 10**9
        for step in range(self.job.steps):
            for rank in range(self.job.ranks):
                start = t0 + step * 10**9
                attributes = {sc.KIND: sc.KIND_STEP, sc.STEP: step, sc.COMPUTE_S: 0.8, sc.COMM_WAIT_S: 0.1}
                self.exporter.trace([("step", start, start + 10**9, attributes)], self.resources[rank])
        wait_until(self.exporter.flush, "the steps were not delivered", 60)

    def run(self) -> None:
        try:
            after = None
            while not self.stop.is_set():
                self._heartbeats()
                params = {"run_id": self.job.run, "state": "pending", "kind": "stacks", "wait": "1"}
                pending = self.poll.get("/v1/commands", params=params | ({"after": str(after)} if after else {}))
                pending.raise_for_status()
                for command in pending.json():
                    self._answer(command["id"], command["args"]["ranks"] or range(self.job.ranks))
                    after = max(after or 0, command["id"])
                for request in list(self.late):
                    self._answer(request, [self.job.silent], late=True)
                self.exporter.flush()
        except BaseException as e:  # the test reads it
            self.failure = e

    def _heartbeats(self) -> None:
        for rank in range(self.job.ranks):
            blocked = rank != self.job.hung
            attributes = {sc.STEP: self.job.steps, sc.PHASE: "" if blocked else "compute", sc.COMM_OP: "all_reduce"}
            attributes |= {sc.COMM_GROUP: "world", sc.COMM_SEQ: self.job.steps - 1 + blocked, sc.COMM_DONE: not blocked}
            self.exporter.event(sc.EVENT_HEARTBEAT, time.time_ns(), attributes, resource=self.resources[rank])

    def _answer(self, request: int, ranks, late: bool = False) -> None:
        for rank in ranks:
            if (rank == self.job.silent and not late) or (request, rank) in self.answered:
                continue
            self.answered.add((request, rank))
            self.exporter.event(
                sc.EVENT_RANK_STACKS,
                time.time_ns(),
                {sc.STACKS_REQUEST: request},
                body=self.job.body(rank),
                resource=self.resources[rank],
            )

    def finish(self) -> None:
        self.stop.set()
        self.join(timeout=60)
        self.exporter.flush()
        self.exporter.shutdown()
        self.poll.close()
        assert self.failure is None, self.failure


def ask(api, sql: str, params=None) -> list[list]:
    """A query through the collector's query API (`api`: a client of it)."""
    response = api.post("/api/v1/query", json={"sql": sql, "params": params or []})
    assert response.status_code == 200, response.text
    return response.json()["rows"]


def hang_finding(api, run: str) -> tuple[int, str, dict]:
    """The run's hang finding (there is one at most): its id, summary and evidence; (0, "", {}) before it."""
    rows = ask(api, "SELECT id, summary, evidence FROM findings WHERE run_id = ? AND analyzer = 'hangs'", [run])
    assert len(rows) <= 1, rows
    return (rows[0][0], rows[0][1], json.loads(rows[0][2])) if rows else (0, "", {})
