"""Fault injection: one grammar for the trainer and the fleet simulator.

straggler:rank=2,slowdown=1.3,from=40[,to=90]   a rank's compute runs `slowdown` times longer
slow-node:node=3,slowdown=1.2,from=40           the ranks of a host (simulator)
hang:rank=1,at=200[,seconds=S]                   a rank stops (forever, or for S seconds)
spike:at=120,scale=8                             the loss of one step is scaled (a loss spike)
nan:at=150                                       the loss of one step is NaN
crash:rank=1,at=50                               a rank's process exits with an error (torchrun's first
                                                 attempt only: a restart resumes from a checkpoint)
thermal:rank=3,from=60                           a GPU throttles (clocks down, slower)
slow-link:rank=5,factor=2[,from=0][,group=tp]    a rank's collectives take `factor` times longer (the trainer:
                                                 DDP's all-reduces, or with group=tp its tensor-parallel ones)
slow-stage:stage=3,slowdown=1.2                  a pipeline stage's compute is slower
data-skew:cv=0.3                                 per-step work varies (sequence lengths)
power-cap:watts=500[,rank=3][,from=20,to=40]     GPUs run under a power limit, all or one (simulator)
slow-disk:rank=1,mbps=50[,from=20][,to=40]       a rank's swaps to disk get `mbps` MB/s (the trainer's --offload)

A node that wears out (simulator; trainer/nodehealth.py): from `from` on, a fault counter, link or temperature of
the node's first GPU (or InfiniBand port) drifts away from its peers', faster and faster; from step `fail` on (if
given) the node's ranks also compute `slowdown` times longer (default 1.3); `rate` says how hard it wears (its
error rates, its temperature's creep, how often its link is narrow: times this, default 1):
pcie-replays:node=2,from=40[,fail=400][,slowdown=1.3][,rate=1]   its PCIe link replays more and more transfers
nvlink-crc:node=2,from=40[,fail=400]                    its NVLink CRC errors rise
pcie-width:node=2,from=40[,fail=400]                    its PCIe link trains down to x8 (x16 at times), x4 at `fail`
hot-gpu:node=2,from=40[,fail=400]                       the GPU and its memory (HBM) run hotter and hotter
ib-flap:node=2,from=40[,fail=400]                       an InfiniBand port goes down and up, more and more often
"""

import math
from dataclasses import dataclass

_KEYS: dict[str, dict[str, tuple[type[int] | type[float] | type[str], bool]]] = {  # kind -> {key: (type, required)}
    "straggler": {"rank": (int, True), "slowdown": (float, True), "from": (int, False), "to": (int, False)},
    "hang": {"rank": (int, True), "at": (int, True), "seconds": (float, False)},
    "spike": {"at": (int, True), "scale": (float, True)},
    "nan": {"at": (int, True)},
    "crash": {"rank": (int, True), "at": (int, True)},
    "slow-node": {"node": (int, True), "slowdown": (float, True), "from": (int, False), "to": (int, False)},
    "thermal": {"rank": (int, True), "from": (int, False), "to": (int, False)},
    "slow-link": {
        "rank": (int, True),
        "factor": (float, True),
        "from": (int, False),
        "to": (int, False),
        "group": (str, False),
    },
    "slow-stage": {"stage": (int, True), "slowdown": (float, True), "from": (int, False), "to": (int, False)},
    "data-skew": {"cv": (float, True), "from": (int, False), "to": (int, False)},
    "power-cap": {"watts": (float, True), "rank": (int, False), "from": (int, False), "to": (int, False)},
    "slow-disk": {"rank": (int, True), "mbps": (float, True), "from": (int, False), "to": (int, False)},
}
# a node that wears out, then fails: the kinds share their keys
WEAR_KINDS = ("pcie-replays", "nvlink-crc", "pcie-width", "hot-gpu", "ib-flap")
_KEYS.update(
    {
        kind: {
            "node": (int, True),
            "from": (int, False),
            "fail": (int, False),
            "slowdown": (float, False),
            "rate": (float, False),
        }
        for kind in WEAR_KINDS
    }
)


_CHOICES = {"group": ("tp",)}  # the values a word may take: the process groups whose link the trainer slows
# the least each value may be, and whether it may equal it: a slowdown below 1 would be a speed-up
_LEAST = {
    "rank": (0, True),
    "node": (0, True),
    "stage": (0, True),
    "at": (0, True),
    "from": (0, True),
    "to": (0, False),
    "fail": (0, False),
    "slowdown": (1.0, True),
    "factor": (1.0, True),
    "scale": (0.0, False),
    "cv": (0.0, True),
    "seconds": (0.0, False),
    "watts": (0.0, False),
    "mbps": (0.0, False),
    "rate": (0.0, False),
}

# the rest need the fleet simulator; slow-stage a pipeline-parallel job (rankwatch train --pp), slow-disk
# one that swaps to disk (--offload optimizer=disk)
TRAINER_KINDS = ("straggler", "hang", "spike", "nan", "slow-link", "crash", "slow-stage", "slow-disk")


@dataclass(frozen=True)
class Fault:
    """One injected fault; `active(step)` says whether it applies at a step."""

    kind: str
    spec: str
    params: tuple[tuple[str, float | int | str], ...]

    def get(self, key: str, default=None):
        return dict(self.params).get(key, default)

    @property
    def rank(self) -> int | None:
        return self.get("rank")

    def active(self, step: int) -> bool:
        if "at" in dict(self.params):
            return step == self.get("at")
        return self.get("from", 0) <= step and (self.get("to") is None or step < self.get("to"))


def parse(spec: str, kinds: tuple[str, ...] = tuple(_KEYS)) -> Fault:
    """A fault from its spec; ValueError with a one-line reason when it is malformed or not
    one of `kinds` (what the injecting program can do)."""
    kind, _, rest = spec.strip().partition(":")
    if kind not in _KEYS:
        raise ValueError(f"unknown fault {kind!r} in {spec!r}; known: {', '.join(_KEYS)}")
    allowed = _KEYS[kind]
    params: dict[str, float | int | str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in allowed:
            raise ValueError(f"{spec!r}: {kind} takes {', '.join(allowed)}; got {item!r}")
        if key in params:
            raise ValueError(f"{spec!r}: {key} given twice")
        try:
            params[key] = allowed[key][0](raw)
        except ValueError:
            raise ValueError(f"{spec!r}: {key} must be {allowed[key][0].__name__}, got {raw!r}") from None
    for key, value in params.items():
        if isinstance(value, str):
            if value not in _CHOICES[key]:
                raise ValueError(f"{spec!r}: {key} must be one of {', '.join(_CHOICES[key])}, got {value!r}")
            continue
        least, inclusive = _LEAST[key]
        if not math.isfinite(value) or not (value >= least if inclusive else value > least):
            raise ValueError(
                f"{spec!r}: {key} must be {'at least' if inclusive else 'more than'} {least:g}, got {value:g}"
            )
    for later in ("to", "fail"):
        if later in params and float(params[later]) <= float(params.get("from", 0)):
            raise ValueError(f"{spec!r}: {later} must come after from")
    missing = [k for k, (_, required) in allowed.items() if required and k not in params]
    if missing:
        raise ValueError(f"{spec!r}: {kind} needs {', '.join(missing)}")
    if kind not in kinds:
        raise ValueError(f"{spec!r}: the trainer injects {', '.join(kinds)}; {kind} is for `rankwatch simulate`")
    return Fault(kind, spec.strip(), tuple(sorted(params.items())))
