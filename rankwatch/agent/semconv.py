"""Telemetry names: the one definition of every `rankwatch.*` attribute,
span kind, event and device metric that crosses the wire.

The agent writes these names and the collector reads them; both import them
from here so the two can never drift. docs/telemetry.md documents each one.
A leaf: it imports nothing, so the collector, the dashboard and the importers
read the names without loading the agent (rankwatch/agent/__init__.py imports lazily).
"""

# Resource attributes: who is talking. Span, data point and log attributes of
# the same name override the resource (one process may speak for many ranks).
RUN_ID = "rankwatch.run_id"
RANK = "rankwatch.rank"
LOCAL_RANK = "rankwatch.local_rank"
WORLD_SIZE = "rankwatch.world_size"
DP_RANK = "rankwatch.dp_rank"
PP_STAGE = "rankwatch.pp_stage"
TP_RANK = "rankwatch.tp_rank"
DEVICE = "rankwatch.device"
HOST_NAME = "host.name"  # OpenTelemetry semantic convention
PROCESS_PID = "process.pid"  # OpenTelemetry semantic convention

# Span attributes.
KIND = "rankwatch.kind"
STEP = "rankwatch.step"
MICROBATCH = "rankwatch.microbatch"
# on `step` spans
LOSS = "rankwatch.loss"
GRAD_NORM = "rankwatch.grad_norm"
TOKENS = "rankwatch.tokens"
LR = "rankwatch.lr"
MFU = "rankwatch.mfu"
STEP_FLOPS = "rankwatch.flops"  # the model FLOPs of the rank's step (6 x parameters x tokens): its work
DATA_S = "rankwatch.data_s"
COMPUTE_S = "rankwatch.compute_s"
COMM_WAIT_S = "rankwatch.comm_wait_s"
# a step's exposed communication wait of one DeviceMesh dimension's groups (COMM_ROLE): COMM_WAIT_S_OF + role
COMM_WAIT_S_OF = "rankwatch.comm_wait_s."
# the time a pipeline stage waited in its schedule's step, computing nothing (its `pipeline` phase less its
# forward and backward chunks)
PIPELINE_BUBBLE_S = "rankwatch.pipeline_bubble_s"
STEP_ENERGY_J = "rankwatch.energy_j"  # the GPU's energy over the step, from its energy counter
# the time some copy between memory tiers (TRANSFER spans) was in flight and no compute phase covered it
TRANSFER_EXPOSED_S = "rankwatch.transfer.exposed_s"
TRANSFER_S = "rankwatch.transfer_s"  # the time some copy between memory tiers was in flight, overlapped or not
TRANSFER_CPU_S = "rankwatch.transfer.cpu_s"  # the CPU time the copies took on the threads that made them
HOST_OPTIMIZER_S = "rankwatch.host_optimizer_s"  # the time an optimizer stepped on the host's CPUs (offloaded)
# on `transfer` spans (their name: "<source>-><destination>")
TRANSFER_SRC = "rankwatch.transfer.src"  # a memory tier: one of TIERS
TRANSFER_DST = "rankwatch.transfer.dst"
TRANSFER_BYTES = "rankwatch.transfer.bytes"
TRANSFER_FOR = "rankwatch.transfer.for"  # what moved: optimizer state, parameters, gradients, activations
# on `host` spans: work on the host's CPUs the step waits for (an offloaded optimizer's step)
HOST_WORK = "rankwatch.host.work"
# on `comm` spans
COMM_GROUP = "rankwatch.comm.group"
COMM_GROUP_SIZE = "rankwatch.comm.group_size"
COMM_ROLE = "rankwatch.comm.role"  # the DeviceMesh dimension the group is (dp, tp, pp, ...), where known
COMM_SEQ = "rankwatch.comm.seq"
COMM_PEER = "rankwatch.comm.peer"  # the other rank (global) of a point-to-point operation
COMM_BYTES = "rankwatch.comm.bytes"
# on heartbeat events: the last collective the rank entered, and whether it completed
COMM_OP = "rankwatch.comm.op"
COMM_DONE = "rankwatch.comm.done"

# Values of rankwatch.kind. A `step` span becomes a row of `steps`; every
# other span becomes a row of `ops`.
KIND_STEP = "step"
KIND_PHASE = "phase"
KIND_COMM = "comm"
KIND_COMPUTE = "compute"
KIND_DATA = "data"
KIND_OTHER = "other"
KIND_TRANSFER = "transfer"  # a copy between memory tiers (agent.transfer)
KIND_HOST = "host"  # work on the host's CPUs (agent.host_work)
OP_KINDS = (KIND_PHASE, KIND_COMM, KIND_COMPUTE, KIND_DATA, KIND_OTHER, KIND_TRANSFER, KIND_HOST)
# Memory tiers a transfer moves between: GPU memory, host memory (pageable, or pinned: the GPU's copy engines
# read it directly) and local disk.
TIER_GPU, TIER_HOST, TIER_PINNED, TIER_DISK = "gpu", "host", "pinned", "disk"
TIERS = (TIER_GPU, TIER_HOST, TIER_PINNED, TIER_DISK)
# A probe of the disk a job swaps to, timed at its start: what the disk gives to large sequential I/O
EVENT_DISK_PROBE = "disk_probe"
DISK_PROBE_READ_BPS = "rankwatch.disk_probe.read_bytes_per_s"
DISK_PROBE_WRITE_BPS = "rankwatch.disk_probe.write_bytes_per_s"
DISK_PROBE_PATH = "rankwatch.disk_probe.path"

# Log records: the event name, plus the step it happened at.
EVENT = "rankwatch.event"
EVENT_HEARTBEAT = "heartbeat"  # every few seconds: the step and phase a rank is in
EVENT_FAULT = "fault_injected"  # a fault the trainer injected, with its spec
EVENT_TELEMETRY_BACKLOG = "telemetry_backlog"  # spans delivered late or dropped while the collector was away
SPANS_DELIVERED_LATE = "rankwatch.spans_delivered_late"
# telemetry a rank dropped before the collector acknowledged it, whatever the cause: sent when its counts
# grew (at most every 5 s) and at exit, cumulative since the rank's process started, so a lost event is
# made good by the next; on the rank's resource (the fleet simulator: rankwatch.rank on the record)
EVENT_TELEMETRY_LOSS = "telemetry_loss"
SPANS_DROPPED = "rankwatch.spans_dropped"  # int: spans of every kind (also on telemetry_backlog: its own count)
RANK_STEPS_DROPPED = "rankwatch.rank_steps_dropped"  # int: the `step` spans among them
# A rank's end other than a clean one, with its cause: told by the rank itself (an exception, a signal, an exit
# with a code) or, for a rank that died without a word (SIGKILL, a crash), by its node's sidecar
EVENT_RANK_FAILED = "rank_failed"
FAILURE_CAUSE = "rankwatch.failure.cause"
CAUSE_EXCEPTION = "exception"  # a Python exception ended the rank (type, message, and its stack as the body)
CAUSE_OUT_OF_MEMORY = "out_of_memory"  # an exception saying the GPU's (or host's) memory ran out
# stopped with the job, which failed elsewhere first: a signal asked it to stop (torchrun tearing a failed job
# down), or its collective raised as a peer's connection closed (the exception's type and message kept)
CAUSE_TERMINATED = "terminated"
CAUSE_EXIT = "exit"  # it exited with a nonzero code (os._exit, sys.exit)
CAUSE_KILLED = "killed"  # gone without a word: SIGKILL, a crash (seen by the sidecar)
CAUSE_KILLED_OUT_OF_MEMORY = "killed_out_of_memory"  # gone without a word as the kernel's OOM killer killed
FAILURE_CAUSES = (
    CAUSE_EXCEPTION,
    CAUSE_OUT_OF_MEMORY,
    CAUSE_TERMINATED,
    CAUSE_EXIT,
    CAUSE_KILLED,
    CAUSE_KILLED_OUT_OF_MEMORY,
)
FAILURE_EXCEPTION = "rankwatch.failure.exception"  # the exception's type, qualified
FAILURE_MESSAGE = "rankwatch.failure.message"  # its message
FAILURE_SIGNAL = "rankwatch.failure.signal"  # the signal's name, where one ended it
FAILURE_EXIT_CODE = "rankwatch.failure.exit_code"  # int
ATTEMPT = "rankwatch.attempt"  # int: torchrun's restart count of the job's workers (0: the first attempt)
FAULT_SPEC = "rankwatch.fault"
# Where each rank is (a hang's forensics): asked for by the collector (a `stacks` command, made when a hang
# finding fires or by `rankwatch stacks`), answered by every rank asked with one event: its threads' Python
# stacks and its Flight Recorder entries, as JSON in the body (docs/telemetry.md has its form)
EVENT_RANK_STACKS = "rank_stacks"
STACKS_REQUEST = "rankwatch.stacks.request"  # int: the id of the `stacks` command answered
PHASE = "rankwatch.phase"
# checkpoints (trainer/checkpoint.py): a snapshot reached a tier, was loaded, or was refused
EVENT_CHECKPOINT_SAVED = "checkpoint_saved"  # copied to host memory, or durable on disk
EVENT_CHECKPOINT_RESTORED = "checkpoint_restored"
EVENT_CHECKPOINT_CORRUPT = "checkpoint_corrupt"  # partial or damaged on disk: skipped for an older one
# not taken (no ring slot free) or not written (the writer busy, a newer one written instead)
EVENT_CHECKPOINT_SKIPPED = "checkpoint_skipped"
CKPT_TIER = "rankwatch.checkpoint.tier"
CKPT_BYTES = "rankwatch.checkpoint.bytes"
CKPT_BLOCKED_S = "rankwatch.checkpoint.blocked_s"  # training-loop time the snapshot cost
CKPT_DURABLE_S = "rankwatch.checkpoint.durable_s"  # from the snapshot's start until it was safe in its tier
CKPT_WRITE_S = "rankwatch.checkpoint.write_s"  # a disk checkpoint's write, until durable: the disk was busy
CKPT_PATH = "rankwatch.checkpoint.path"
CKPT_WHY = "rankwatch.checkpoint.why"
CKPT_SKIPPED = "rankwatch.checkpoint.skipped"  # int: snapshots and disk writes a rank skipped so far
TIER_MEMORY = "memory"  # a checkpoint's tiers (CKPT_TIER): host memory, or TIER_DISK

# Data point attributes of device metrics.
GPU = "gpu"  # device index on the host, as in DCGM exporter labels
SOURCE = "rankwatch.source"  # "nvml", "simulated" or "rapl"
SOURCE_NVML = "nvml"
SOURCE_SIMULATED = "simulated"
SOURCE_RAPL = "rapl"
SOURCE_HOST = "host"  # the rank's process and its host, from /proc (rankwatch/agent/host.py) and /sys
# on power samples: which power NVML gave, the instantaneous field or its windowed average
POWER_KIND = "rankwatch.power.kind"
POWER_KIND_INSTANT = "instant"
POWER_KIND_AVERAGE = "average"
RAPL_ZONE = "rankwatch.rapl.zone"  # on host samples: the RAPL zone's name, e.g. "package-0"

# Device metric names, aligned with DCGM field names.
POWER_W = "DCGM_FI_DEV_POWER_USAGE"
POWER_INSTANT_W = "DCGM_FI_DEV_POWER_USAGE_INSTANT"
ENERGY_J = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
SM_CLOCK_MHZ = "DCGM_FI_DEV_SM_CLOCK"
MEM_CLOCK_MHZ = "DCGM_FI_DEV_MEM_CLOCK"
GPU_TEMP_C = "DCGM_FI_DEV_GPU_TEMP"
GPU_UTIL_PCT = "DCGM_FI_DEV_GPU_UTIL"
POWER_LIMIT_W = "DCGM_FI_DEV_POWER_MGMT_LIMIT"
POWER_LIMIT_MIN_W = "DCGM_FI_DEV_POWER_MGMT_LIMIT_MIN"  # the lowest power limit the GPU accepts
POWER_LIMIT_MAX_W = "DCGM_FI_DEV_POWER_MGMT_LIMIT_MAX"  # the highest
FB_USED_MIB = "DCGM_FI_DEV_FB_USED"  # GPU memory in use, MiB
FB_TOTAL_MIB = "DCGM_FI_DEV_FB_TOTAL"  # GPU memory in all, MiB
XID_ERRORS = "DCGM_FI_DEV_XID_ERRORS"  # an XID error's code, one sample per error as it happens
ECC_SBE_VOLATILE = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"  # corrected (single-bit) ECC errors since the driver loaded
ECC_DBE_VOLATILE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"  # uncorrected (double-bit) ECC errors since the driver loaded
ECC_SBE_AGGREGATE = "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"  # corrected ECC errors over the GPU's life
ECC_DBE_AGGREGATE = "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"  # uncorrected ECC errors over the GPU's life
NVLINK_TX_BPS = "DCGM_FI_PROF_NVLINK_TX_BYTES"  # NVLink data sent, bytes/s, all links together
NVLINK_RX_BPS = "DCGM_FI_PROF_NVLINK_RX_BYTES"  # and received
PCIE_TX_BPS = "DCGM_FI_PROF_PCIE_TX_BYTES"  # PCIe data sent, bytes/s
PCIE_RX_BPS = "DCGM_FI_PROF_PCIE_RX_BYTES"  # and received
CLOCK_EVENT_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"  # a bitmask, NVML's nvmlClocksEventReason*
CLOCK_EVENT_REASON_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
CLOCK_EVENT_REASON_WORDS = {  # each reason as a person reads it (dashboard, findings)
    "gpu_idle": "idle",
    "applications_clocks_setting": "application clocks setting",
    "sw_power_cap": "power cap",
    "hw_slowdown": "hardware slowdown",
    "sync_boost": "sync boost",
    "sw_thermal_slowdown": "thermal slowdown",
    "hw_thermal_slowdown": "hardware thermal slowdown",
    "hw_power_brake_slowdown": "power brake",
    "display_clock_setting": "display clock setting",
}


def clock_event_words(mask: float) -> list[str]:
    """The clock-event (throttle) reasons a DCGM_FI_DEV_CLOCKS_EVENT_REASONS bitmask holds, in
    words ("power cap", "thermal slowdown"), for people: the stored value stays the bitmask."""
    return [CLOCK_EVENT_REASON_WORDS[name] for bit, name in CLOCK_EVENT_REASON_BITS.items() if int(mask) & bit]


# Fault counters beyond the GPU core (counts since the driver loaded, unless said), DCGM's field names: what
# wears out before a GPU or its links fail outright, read once per node (rankwatch/agent/faults.py)
PCIE_REPLAY_COUNTER = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"  # PCIe transfers the link had to replay
PCIE_LINK_GEN = "DCGM_FI_DEV_PCIE_LINK_GEN"  # the PCIe link's generation now (it falls back on a bad link)
PCIE_LINK_WIDTH = "DCGM_FI_DEV_PCIE_LINK_WIDTH"  # and its lanes now
NVLINK_CRC_FLIT_ERRORS = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"  # all links together
NVLINK_CRC_DATA_ERRORS = "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"
NVLINK_REPLAY_ERRORS = "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"
NVLINK_RECOVERY_ERRORS = "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"
REMAPPED_ROWS_CORRECTABLE = "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"  # memory rows remapped over the GPU's life
REMAPPED_ROWS_UNCORRECTABLE = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"  # 1 where a row could not be remapped: the GPU needs service
MEMORY_TEMP_C = "DCGM_FI_DEV_MEMORY_TEMP"  # the GPU memory's (HBM's) temperature
# InfiniBand port counters (/sys/class/infiniband/<device>/ports/<port>/counters, named as there), one series
# per port (IB_PORT), read once per host: no DCGM field has them
IB_SYMBOL_ERRORS = "rankwatch.ib.symbol_error"
IB_LINK_DOWNED = "rankwatch.ib.link_downed"
IB_RCV_ERRORS = "rankwatch.ib.port_rcv_errors"
IB_XMIT_DISCARDS = "rankwatch.ib.port_xmit_discards"
IB_PORT = "rankwatch.ib.port"  # data point attribute: "<device>/<port>", e.g. "mlx5_0/1"

# Host metric names (no DCGM field): OpenTelemetry's hardware semantic conventions.
HOST_ENERGY_J = "hw.energy"  # J since the agent started reading, per RAPL zone
HOST_POWER_W = "hw.power"  # W, averaged since the previous reading

# The rank's process and its host (rankwatch/agent/host.py), what a step's compute time depends on outside the GPU:
# OpenTelemetry's process and system conventions, and Linux's pressure stall information (PSI) as the
# share of time some task on the host waited for the CPU, for memory or for I/O since the last reading.
PROCESS_CPU_UTIL = "process.cpu.utilization"  # the rank's CPU time per second, per CPU it may run on
SYSTEM_MEMORY_UTIL = "system.memory.utilization"  # the host's memory in use (not available), a fraction
PRESSURE_CPU = "rankwatch.host.pressure.cpu"
PRESSURE_MEMORY = "rankwatch.host.pressure.memory"
PRESSURE_IO = "rankwatch.host.pressure.io"
PROCESS_READ_BPS = "rankwatch.process.read_bytes_per_s"  # the rank's storage reads (page cache misses), bytes/s
PROCESS_WRITE_BPS = "rankwatch.process.write_bytes_per_s"  # and the writes it caused to storage
PROCESS_MAJOR_FAULTS = "rankwatch.process.major_faults_per_s"  # page faults that had to read from storage
# read by one rank per host (rankwatch/agent/host.py's `host_wide`): the host's disks and the pages waiting for them
DISK_READ_BPS = "rankwatch.host.disk.read_bytes_per_s"  # all disks together
DISK_WRITE_BPS = "rankwatch.host.disk.write_bytes_per_s"
DISK_BUSY = "rankwatch.host.disk.busy"  # the busiest disk's share of time with I/O in flight
MEMORY_DIRTY_BYTES = "rankwatch.host.memory.dirty_bytes"  # written pages not yet on disk
MEMORY_WRITEBACK_BYTES = "rankwatch.host.memory.writeback_bytes"  # being written now
HOST_WIDE_METRICS = frozenset(
    {
        DISK_READ_BPS,
        DISK_WRITE_BPS,
        DISK_BUSY,
        MEMORY_DIRTY_BYTES,
        MEMORY_WRITEBACK_BYTES,
        IB_SYMBOL_ERRORS,  # and its InfiniBand ports (rankwatch/agent/faults.py)
        IB_LINK_DOWNED,
        IB_RCV_ERRORS,
        IB_XMIT_DISCARDS,
    }
)  # the collector gives each to every rank of the host that read it

# Rollbacks (trainer/rollback.py): a command from the collector, carried out by every rank.
EVENT_ROLLBACK = "rollback"  # the state went back to a checkpoint, with what follows
EVENT_STOPPED = "training_stopped"  # the job stopped itself (rollback budget spent), with why
EVENT_IMPORTED = "trace_imported"  # written by `rankwatch import`: the run is a trace recorded elsewhere
IMPORT_FORMAT = "rankwatch.import.format"  # on trace_imported: kineto, flight-recorder or ops
IMPORTED_AT = "rankwatch.import.at"  # on trace_imported: when it was imported (ISO 8601, UTC)
EVENT_ENDED = "ended"  # the rank's training loop ended: what follows (a last checkpoint, teardown) is no stall
ROLLBACK_RESTORED_STEP = "rankwatch.rollback.restored_step"
ROLLBACK_SKIPPED_BATCHES = "rankwatch.rollback.skipped_batches"
ROLLBACK_LR_SCALE = "rankwatch.rollback.lr_scale"
ROLLBACK_ANOMALY = "rankwatch.rollback.anomaly"
ROLLBACK_LATENCY_S = "rankwatch.rollback.latency_s"  # from the command's creation to training going on
STOP_WHY = "rankwatch.stop.why"


def json_path(name: str) -> str:
    """The SQL literal of the JSON path to attribute `name` in an `attrs` column, quoted because the
    names contain dots: `attrs->>{json_path(PHASE)}` is `attrs->>'$."rankwatch.phase"'`."""
    if any(c in name for c in "'\"\\"):
        raise ValueError(f"no JSON path is built for a name with quotes or backslashes: {name!r}")
    return f"""'$."{name}"'"""
