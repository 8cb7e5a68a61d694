"""The store the dashboard tests look at, filled through real collectors: a simulated fleet with
a straggler and a thermally throttled rank, a simulated hang, and a small job whose loss turns
NaN, which the anomaly analyzer rolls back (applied through the control API), with checkpoint
events and device samples from GPUs (one of them failing); a job that ended with a straggler to its
end; a bare run (step times only), for the pages' empty states; a 2-rank CPU job whose rank 1 waits
for its input (a slow data loader), with gloo's slow all-reduces and host samples but no GPU; a
one-process job whose optimizer steps on the host; two ranks' profiler traces, imported; and a hung
4-rank job's Flight Recorder dumps, imported (collectives, no steps)."""

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from collector.reports.query import run_remote
from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from tests.support import loopback
from tests.support.collectors import Collector, free_port, simulated_store
from tests.support.commands import rankwatch_in_process
from tests.support.engine_jobs import exporters, send_steps
from tests.support.flight_dumps import HUNG as FLIGHT_HUNG
from tests.support.flight_dumps import T0, job, write
from tests.support.paths import DATA
from tests.support.waits import wait_until

ANALYSIS = ("--analyze-every", "1", "--hang-after", "3", "--power-every", "1")
# The fleet's simulator sends its steps at their pace, a second or so apart; on a machine loaded by the rest of
# the suite it falls seconds behind its own clock (9 s once, the machine at half its speed), which a 3 s floor
# judged a stall. The fleet, whose pages show stragglers and power, is judged at the collector's own floor.
FLEET_ANALYSIS = ("--analyze-every", "1", "--power-every", "1")
FLEET = {"run": "sim-straggler", "ranks": 32, "steps": 60, "straggler": 5, "thermal": 12}
HANG = {"run": "sim-hang", "ranks": 8, "rank": 3, "at": 15}
NAN = {
    "run": "run-nan",
    "ranks": 4,
    "steps": 40,
    "nan_from": 30,
    "restored": 24,
    "watts": 300.0,
    "bad_gpu": 2,
    "xid_at": 35,
}  # rank 2's GPU: memory nearly full, ECC errors and an XID from step 35
BARE = {"run": "run-bare", "ranks": 2, "steps": 5}
# rank 1 waits 50 ms for each batch from step 10 (its peer 0.4 ms), both compute 60 ms; each step's all-reduce of
# 1 MiB takes 50 ms (gloo on a CPU: 21 MB/s); the ranks sample their processes, not a GPU
LOADER = {
    "run": "run-slow-loader",
    "ranks": 2,
    "steps": 40,
    "slow": 1,
    "from": 10,
    "data_s": 0.050,
    "peer_data_s": 0.0004,
    "compute_s": 0.060,
    "allreduce_bytes": 2**20,
    "allreduce_s": 0.050,
}
# one process, whose optimizer steps on the host's CPUs for 40 ms of each 100 ms step; its copies between
# tiers report no size
SOLO = {"run": "run-one-process", "steps": 30, "host_optimizer_s": 0.040, "step_s": 0.100}
# rank 2 killed by the kernel's OOM killer as it began step 12; torchrun stopped the others
FAILED = {"run": "run-failed", "ranks": 4, "steps": 12, "rank": 2, "host": "node-b"}
ENDED = {"run": "run-ended", "ranks": 4, "steps": 40, "slow": 2, "from": 10}  # rank 2 computes 2x from step 10
# two ranks' PyTorch profiler traces (tests/data/kineto), imported: a run no agent sent
IMPORTED = {"run": "imported-kineto", "traces": ("sampled_rank-0.json.gz", "sampled_rank-1.json.gz")}
# a 4-rank job's Flight Recorder dumps, imported: rank 2 never entered all_reduce #7 of the world group
FLIGHT = {"run": "imported-flight-recorder", "ranks": 4, "culprit": 2, "seq": 7}
FLIGHT_DUMPED_NS = T0 + 600 * 1_000_000_000
MS = 1_000_000


def build(directory: Path) -> Path:
    """The runs in one store, its collector stopped (the store is free to open read-only)."""
    fleet = [f"straggler:rank={FLEET['straggler']},slowdown=1.3,from=10", f"thermal:rank={FLEET['thermal']},from=10"]
    db = simulated_store(
        directory,
        {FLEET["run"]: fleet},
        ["--ranks", str(FLEET["ranks"]), "--tp", "2", "--steps", str(FLEET["steps"])],
        FLEET_ANALYSIS,
    )
    simulated_store(
        directory,
        {HANG["run"]: [f"hang:rank={HANG['rank']},at={HANG['at']}"]},
        ["--ranks", str(HANG["ranks"]), "--steps", "20", "--hang-for", "8"],
        ANALYSIS,
    )
    with open(directory / "collector-nan.log", "w") as log:
        collector = Collector(db, free_port(), "test-token-0123456", extra_args=ANALYSIS, log=log).start()
        try:
            _nan_run(collector)
            _bare_run(collector)
            _ended_run(collector)
            _loader_run(collector)
            _solo_run(collector)
            _failed_run(collector)
        finally:
            collector.stop()
    traces = [str(DATA / "kineto" / name) for name in IMPORTED["traces"]]
    imported = rankwatch_in_process("import", "kineto", *traces, "--run", IMPORTED["run"], "--db", str(db))
    assert imported.returncode == 0, imported.stderr
    dumps = write(directory / "flight-recorder", job(FLIGHT_HUNG))
    for dump in dumps.iterdir():  # written when the watchdog gave up, 10 minutes into the stall
        os.utime(dump, ns=(FLIGHT_DUMPED_NS, FLIGHT_DUMPED_NS))
    imported = rankwatch_in_process("import", "flight-recorder", str(dumps), "--run", FLIGHT["run"], "--db", str(db))
    assert imported.returncode == 0, imported.stderr
    return db


def _nan_run(collector: Collector) -> None:
    """A falling loss that turns NaN at step nan_from; the job applies the rollback the analyzer
    sends (restoring step `restored`) and replays the steps after it with a sane loss."""
    exporters = {
        r: Exporter(collector.url, collector.token, {sc.RUN_ID: NAN["run"], sc.RANK: r}) for r in range(NAN["ranks"])
    }
    t0 = time.time_ns() - 60_000 * MS

    def steps(numbers, start_ns, nan_from=None):
        with ThreadPoolExecutor(len(exporters)) as sampling:
            for step in numbers:
                start = start_ns + step * 100 * MS
                samples = {}
                for rank, exporter in exporters.items():
                    loss = math.nan if nan_from is not None and step >= nan_from else 3 + 5 * math.exp(-step / 10)
                    exporter.trace(
                        [
                            (
                                "step",
                                start,
                                start + 100 * MS,
                                {
                                    sc.KIND: sc.KIND_STEP,
                                    sc.STEP: step,
                                    sc.LOSS: loss,
                                    sc.GRAD_NORM: 1.0 + rank / 10,
                                    sc.COMPUTE_S: 0.08,
                                    sc.COMM_WAIT_S: 0.01,
                                    sc.TOKENS: 1024,
                                    sc.MFU: 0.4,
                                },
                            )
                        ]
                    )
                    bad = rank == NAN["bad_gpu"] and step >= NAN["xid_at"]
                    at, gpu = start + 100 * MS, {sc.GPU: rank, sc.SOURCE: sc.SOURCE_NVML}
                    samples[exporter] = [
                        (sc.POWER_W, at, NAN["watts"] + 10 * rank, gpu),
                        (sc.SM_CLOCK_MHZ, at, 1980.0, gpu),
                        (sc.FB_USED_MIB, at, 81_000.0 if rank == NAN["bad_gpu"] else 60_000.0, gpu),
                        (sc.FB_TOTAL_MIB, at, 81_559.0, gpu),
                        (sc.NVLINK_TX_BPS, at, 2e11 + 1e10 * rank, gpu),
                        (sc.ECC_SBE_VOLATILE, at, 3.0 * bad, gpu),
                        (sc.ECC_DBE_VOLATILE, at, 1.0 * bad, gpu),
                        *([(sc.XID_ERRORS, at, 48.0, gpu)] if bad and step == NAN["xid_at"] else []),
                    ]
                # every rank's samples of the step at once, as each rank's sampler sends its own: the collector
                # commits them together instead of one request after another
                list(sampling.map(Exporter.samples, samples, samples.values()))
                if step % 5 == 0:  # a snapshot in memory every 5 steps, every other one written to disk
                    tier = sc.TIER_DISK if step % 10 == 0 else sc.TIER_MEMORY
                    exporters[0].event("checkpoint_saved", start + 100 * MS, {sc.STEP: step, sc.CKPT_TIER: tier})
        for exporter in exporters.values():
            wait_until(exporter.flush, "telemetry not delivered", 120)

    steps(range(NAN["steps"]), t0, NAN["nan_from"])
    with loopback.Client(base_url=collector.url, headers=collector.headers, timeout=10) as http:
        wait_until(lambda: http.get("/v1/commands", params={"run_id": NAN["run"]}).json(), "no rollback command")
        command = http.get("/v1/commands", params={"run_id": NAN["run"]}).json()[0]["id"]
        resumed = t0 + (NAN["steps"] + 5) * 100 * MS
        http.post(f"/v1/commands/{command}", json={"state": "acked", "apply_step": NAN["steps"] + 1})
        http.post(
            f"/v1/commands/{command}",
            json={"state": "applied", "result": {"restored_step": NAN["restored"], "resumed_ns": resumed}},
        )
    exporters[0].event("checkpoint_restored", resumed, {sc.STEP: NAN["restored"]})
    steps(range(NAN["restored"] + 1, NAN["steps"]), resumed - (NAN["restored"] + 1) * 100 * MS)
    for exporter in exporters.values():
        exporter.shutdown()


def _bare_run(collector: Collector) -> None:
    """Steps with their duration alone: no loss, tokens, collectives or device samples."""
    t0 = time.time_ns() - 10_000 * MS
    for rank in range(BARE["ranks"]):
        exporter = Exporter(collector.url, collector.token, {sc.RUN_ID: BARE["run"], sc.RANK: rank})
        for s in range(BARE["steps"]):
            exporter.trace([("step", t0 + s * 100 * MS, t0 + (s + 1) * 100 * MS, {sc.KIND: sc.KIND_STEP, sc.STEP: s})])
        wait_until(exporter.flush, "telemetry not delivered", 120)
        exporter.shutdown()


def _ended_run(collector: Collector) -> None:
    """A straggler from step `from` to the run's end, then every rank's `ended`: its finding ends with it."""
    sending = exporters(collector, ENDED["run"], ENDED["ranks"])
    slow = lambda rank, step: 0.16 if rank == ENDED["slow"] and step >= ENDED["from"] else 0.08  # noqa: E731
    send_steps(sending, range(ENDED["steps"]), time.time_ns() - 20_000 * MS, compute=slow)
    for exporter in sending.values():
        exporter.event(sc.EVENT_ENDED, time.time_ns(), {})
        exporter.flush()
    held = f"SELECT count(*) FROM findings WHERE run_id = '{ENDED['run']}' AND state = 'ended'"
    wait_until(lambda: run_remote(collector.url, collector.token, held)[1][0][0], "the run's findings did not end")
    for exporter in sending.values():
        exporter.shutdown()


def _failed_run(collector: Collector) -> None:
    """Steps 0-11 of every rank, then rank 2 gone without a word as the OOM killer killed (its sidecar tells),
    and the others stopped with the job after it."""
    sending = {
        rank: Exporter(
            collector.url,
            collector.token,
            {sc.RUN_ID: FAILED["run"], sc.RANK: rank, sc.WORLD_SIZE: FAILED["ranks"], sc.HOST_NAME: FAILED["host"]},
        )
        for rank in range(FAILED["ranks"])
    }
    t0 = time.time_ns() - 20_000 * MS
    send_steps(sending, range(FAILED["steps"]), t0)
    failed_at = t0 + FAILED["steps"] * 100 * MS
    for rank, exporter in sending.items():
        killed = rank == FAILED["rank"]
        cause = sc.CAUSE_KILLED_OUT_OF_MEMORY if killed else sc.CAUSE_TERMINATED
        said = "killed: the kernel's OOM killer killed" if killed else f"stopped after rank {FAILED['rank']} failed"
        attributes = {sc.STEP: FAILED["steps"], sc.FAILURE_CAUSE: cause, sc.ATTEMPT: 0}
        exporter.event(sc.EVENT_RANK_FAILED, failed_at + (0 if killed else 200 * MS), attributes, said)
        exporter.flush()
    found = f"SELECT count(*) FROM findings WHERE run_id = '{FAILED['run']}' AND kind = 'failure'"
    wait_until(lambda: run_remote(collector.url, collector.token, found)[1][0][0], "no failure finding")
    for exporter in sending.values():
        exporter.shutdown()


def _loader_run(collector: Collector) -> None:
    """A slow data loader on rank 1 from step `from`: the other rank waits for it in each all-reduce."""
    sending = exporters(collector, LOADER["run"], LOADER["ranks"])
    t0, step_s = time.time_ns() - 20_000 * MS, 0.15
    waits = lambda rank, step: (  # noqa: E731
        LOADER["data_s"] if rank == LOADER["slow"] and step >= LOADER["from"] else LOADER["peer_data_s"]
    )
    send_steps(
        sending,
        range(LOADER["steps"]),
        t0,
        step_s=step_s,
        compute=lambda rank, step: LOADER["compute_s"],
        data=waits,
        flush=False,
    )
    own = lambda step: max(waits(rank, step) for rank in sending) + LOADER["compute_s"]  # noqa: E731
    ends = [t0 + int((step * step_s + own(step) + 0.005) * 1e9) for step in range(LOADER["steps"])]  # each step's
    for exporter in sending.values():
        exporter.trace(
            [
                (
                    "all_reduce",
                    end - int(LOADER["allreduce_s"] * 1e9),
                    end,
                    {
                        sc.KIND: sc.KIND_COMM,
                        sc.STEP: step,
                        sc.COMM_GROUP: "world",
                        sc.COMM_GROUP_SIZE: LOADER["ranks"],
                        sc.COMM_SEQ: step,
                        sc.COMM_BYTES: LOADER["allreduce_bytes"],
                    },
                )
                for step, end in enumerate(ends)
            ]
        )
        exporter.samples([(sc.PROCESS_CPU_UTIL, end, 0.9, {sc.SOURCE: sc.SOURCE_HOST}) for end in ends])
        wait_until(exporter.flush, "telemetry not delivered", 120)
    found = f"SELECT count(*) FROM findings WHERE run_id = '{LOADER['run']}' AND analyzer = 'stragglers'"
    wait_until(lambda: run_remote(collector.url, collector.token, found)[1][0][0], "no straggler found")
    for exporter in sending.values():
        exporter.shutdown()


def _solo_run(collector: Collector) -> None:
    """One process: its input wait, compute, loss, and an optimizer on the host's CPUs with copies to the GPU."""
    (exporter,) = exporters(collector, SOLO["run"], 1).values()
    t0, step_ns = time.time_ns() - 10_000 * MS, int(SOLO["step_s"] * 1e9)
    for step in range(SOLO["steps"]):
        start = t0 + step * step_ns
        exporter.trace(
            [
                (
                    "step",
                    start,
                    start + step_ns,
                    {
                        sc.KIND: sc.KIND_STEP,
                        sc.STEP: step,
                        sc.LOSS: 4 - step / 20,
                        sc.DATA_S: 0.005,
                        sc.COMPUTE_S: SOLO["step_s"] - 0.005 - SOLO["host_optimizer_s"],
                        sc.HOST_OPTIMIZER_S: SOLO["host_optimizer_s"],
                        sc.TRANSFER_S: 0.002,
                    },
                ),
                (
                    "host->gpu",
                    start + step_ns - 2 * MS,
                    start + step_ns,
                    {sc.KIND: sc.KIND_TRANSFER, sc.STEP: step, sc.TRANSFER_SRC: "host", sc.TRANSFER_DST: "gpu"},
                ),
            ]
        )
    wait_until(exporter.flush, "telemetry not delivered", 120)
    exporter.shutdown()
