"""What a job of the reference trainer is asked for, without torch: the models it trains, what `--offload`
moves off the GPU, how often it snapshots its state, and the faults it can run. The launcher (`rankwatch
train`) checks its arguments against these before torch loads and torchrun starts a rank."""

from dataclasses import dataclass

from trainer.faults import Fault
from trainer.layout import Layout

SNAPSHOT_EVERY = 10  # steps between the snapshots in memory, by default (--snapshot-every)


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 512
    seq_len: int = 64
    layers: int = 2
    heads: int = 4
    dim: int = 128


CONFIGS = {
    "tiny": GPTConfig(),  # ~0.5M parameters: CPU tests and the demo
    "small": GPTConfig(vocab=8192, seq_len=256, layers=6, heads=8, dim=512),  # ~25M
    "gpt2": GPTConfig(vocab=50304, seq_len=1024, layers=12, heads=12, dim=768),  # ~124M
    "1b": GPTConfig(vocab=50304, seq_len=2048, layers=24, heads=16, dim=2048),  # ~1.3B: fills a GPU
}


SCHEDULES = ("serial", "overlap")


@dataclass(frozen=True)
class Spec:
    """What `--offload` moves off the GPU, and how its swaps are scheduled."""

    optimizer: str  # "host" or "disk"
    schedule: str = "serial"
    activations: bool = False  # saved activations to disk in forward, back in backward

    @classmethod
    def parse(cls, text: str, schedule: str = "serial") -> "Spec":
        """`optimizer=host|disk[,activations=disk]`; ValueError says what is wrong, in one line."""
        fields = dict(part.partition("=")[::2] for part in text.split(",") if part)
        where, activations = fields.pop("optimizer", None), fields.pop("activations", None)
        if fields or where not in ("host", "disk") or activations not in (None, "disk"):
            raise ValueError(f"--offload {text!r}: expected optimizer=host or optimizer=disk[,activations=disk]")
        if schedule not in SCHEDULES:
            raise ValueError(f"--offload-schedule {schedule!r}: expected serial or overlap")
        return cls(where, schedule, activations == "disk")

    def refuses(self, parallel: bool) -> str | None:
        """Why a job cannot run with this offload (None: it can): the reference steps a DDP job's optimizer."""
        return "--offload steps a DDP job's optimizer on the host (not with --dp, --tp or --pp)" if parallel else None

    def __str__(self) -> str:
        return f"optimizer={self.optimizer}" + (",activations=disk" if self.activations else "")


def unfit(fault: Fault, layout: Layout | None, offloaded: Spec | None = None) -> str | None:
    """Why the job cannot inject `fault` (None: it can)."""
    if fault.kind == "slow-disk" and (offloaded is None or offloaded.optimizer != "disk"):
        return "a slow disk slows the swaps of --offload optimizer=disk"
    if fault.kind == "slow-stage" and (layout is None or not fault.get("stage") < layout.pp):
        return f"the job has {layout.pp if layout else 1} pipeline stage(s) (--pp)"
    if fault.kind == "slow-link" and (fault.get("group") == "tp") != (layout is not None):
        return "a DDP job slows its gradient all-reduces (no group=), a 3D job its tensor-parallel ones (group=tp)"
    if fault.kind == "slow-link" and layout is not None and layout.tp < 2:
        return "group=tp needs tensor parallelism (--tp 2 or more)"
    return None
