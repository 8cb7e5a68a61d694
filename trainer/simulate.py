"""Fleet simulator: thousands of ranks of a DP x PP x TP job, without GPUs.

Each step is drawn for all ranks at once (numpy): compute time with
lognormal jitter and rare GC-like pauses, multiplied by the active faults;
tensor-parallel ranks wait for their slowest peer, a pipeline of `pp` stages
runs 1F1B over `microbatches` (the slowest stage sets the pace and the
bubble adds (pp - 1) microbatch slots), and each step ends with the
tensor-parallel all-reduces (when tp > 1) and the gradient all-reduce of each
data-parallel group, which every rank waits for. A slow link (`slow-link:
rank=R,factor=F`) makes every collective of each group R is in F times
slower. A rank's exposed communication wait is its step time minus its own
data and compute time, as the agent measures it; its collectives are sent as
spans timed from its entry to their completion, with group, size, sequence
number and bytes. A thermal fault throttles the clock and raises the
temperature and the clock-event reasons in the device samples. A node that wears out (`pcie-replays`,
`nvlink-crc`, `pcie-width`, `hot-gpu`, `ib-flap`: trainer/nodehealth.py) drifts in its fault counters,
PCIe link or temperatures, read every 10 s of simulated time as the agent reads them, then, from the fault's
`fail` step, slows its ranks.

Power follows the GPU power model (rankwatch/agent/gpumodel.py): each rank's GPU
is busy (load 1) while it computes and idle-ish (`Timing.wait_load`) while it
loads data or waits in collectives. A power limit (`power_limits`, per rank,
or the `power-cap:watts=W[,rank=R]` fault, for all ranks or one, over its
steps) lowers a rank's clock under load where it binds, so its compute
stretches by f_max / f and its power drops. Each rank-step's energy is on its
step span (`rankwatch.energy_j`); the device samples carry the power during
compute and while waiting, utilization and the limit.

A hang (`hang:rank=R,at=S`) stops the job: rank R never enters step S's
gradient all-reduce and every other rank blocks inside it, so no rank finishes
step S or later and the steps end at S - 1. Sent to a collector, the ranks
then go on sending heartbeats in real time, as the agent's heartbeat thread
does while training is blocked, for `hang_for_s`; before that, one heartbeat
per rank every 5 s of simulated time gives the hang analyzer their history.

Steps go to a collector as real OTLP (the agent's exporter, one resource per
rank) or to a Parquet op trace in the generic format of `rankwatch import
ops`; the faults injected are logged as `fault_injected` events, and written
as JSON ground truth beside a Parquet file.

Each step also has a training curve (trainer/curve.py): every rank's loss and the step's gradient
norm, on the step spans, so the anomaly analyzer judges simulated runs; `spike` and `nan` faults
spoil one step's loss as the trainer's do.
"""

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from rankwatch.agent.config import HEARTBEAT_S
from rankwatch.agent.gpumodel import THERMAL, GpuModel, operating_points
from trainer import nodehealth
from trainer.curve import CURVE_KINDS, Curve, curve
from trainer.faults import WEAR_KINDS, Fault

SIMULATOR_KINDS = (
    "straggler",
    "slow-node",
    "slow-stage",
    "data-skew",
    "slow-link",
    "thermal",
    "hang",
    "power-cap",
    *CURVE_KINDS,
    *WEAR_KINDS,
)
HEARTBEAT_NS = int(HEARTBEAT_S * 10**9)  # the agent's heartbeat period
# Peak memory a simulated rank costs (a step is drawn for every rank at once), measured with
# `/usr/bin/time -f %M rankwatch simulate --steps 2` between 250k and 1M ranks written with --out
# (~1 KiB a rank) and between 20k and 100k ranks sent to a collector (~5 KiB: each rank's spans wait
# in the exporter), doubled and rounded up for the peaks a longer run and its faults add.
BYTES_PER_RANK_OUT, BYTES_PER_RANK_SENT = 2 * 2**10, 10 * 2**10


def bytes_per_rank(to_collector: bool) -> int:
    return BYTES_PER_RANK_SENT if to_collector else BYTES_PER_RANK_OUT


def available_memory() -> int:
    """Bytes this machine can give a new process: Linux's MemAvailable (free memory and the caches it
    would drop), else the free pages alone."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# trace requests in flight at most (the exporter waits for each to be acknowledged): enough for a loaded
# collector to commit several together, few enough that its queue, not the simulator, sets the pace
SENDERS = 4
# The gradient all-reduce: one collective that every rank waits for (the timing model above), reported
# in heartbeats as the reference trainer's agent reports DDP's all-reduce over the default group.
ALLREDUCE_OP, ALLREDUCE_GROUP = "all_reduce", "world"


@dataclass(frozen=True)
class Topology:
    """Ranks in Megatron's order: tensor-parallel ranks adjacent, then data-parallel
    replicas, then pipeline stages; `ranks_per_host` consecutive ranks share a host."""

    dp: int
    pp: int = 1
    tp: int = 1
    ranks_per_host: int = 8

    @property
    def ranks(self) -> int:
        return self.dp * self.pp * self.tp

    def dp_groups(self) -> np.ndarray:
        """Each rank's data-parallel group: the replicas of its stage and tensor-parallel rank."""
        rank = np.arange(self.ranks)
        return rank // (self.tp * self.dp) * self.tp + rank % self.tp

    def tp_groups(self) -> np.ndarray:
        """Each rank's tensor-parallel group: its replica's ranks of its stage."""
        return np.arange(self.ranks) // self.tp

    def placement(self) -> pd.DataFrame:
        rank = np.arange(self.ranks)
        return pd.DataFrame(
            {
                "rank": rank,
                "tp_rank": rank % self.tp,
                "dp_rank": (rank // self.tp) % self.dp,
                "pp_stage": rank // (self.tp * self.dp),
                "host": rank // self.ranks_per_host,
            }
        )


def _group_max(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Each rank's value replaced by the largest in its group."""
    top = np.zeros(groups.max() + 1)
    np.maximum.at(top, groups, values)
    return top[groups]


def first_hang(faults: list[Fault]) -> tuple[int, list[int]] | None:
    """The step no rank finishes (the earliest hang's `at`) and the ranks that never enter its
    all-reduce; None without a hang."""
    hangs = [f for f in faults if f.kind == "hang"]
    if not hangs:
        return None
    at = min(int(f.get("at")) for f in hangs)  # `at` and `rank`: a hang's required keys
    return at, sorted(int(f.get("rank")) for f in hangs if f.get("at") == at)


@dataclass(frozen=True)
class Timing:
    compute_s: float = 0.60  # per rank per step, at full speed
    data_s: float = 0.02
    allreduce_s: float = 0.10  # the data-parallel gradient all-reduce, transfer only
    allreduce_bytes: int = 512 * 2**20
    tp_allreduce_s: float = 0.02  # the tensor-parallel all-reduces of a step, when tp > 1
    tp_allreduce_bytes: int = 32 * 2**20
    jitter: float = 0.02  # lognormal sigma of compute
    pause_rate: float = 0.0005  # GC-like pauses per rank-step
    microbatches: int = 8
    wait_load: float = 0.1  # GPU utilization outside compute (data loading, collectives): idle-ish


def power_limits(caps, ranks: int, gpu: GpuModel = GpuModel()) -> np.ndarray:
    """Each rank's power limit from `caps`, {rank: W} as JSON has it (or a `rankwatch power
    recommend --json` document, whose `rank_caps` it is); the other ranks' the GPU's highest.
    ValueError with a one-line reason for anything else."""
    caps = caps.get("rank_caps", caps) if isinstance(caps, dict) else caps
    if not isinstance(caps, dict):
        raise ValueError("power caps are a JSON object of rank: watts")
    limits = np.full(ranks, gpu.limit_max_w)
    for rank, watts in caps.items():
        try:
            r, w = int(rank), float(watts)
        except (TypeError, ValueError):
            raise ValueError(f"power caps: {rank!r}: {watts!r} is not rank: watts") from None
        if not 0 <= r < ranks or not w > 0:
            raise ValueError(f"power caps: rank {r} at {w:g} W: ranks are 0..{ranks - 1}, watts positive")
        limits[r] = w
    return limits


def steps(
    topology: Topology,
    n_steps: int,
    faults: list[Fault],
    timing: Timing = Timing(),
    seed: int = 0,
    start_ns: int | None = None,
    power_limits: np.ndarray | None = None,
    gpu: GpuModel = GpuModel(),
    training: Curve = Curve(),
) -> Iterator[pd.DataFrame]:
    """One frame per step: rank, step, start_ns, end_ns, duration_s, data_s, compute_s, comm_wait_s,
    tp_allreduce_s (the tensor-parallel transfer), allreduce_done_s (when, from the step's start, its
    data-parallel group's all-reduce completes), sm_clock_mhz (under load), temp_c, clock_event_reasons,
    power_limit_w, busy_power_w and wait_power_w (while computing and otherwise) and energy_j (the
    rank-step's), loss and grad_norm (`training`'s curve). A hang ends the frames before its step.
    `power_limits`: each rank's power limit, W (default the GPU's highest), clamped as the GPU
    clamps it; a power-cap fault overrides it while active. Limits do not change the random draws:
    the same seed with and without caps plays the same jitter."""
    rng = np.random.default_rng(seed)
    place = topology.placement()
    n, t = topology.ranks, timing
    now = time.time_ns() if start_ns is None else start_ns
    hang = first_hang(faults)
    limits = np.full(n, gpu.limit_max_w) if power_limits is None else np.asarray(power_limits, float)
    losses = curve(training, n, faults, seed)
    hosts, placed_c = place["host"].to_numpy(), nodehealth.placed_c(n, seed)
    for step in range(n_steps if hang is None else min(n_steps, hang[0])):
        compute = t.compute_s * rng.lognormal(0.0, t.jitter, n)
        pauses = rng.random(n) < t.pause_rate
        compute[pauses] += rng.uniform(0.05, 0.2, pauses.sum())
        clock, temp, link = np.full(n, gpu.clock_max_mhz), 62.0 + placed_c + rng.normal(0, 1, n), np.ones(n)
        reasons, limit = np.zeros(n), limits.copy()
        for f in faults:
            if not f.active(step):
                continue
            if f.kind == "straggler":
                compute[f.rank] *= f.get("slowdown")
            elif f.kind == "slow-node":
                compute[(place["host"] == f.get("node")).to_numpy()] *= f.get("slowdown")
            elif f.kind == "slow-stage":
                compute[(place["pp_stage"] == f.get("stage")).to_numpy()] *= f.get("slowdown")
            elif f.kind == "data-skew":
                compute *= rng.lognormal(0.0, f.get("cv"), n)
            elif f.kind == "thermal":  # throttled: clocks down, hotter, slower in proportion
                clock[f.rank], temp[f.rank] = gpu.thermal_clock_mhz, gpu.thermal_c
                reasons[f.rank] = THERMAL
                compute[f.rank] *= gpu.clock_max_mhz / gpu.thermal_clock_mhz
            elif f.kind == "slow-link":  # its link slows every collective of every group it is in
                link[f.rank] = max(link[f.rank], f.get("factor"))
            elif f.kind == "power-cap":
                limit[slice(None) if f.rank is None else f.rank] = f.get("watts")
        compute *= nodehealth.slowdowns(faults, hosts, step)  # a worn node, failing
        temp += nodehealth.hotter_c(faults, topology.ranks_per_host, n, step)
        # the power limit, where it binds under load, lowers the clock further and stretches compute
        limit, throttled = np.clip(limit, gpu.limit_min_w, gpu.limit_max_w), reasons > 0
        busy_clock, busy_w, reasons = operating_points(gpu, 1.0, limit, throttled)
        compute *= clock / busy_clock
        clock, wait_w = busy_clock, operating_points(gpu, t.wait_load, limit, throttled)[1]
        data = t.data_s * rng.lognormal(0.0, t.jitter, n)
        # tensor-parallel groups move at their slowest member's pace
        tp_pace = compute.reshape(-1, topology.tp).max(axis=1).repeat(topology.tp)
        # each replica's pipeline: the slowest stage sets the pace, plus the 1F1B bubble
        per_stage = tp_pace.reshape(topology.pp, topology.dp, topology.tp)[:, :, 0]  # stage x replica
        slots = (t.microbatches + topology.pp - 1) / t.microbatches
        pipeline = per_stage.max(axis=0) * (slots if topology.pp > 1 else 1.0)  # per replica
        # a collective runs at the pace of the slowest link among its group's ranks
        tp_s = t.tp_allreduce_s * _group_max(link, topology.tp_groups()) if topology.tp > 1 else np.zeros(n)
        dp_s = t.allreduce_s * _group_max(link, topology.dp_groups())
        step_s = data.max() + pipeline.max() + tp_s.max() + dp_s.max()
        comm_wait = step_s - data - compute
        energy = wait_w * step_s + (busy_w - wait_w) * compute
        # a group's all-reduce starts when its last rank enters and lasts its transfer time
        allreduce_done = _group_max(data + compute + tp_s, topology.dp_groups()) + dp_s
        loss, grad_norm = next(losses)
        yield pd.DataFrame(
            {
                "rank": place["rank"],
                "step": step,
                "start_ns": now,
                "end_ns": now + int(step_s * 1e9),
                "duration_s": step_s,
                "data_s": data,
                "compute_s": compute,
                "comm_wait_s": comm_wait,
                "tp_allreduce_s": tp_s,
                "allreduce_done_s": allreduce_done,
                "sm_clock_mhz": clock,
                "temp_c": temp,
                "clock_event_reasons": reasons,
                "power_limit_w": limit,
                "busy_power_w": busy_w,
                "wait_power_w": wait_w,
                "energy_j": energy,
                "loss": loss,
                "grad_norm": grad_norm,
            }
        )
        now += int(step_s * 1e9)


def to_collector(
    exporter,
    run_id: str,
    topology: Topology,
    frames: Iterable[pd.DataFrame],
    faults: list[Fault],
    hang_for_s: float = 60.0,
    timing: Timing = Timing(),
    gpu: GpuModel = GpuModel(),
    seed: int = 0,
) -> tuple[int, int]:
    """Send the steps (of `gpu`s) as OTLP through the agent's exporter, one resource per rank, with their
    device samples and node health readings (drawn from `seed`), and the ranks' heartbeats; returns the
    rank-steps and the spans (steps and their collectives) handed to it. When the frames stop at a hang,
    the hang begins once the wall clock reaches the end of the last step (simulated time runs ahead of it;
    steps dated in the past would look like a stall while they arrive), and heartbeats follow in real time
    for `hang_for_s` seconds."""
    from opentelemetry.sdk.resources import Resource

    from rankwatch.agent import semconv as sc

    place = topology.placement()
    resources = [
        Resource.create(
            {
                sc.RUN_ID: run_id,
                sc.RANK: int(r.rank),
                sc.WORLD_SIZE: topology.ranks,
                sc.DP_RANK: int(r.dp_rank),
                sc.PP_STAGE: int(r.pp_stage),
                sc.TP_RANK: int(r.tp_rank),
                sc.HOST_NAME: f"sim-node-{r.host:04d}",
                sc.DEVICE: "simulated",
                sc.SOURCE: sc.SOURCE_SIMULATED,
            }
        )
        for r in place.itertuples()
    ]
    announced: set[str] = set()
    dp_group, tp_group = topology.dp_groups(), topology.tp_groups()
    health = nodehealth.Readings(topology.ranks, topology.ranks_per_host, faults, seed)

    def announce(candidates: list[Fault], step: int, time_ns: int) -> None:
        for f in candidates:
            if f.active(step) and f.spec not in announced:
                announced.add(f.spec)
                exporter.event(
                    sc.EVENT_FAULT,
                    time_ns,
                    {sc.STEP: step, sc.FAULT_SPEC: f.spec, sc.RANK: f.rank if f.rank is not None else 0},
                )

    rank_steps, sent, step, last_end, next_beat = 0, 0, -1, time.time_ns(), None
    for frame in frames:
        step, start, last_end = (int(frame[column].iloc[0]) for column in ("step", "start_ns", "end_ns"))
        announce(faults, step, start)
        next_beat = start + HEARTBEAT_NS if next_beat is None else next_beat
        data, compute = frame["data_s"].to_numpy(), frame["compute_s"].to_numpy()
        while next_beat < last_end:  # where each rank is in this step at that moment
            offset = (next_beat - start) / 1e9
            _heartbeats(
                exporter, next_beat, step, np.select([offset < data, offset < data + compute], ["data", "compute"], "")
            )
            next_beat += HEARTBEAT_NS
        for row in frame.itertuples():
            spans = [
                (
                    "step",
                    row.start_ns,
                    row.end_ns,
                    {
                        sc.KIND: sc.KIND_STEP,
                        sc.STEP: step,
                        sc.DATA_S: row.data_s,
                        sc.COMPUTE_S: row.compute_s,
                        sc.COMM_WAIT_S: row.comm_wait_s,
                        sc.TOKENS: 4096,
                        sc.STEP_ENERGY_J: row.energy_j,
                        sc.LOSS: row.loss,
                        sc.GRAD_NORM: row.grad_norm,
                    },
                )
            ]
            # each collective as the agent times it: from the rank's entry to its completion
            entered = row.start_ns + int((row.data_s + row.compute_s) * 1e9)
            if topology.tp > 1:
                done = entered + int(row.tp_allreduce_s * 1e9)
                spans.append(
                    _collective(step, f"tp{tp_group[row.rank]}", topology.tp, timing.tp_allreduce_bytes, entered, done)
                )
                entered = done
            spans.append(
                _collective(
                    step,
                    f"dp{dp_group[row.rank]}",
                    topology.dp,
                    timing.allreduce_bytes,
                    entered,
                    row.start_ns + int(row.allreduce_done_s * 1e9),
                )
            )
            exporter.trace(spans, resource=resources[row.rank])
            sent += len(spans)
        rank_steps += len(frame)
        instant = {sc.POWER_KIND: sc.POWER_KIND_INSTANT}
        exporter.samples(
            (
                metric,
                int(time_ns),
                float(value),
                {
                    sc.RANK: int(rank),
                    sc.GPU: int(rank) % topology.ranks_per_host,
                    sc.SOURCE: sc.SOURCE_SIMULATED,
                    **(instant if metric == sc.POWER_INSTANT_W else {}),
                },
            )
            for rank, time_ns, metric, value in device_samples(frame, timing, gpu).itertuples(index=False)
        )
        exporter.samples(
            (
                metric,
                int(time_ns),
                float(value),
                {
                    sc.RANK: int(rank),
                    sc.SOURCE: sc.SOURCE_SIMULATED,
                    **({sc.GPU: int(local)} if local == local else {}),  # (NaN: a port's, no GPU's)
                    **({sc.IB_PORT: port} if port else {}),
                },
            )
            for rank, time_ns, metric, value, local, port in health.of(frame).itertuples(index=False)
        )
    hang = first_hang(faults)
    if hang is not None and step == hang[0] - 1:
        time.sleep(max(last_end - time.time_ns(), 0) / 1e9)
        announce([f for f in faults if f.kind == "hang"], hang[0], last_end)  # faults from step S on never start
        _stuck(exporter, topology.ranks, *hang, hang_for_s)
    return rank_steps, sent


def device_samples(frame: pd.DataFrame, timing: Timing = Timing(), gpu: GpuModel = GpuModel()) -> pd.DataFrame:
    """A step frame's device samples as each rank's sampler would catch them (rank, ts ns, metric,
    value): clock, temperature and clock-event reasons at the step's end; power and utilization
    busy, in the middle of compute, and waiting, at the step's end; the power limit and the range of
    limits `gpu` accepts at the step's end. No energy counter: the step spans carry each step's energy."""
    from rankwatch.agent import semconv as sc

    end = frame["end_ns"]
    busy = frame["start_ns"] + ((frame["data_s"] + frame["compute_s"] / 2) * 1e9).astype("int64")
    samples = [
        (sc.SM_CLOCK_MHZ, end, frame["sm_clock_mhz"]),
        (sc.GPU_TEMP_C, end, frame["temp_c"]),
        (sc.CLOCK_EVENT_REASONS, end, frame["clock_event_reasons"]),
        (sc.POWER_INSTANT_W, busy, frame["busy_power_w"]),
        (sc.GPU_UTIL_PCT, busy, 100.0),
        (sc.POWER_INSTANT_W, end, frame["wait_power_w"]),
        (sc.GPU_UTIL_PCT, end, 100.0 * timing.wait_load),
        (sc.POWER_LIMIT_W, end, frame["power_limit_w"]),
        (sc.POWER_LIMIT_MIN_W, end, gpu.limit_min_w),
        (sc.POWER_LIMIT_MAX_W, end, gpu.limit_max_w),
    ]
    return pd.concat(
        [
            pd.DataFrame({"rank": frame["rank"], "ts": ts, "metric": metric, "value": value})
            for metric, ts, value in samples
        ],
        ignore_index=True,
    )


def tables(
    topology: Topology, n_steps: int, faults: list[Fault], seed: int = 0, timing: Timing = Timing()
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """A whole simulated run as the store would hold it, without a collector: its rank-steps (rank,
    step, end_ts ns, duration_s, compute_s, ...), its device samples and node health readings (rank, ts ns,
    metric, value, gpu, port: the readings' GPU index and InfiniBand port) and its placement (rank, host,
    dp_rank, pp_stage, tp_rank, world_size)."""
    frames = list(steps(topology, n_steps, faults, timing, seed, start_ns=10**18))
    run_steps = pd.concat(frames, ignore_index=True).rename(columns={"end_ns": "end_ts"})
    health = nodehealth.Readings(topology.ranks, topology.ranks_per_host, faults, seed)
    readings = [part for part in map(health.of, frames) if not part.empty]
    samples = pd.concat([device_samples(run_steps.rename(columns={"end_ts": "end_ns"}), timing), *readings])
    return run_steps, samples.reset_index(drop=True), topology.placement().assign(world_size=topology.ranks)


def _collective(step: int, group: str, size: int, nbytes: int, start_ns: int, end_ns: int) -> tuple:
    """A gradient all-reduce span, with the attributes the agent's collective wrappers record."""
    from rankwatch.agent import semconv as sc

    return (
        "all_reduce",
        start_ns,
        end_ns,
        {
            sc.KIND: sc.KIND_COMM,
            sc.STEP: step,
            sc.COMM_GROUP: group,
            sc.COMM_GROUP_SIZE: size,
            sc.COMM_SEQ: step,
            sc.COMM_BYTES: nbytes,
        },
    )


def _stuck(exporter, n_ranks: int, step: int, stuck: list[int], seconds: float) -> None:
    """`seconds` of a job stuck at `step`, seen through its heartbeats, sent in real time: the
    stuck ranks still in compute, every other rank blocked in the step's all-reduce."""
    phase = np.where(np.isin(np.arange(n_ranks), stuck), "compute", "")
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        _heartbeats(exporter, time.time_ns(), step, phase)
        time.sleep(min(HEARTBEAT_NS / 1e9, left))


def _heartbeats(exporter, time_ns: int, step: int, phase: np.ndarray) -> None:
    """One heartbeat per rank with the attributes the agent's heartbeat thread sends. `phase` is
    each rank's "data" or "compute", or "" for a rank inside the step's all-reduce (collective
    #step, not done); the others last completed the previous step's all-reduce."""
    from rankwatch.agent import semconv as sc

    for rank, p in enumerate(phase.tolist()):
        in_allreduce = p == ""
        seq = step - 1 + in_allreduce
        attributes = {sc.RANK: rank, sc.STEP: step, sc.PHASE: p}
        if seq >= 0:
            attributes |= {
                sc.COMM_OP: ALLREDUCE_OP,
                sc.COMM_GROUP: ALLREDUCE_GROUP,
                sc.COMM_SEQ: seq,
                sc.COMM_DONE: not in_allreduce,
            }
        exporter.event(sc.EVENT_HEARTBEAT, time_ns, attributes)


def to_parquet(path: Path, topology: Topology, frames: Iterable[pd.DataFrame], faults: list[Fault]) -> int:
    """Write the generic op trace (rank, step, op, start, duration, kind, placement) and its ground
    truth (`<path>.truth.json`); returns rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    place = topology.placement().set_index("rank")
    writer, rows = None, 0
    for frame in frames:
        start = frame["start_ns"] / 1e9
        ops = pd.concat(
            [
                pd.DataFrame(
                    {
                        "rank": frame["rank"],
                        "step": frame["step"],
                        "op": "data",
                        "kind": "data",
                        "start": start,
                        "duration": frame["data_s"],
                    }
                ),
                pd.DataFrame(
                    {
                        "rank": frame["rank"],
                        "step": frame["step"],
                        "op": "forward-backward-compute",
                        "kind": "compute",
                        "start": start + frame["data_s"],
                        "duration": frame["compute_s"],
                    }
                ),
                pd.DataFrame(
                    {
                        "rank": frame["rank"],
                        "step": frame["step"],
                        "op": "grads-all-reduce",
                        "kind": "comm",
                        "start": start + frame["data_s"] + frame["compute_s"],
                        "duration": frame["comm_wait_s"],
                    }
                ),
            ]
        ).join(place[["dp_rank", "pp_stage", "tp_rank"]], on="rank")
        table = pa.Table.from_pandas(ops, preserve_index=False)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
        rows += len(ops)
    if writer:
        writer.close()
    truth = [{"spec": f.spec, "kind": f.kind, **dict(f.params)} for f in faults]
    Path(f"{path}.truth.json").write_text(json.dumps({"topology": vars(topology), "faults": truth}, indent=2))
    return rows
