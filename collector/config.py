"""How a collector is started: `Config`, each default set here alone with its one-line doc, which `rankwatch
collector --help` prints (rankwatch/cli/options.py). A module of its own, light, so that the writer's tasks carry
it across to the writer process (collector/writertasks.py) without the server coming with it."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from collector.alerts.config import AlertConfig
from collector.control.commands import ROLLBACK_ON
from collector.metrics.runs import MAX_RUNS
from collector.store.lake import Lake
from collector.store.upkeep import Upkeep
from collector.store.writer import MEMORY_HEADROOM
from rankwatch.agent.config import ANALYZE_EVERY_S, HANG_FLOOR_S, MIN_TOKEN_CHARS, OTLP_PORT
from rankwatch.agent.paths import DEFAULT_DB

if TYPE_CHECKING:
    from collector.predict.stepmodel import Fitted


@dataclass
class Config:
    """How a collector is started. Each default, the newcomer's, is set here alone, with its one-line doc
    (metadata "doc"): `rankwatch collector --help` prints both, and the command line sets only the options given."""

    db: Path = field(default=DEFAULT_DB, metadata={"doc": "the store file; the token and alerts files beside it"})
    host: str = field(
        default="127.0.0.1",
        metadata={"doc": "the address to listen on; loopback admits this machine's processes alone"},
    )
    port: int = field(default=OTLP_PORT, metadata={"doc": "the port to listen on"})
    token: str | None = field(
        default=None,
        metadata={
            "doc": f"the bearer token, {MIN_TOKEN_CHARS} characters at least; unset: the token file beside the store, "
            "made on first start"
        },
    )
    workers: int | None = field(
        default=None, metadata={"doc": "decode processes; unset: one per core, 0: none (decoding in a thread)"}
    )
    max_queue_bytes: int = field(
        default=128 * 2**20,
        metadata={"doc": "request bytes (decompressed) waiting for commit before exports get 503 + Retry-After"},
    )
    max_reading_bytes: int = field(
        default=64 * 2**20,
        metadata={
            "doc": "request body bytes being read, all connections together, before exports get 503 + Retry-After"
        },
    )
    writer_memory: int = field(
        default=MEMORY_HEADROOM,
        metadata={
            "doc": "memory the writer process (commits, analysis, queries) may take past what it maps at start; past "
            "it a query gets 400 and a commit 503: raise it for jobs of tens of thousands of ranks"
        },
    )
    body_timeout_s: float = field(
        default=60.0, metadata={"doc": "the longest an export's body may take to arrive (408 after)"}
    )
    header_timeout_s: float = field(
        default=10.0, metadata={"doc": "a connection that has not sent its request headers this long is closed"}
    )
    max_connections: int = field(
        default=4096,
        metadata={
            "doc": "open connections (fewer where file descriptors are fewer); past it the one waiting longest for "
            "its headers is closed"
        },
    )
    analyze_every_s: float = field(
        default=ANALYZE_EVERY_S, metadata={"doc": "how often the analyzers look at the runs that are sending"}
    )
    hang_after_s: float = field(
        default=HANG_FLOOR_S, metadata={"doc": "the shortest stall reported as a hang; slower steps stretch it"}
    )
    rollback_on: frozenset[str] = field(
        default=ROLLBACK_ON, metadata={"doc": "the anomalies that become a rollback for the job"}
    )
    power_every_s: float = field(
        default=60.0,
        metadata={
            "doc": "how often power-cap recommendations are redrawn for the runs whose GPUs report power; 0: never"
        },
    )
    metrics_runs: int = field(
        default=MAX_RUNS, metadata={"doc": "active runs with /metrics series of their own; the rest counted as one"}
    )
    alerts: AlertConfig = field(
        default=AlertConfig(), metadata={"doc": "alert receivers (the receivers file, collector/alerts/config.py)"}
    )
    lake: Lake | None = field(
        default=None, metadata={"doc": "store into this lake (collector/store/lake.py), shared with other collectors"}
    )
    upkeep: Upkeep = field(
        default_factory=Upkeep, metadata={"doc": "a lake's compaction and retention (collector/store/upkeep.py)"}
    )
    model: "Fitted | None" = field(
        default=None, metadata={"doc": "the step-time model (`rankwatch model fit`): explained stragglers, slow jobs"}
    )
