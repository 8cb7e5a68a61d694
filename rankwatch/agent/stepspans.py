"""A finished step's marks, placed on the wall clock, into its spans.

A rank resolves its marks (CUDA events, monotonic readings) to wall-clock ns and hands over a
`StepMarks` of plain values: tuples, strings, numbers. Everything after that, the interval
arithmetic of the exposed communication wait and the spans with their attributes, is this pure
function, run where the spans are encoded: on the rank's export thread, or in the node's sidecar
(rankwatch/agent/node.py), off the rank's CPU. Being plain values, the marks cross a socket as they are.
"""

from typing import NamedTuple

from rankwatch.agent import semconv as sc
from rankwatch.agent.timeline import clip, exposed, length, serialized, subtract

COMPUTE_PHASES = ("forward", "backward", "optimizer")
# the phase a pipeline schedule's step runs in; the forward and backward chunks of the stage inside it
PIPELINE = "pipeline"
# how the training stream waits for a collective: DDP waits for its buckets at the end of backward,
# a blocking call at once, an async_op=True call where the code waits (unknown here)
BUCKET, SYNC, ASYNC = "bucket", "sync", "async"

Interval = tuple[int, int]
Span = tuple[str, int, int, dict]  # name, start ns, end ns, attributes


class Comm(NamedTuple):
    """A completed collective in wall ns. `lane`: the queue it ran in, one at a time in issue order
    (its group's communicator, a pair's for point to point, and the calling stream), where known;
    `on_stream`: called on the step's own stream (so a blocking call stalls the phases); `waited`:
    where the caller began to wait for an async_op=True call, if it did."""

    op: str
    group: str
    group_size: int
    seq: int
    nbytes: int
    waits: str
    role: str | None  # the DeviceMesh dimension its group stands for
    peer: int | None
    on_stream: bool
    lane: tuple | None
    launch: int
    end: int
    waited: int | None = None


class Move(NamedTuple):
    """A copy between memory tiers in wall ns; `stalls`: the training loop made it itself (on its
    stream, or on the host), so nothing computed meanwhile."""

    src: str
    dst: str
    nbytes: int
    what: str
    start: int
    end: int
    cpu_ns: int
    stalls: bool


class StepMarks(NamedTuple):
    """One finished step in wall ns; `values`: its recorded values under their attribute names."""

    step: int
    start: int
    end: int
    phases: tuple[tuple[str, int, int], ...]
    comms: tuple[Comm, ...]
    moves: tuple[Move, ...]
    host: tuple[tuple[str, int, int], ...]  # host work the step waited for (an offloaded optimizer's)
    values: dict
    energy_j: float | None


def spans_of(m: StepMarks) -> list[Span]:
    """The step span (its data, compute and exposed-wait split; docs/telemetry.md) and its children."""
    window = (m.start, m.end)
    comm = lanes_serialized(m.comms)
    blocked = [(c.waited, b) for c, _, b in comm if c.waited is not None and c.on_stream]
    computing, comm_wait, by_role = compute_and_wait(window, m.phases, comm, blocked)
    stalled = [(t.start, t.end) for t in m.moves if t.stalls]
    if stalled:  # a copy the training loop itself made (on its stream, or on the host): no compute then
        computing = subtract(computing, stalled)
    attributes: dict = {
        sc.KIND: sc.KIND_STEP,
        sc.STEP: m.step,
        sc.DATA_S: sum(b - a for name, a, b in m.phases if name == "data") / 1e9,
        sc.COMPUTE_S: length(computing) / 1e9,
        sc.COMM_WAIT_S: comm_wait,
        **{sc.COMM_WAIT_S_OF + role: wait for role, wait in by_role.items()},
    }
    if m.moves:  # what compute hid of the copies between tiers, and what it did not
        moving = [(t.start, t.end) for t in m.moves]
        attributes[sc.TRANSFER_S] = length(clip(moving, window)) / 1e9
        attributes[sc.TRANSFER_EXPOSED_S] = exposed(moving, computing, window) / 1e9
        attributes[sc.TRANSFER_CPU_S] = sum(t.cpu_ns for t in m.moves) / 1e9
    if m.host:
        attributes[sc.HOST_OPTIMIZER_S] = length(clip([(a, b) for _, a, b in m.host], window)) / 1e9
    if any(name == PIPELINE for name, _, _ in m.phases):
        attributes[sc.PIPELINE_BUBBLE_S] = bubble(m.phases)
    if m.energy_j is not None:
        attributes[sc.STEP_ENERGY_J] = m.energy_j
    attributes.update(m.values)
    step = m.step
    spans: list[Span] = [("step", m.start, m.end, attributes)]
    spans += [(name, a, b, {sc.KIND: sc.KIND_PHASE, sc.STEP: step}) for name, a, b in m.phases]
    spans += [
        (
            c.op,
            a,
            b,
            {
                sc.KIND: sc.KIND_COMM,
                sc.STEP: step,
                sc.COMM_GROUP: c.group,
                sc.COMM_GROUP_SIZE: c.group_size,
                sc.COMM_SEQ: c.seq,
                sc.COMM_BYTES: c.nbytes,
                **({sc.COMM_ROLE: c.role} if c.role is not None else {}),
                **({sc.COMM_PEER: c.peer} if c.peer is not None else {}),
            },
        )
        for c, a, b in comm
    ]
    spans += [
        (
            f"{t.src}->{t.dst}",
            t.start,
            t.end,
            {
                sc.KIND: sc.KIND_TRANSFER,
                sc.STEP: step,
                sc.TRANSFER_SRC: t.src,
                sc.TRANSFER_DST: t.dst,
                sc.TRANSFER_BYTES: t.nbytes,
                **({sc.TRANSFER_FOR: t.what} if t.what else {}),
            },
        )
        for t in m.moves
    ]
    spans += [(name, a, b, {sc.KIND: sc.KIND_HOST, sc.STEP: step, sc.HOST_WORK: name}) for name, a, b in m.host]
    return spans


def lanes_serialized(comms: tuple[Comm, ...]) -> list[tuple[Comm, int, int]]:
    """(collective, start, end) for each collective. The collectives of one lane (stream events of one
    group's NCCL communicator, a pair's for point to point, called from one stream, each ending when
    that queue was free) run one after another: each starts at its launch or at the end of the one
    before it, a bound that ops the agent does not see (functional collectives, coalesced ops,
    all_gather_object's) only push later. Nothing else is assumed ordered: the rest start at their launch."""
    lanes: dict[tuple, list[int]] = {}
    for i, c in enumerate(comms):
        if c.lane is not None:
            lanes.setdefault(c.lane, []).append(i)
    starts = [c.launch for c in comms]
    for ops in lanes.values():
        for i, (a, _) in zip(ops, serialized([(comms[i].launch, comms[i].end) for i in ops])):
            starts[i] = a
    return [(c, starts[i], c.end) for i, c in enumerate(comms)]


def compute_and_wait(
    window: Interval, phases, comm: list[tuple[Comm, int, int]], blocked: list[Interval]
) -> tuple[list[Interval], float, dict[str, float]]:
    """(compute as intervals, exposed wait and the exposed wait of each DeviceMesh dimension, in
    seconds). The exposed wait is the time communication was in flight and nothing computed
    (docs/telemetry.md): outside the compute phases, or inside them where the training stream waited
    for it: a blocking collective called on it from its launch to its end (one called on a side stream
    stalls that stream only), an async_op=True one from where it was waited for on it (`blocked`) to
    its end, DDP's wait at the end of backward from the last bucket's launch on. Compute is the compute
    phases less the exposed wait within them, so that data, compute and the wait tile the step (a
    pipeline's bubble, outside its chunks, takes nothing from compute)."""
    waits = [(c.launch, b) for c, _, b in comm if c.waits == SYNC and c.on_stream] + blocked
    buckets = [c.launch for c, _, _ in comm if c.waits == BUCKET]
    backward = [b for name, _, b in phases if name == "backward"]
    if buckets and backward:
        waits.append((max(buckets), backward[-1]))
    computing = [(a, b) for name, a, b in phases if name in COMPUTE_PHASES]
    compute = subtract(computing, waits)
    of_role: dict[str, list] = {}
    for c, a, b in comm:
        if c.role is not None:
            of_role.setdefault(c.role, []).append((a, b))
    by_role = {role: exposed(spans, compute, window) / 1e9 for role, spans in of_role.items()}
    exposed_spans = clip(subtract([(a, b) for _, a, b in comm], compute), window)
    return subtract(computing, exposed_spans), length(exposed_spans) / 1e9, by_role


def bubble(phases) -> float:
    """Seconds of the step's pipeline schedule in which the stage computed nothing (no forward or
    backward chunk ran): waiting for the stages before and after it, the pipeline's bubble."""
    windows = [(a, b) for name, a, b in phases if name == PIPELINE]
    chunks = [(a, b) for name, a, b in phases if name in COMPUTE_PHASES]
    return length(subtract(windows, chunks)) / 1e9
