"""The simulated nodes' fault counters, PCIe links and memory temperatures, read as the agent reads them (every
FAULTS_EVERY_S, rankwatch/agent/faults.py), and their wear (trainer/faults.py's WEAR_KINDS): a counter, link or
temperature of a node's first GPU or InfiniBand port that drifts away from its peers', faster and faster, before
the node fails (its ranks compute slower from the fault's `fail` step on).

Healthy GPUs and ports are not alike, nor silent: each GPU runs a little warmer or cooler than the next (where
it sits), a GPU or port errs now and then (a PCIe replay, an NVLink CRC error, a symbol error every 8 to 30
minutes), some ports err more all along, and now and then a burst of errors comes and goes. The readings
draw from generators of their own: the timing draws are the same with or without them.
"""

import numpy as np
import pandas as pd

from rankwatch.agent import semconv as sc
from rankwatch.agent.faults import FAULTS_EVERY_S
from trainer.faults import WEAR_KINDS, Fault

RAMP_STEPS = 400  # steps a wear without `fail` takes to reach its full rate
SLOWDOWN = 1.3  # a failing node's ranks compute this much longer, unless its fault says
IB_PORTS = 2  # InfiniBand ports per host, read by the host's first rank, one series a port
PCIE_GEN, PCIE_WIDTH = 5, 16  # an H100 SXM's PCIe link, healthy
MEMORY_ABOVE_C = 8.0  # HBM runs this much hotter than the GPU's core
# errors of a healthy GPU or port, per second (one every 8 to 30 minutes)
QUIET = {sc.PCIE_REPLAY_COUNTER: 0.0005, sc.NVLINK_CRC_FLIT_ERRORS: 0.001, sc.IB_SYMBOL_ERRORS: 0.002}
# a wearing counter's rate at `fail`, per second; it starts GROWTH times lower and grows exponentially (a port
# that flaps errs between its downs too)
PEAK = {
    "pcie-replays": {sc.PCIE_REPLAY_COUNTER: 5.0},
    "nvlink-crc": {sc.NVLINK_CRC_FLIT_ERRORS: 20.0},
    "ib-flap": {sc.IB_SYMBOL_ERRORS: 10.0, sc.IB_LINK_DOWNED: 0.05},
}
GROWTH = 400.0
SYMBOLS_PER_FLAP = 30  # symbol errors a port going down and up brings
HOTTER_C = 25.0  # a wearing GPU's core is this much hotter at `fail`, its memory 1.2 times as much
PLACED_C = 1.5  # the spread of healthy GPUs' temperatures, each its own all along (where it sits)
NOISY_PORTS, NOISY = 0.15, 20.0  # the share of ports that err this many times more than QUIET all along
BURSTS_PER_HOUR, BURST = 0.2, 200  # bursts of about BURST errors of a GPU's or port's counter: one-offs


def placed_c(n: int, seed: int = 0) -> np.ndarray:
    """Each of `n` GPUs' temperature above the fleet's usual, all along (where it sits): from a generator of its
    own."""
    return np.random.default_rng([seed, 0x7E4]).normal(0.0, PLACED_C, n)


def wear(fault: Fault, step: int) -> float:
    """How far a wear has gone at `step`: 0 before it starts, 1 at its `fail` step (else RAMP_STEPS after it
    starts), and on beyond."""
    start = int(fault.get("from", 0))
    if step < start:
        return 0.0
    return (step - start) / (int(fault.get("fail")) - start if fault.get("fail") is not None else RAMP_STEPS)


def failing(fault: Fault, step: int) -> bool:
    return fault.get("fail") is not None and step >= int(fault.get("fail"))


def _worn(faults: list[Fault]) -> list[Fault]:
    return [f for f in faults if f.kind in WEAR_KINDS]


def _rate(fault: Fault) -> float:
    """How hard a wear goes: its rates, creep and narrow link's odds, times this."""
    return float(fault.get("rate", 1.0))


def slowdowns(faults: list[Fault], hosts: np.ndarray, step: int) -> np.ndarray:
    """Each rank's compute multiplier at `step` (`hosts`: each rank's host): a failing node's ranks are slower."""
    factor = np.ones(len(hosts))
    for f in _worn(faults):
        if failing(f, step):
            factor[hosts == f.get("node")] *= float(f.get("slowdown", SLOWDOWN))
    return factor


def hotter_c(faults: list[Fault], ranks_per_host: int, n: int, step: int) -> np.ndarray:
    """Each rank's GPU core above its usual temperature at `step`: a wearing GPU creeps up."""
    hotter = np.zeros(n)
    for f in _worn(faults):
        gpu = int(f.get("node")) * ranks_per_host
        if f.kind == "hot-gpu" and gpu < n:
            hotter[gpu] += HOTTER_C * _rate(f) * wear(f, step)
    return hotter


NONE_DUE = pd.DataFrame(columns=["rank", "ts", "metric", "value", "gpu", "port"])


class Readings:
    """The node health readings of a simulated job's steps, one frame at a time (`of`): every FAULTS_EVERY_S of
    simulated time, each GPU's PCIe replays, link generation and width, NVLink CRC errors and memory
    temperature (on its rank), and each host's InfiniBand ports' symbol errors and downs (on its first rank)."""

    def __init__(self, ranks: int, ranks_per_host: int, faults: list[Fault], seed: int = 0):
        self.ranks, self.per_host, self.faults = ranks, ranks_per_host, _worn(faults)
        self.rng = np.random.default_rng([seed, 0x4EA1])  # a stream of its own
        self.ports = np.arange(0, ranks, ranks_per_host).repeat(IB_PORTS)  # each port's rank
        self.noisy = np.where(self.rng.random(len(self.ports)) < NOISY_PORTS, NOISY, 1.0)
        self.counts = {
            sc.PCIE_REPLAY_COUNTER: np.zeros(ranks),
            sc.NVLINK_CRC_FLIT_ERRORS: np.zeros(ranks),
            sc.IB_SYMBOL_ERRORS: np.zeros(len(self.ports)),
            sc.IB_LINK_DOWNED: np.zeros(len(self.ports)),
        }
        self.last_ns: int | None = None

    def of(self, frame: pd.DataFrame) -> pd.DataFrame:
        """The readings due by the end of this step frame (rank, ts, metric, value, gpu, port): none between
        two readings."""
        step, now = int(frame["step"].iloc[0]), int(frame["end_ns"].iloc[0])
        if self.last_ns is not None and now - self.last_ns < FAULTS_EVERY_S * 1e9:
            return NONE_DUE
        elapsed_s = FAULTS_EVERY_S if self.last_ns is None else (now - self.last_ns) / 1e9
        self.last_ns = now
        gpus, ports = np.arange(self.ranks), np.arange(len(self.ports))
        rate = {m: np.full(len(ports if m == sc.IB_SYMBOL_ERRORS else gpus), r) for m, r in QUIET.items()}
        rate[sc.IB_SYMBOL_ERRORS] *= self.noisy
        rate[sc.IB_LINK_DOWNED] = np.zeros(len(ports))
        width = np.full(self.ranks, float(PCIE_WIDTH))
        memory = frame["temp_c"].to_numpy() + MEMORY_ABOVE_C + self.rng.normal(0.0, 0.5, self.ranks)
        for f in self.faults:
            gpu, port, worn = int(f.get("node")) * self.per_host, int(f.get("node")) * IB_PORTS, wear(f, step)
            if gpu >= self.ranks or worn <= 0:
                continue
            growing = _rate(f) * GROWTH ** (min(worn, 1.5) - 1)
            for metric, peak in PEAK.get(f.kind, {}).items():
                rate[metric][port if metric in (sc.IB_SYMBOL_ERRORS, sc.IB_LINK_DOWNED) else gpu] += peak * growing
            if f.kind == "pcie-width":  # trained down, at times back to x16 while it still can
                narrow = failing(f, step) or self.rng.random() < min(_rate(f) * (0.5 + worn / 2), 1.0)
                width[gpu] = PCIE_WIDTH / 4 if failing(f, step) else PCIE_WIDTH / 2 if narrow else PCIE_WIDTH
            elif f.kind == "hot-gpu":
                memory[gpu] += 0.2 * HOTTER_C * _rate(f) * worn  # the core's creep is in temp_c already
        flaps = self.rng.poisson(rate[sc.IB_LINK_DOWNED] * elapsed_s)
        self.counts[sc.IB_LINK_DOWNED] += flaps
        self.counts[sc.IB_SYMBOL_ERRORS] += self.rng.poisson(SYMBOLS_PER_FLAP * flaps)
        for metric in QUIET:
            self.counts[metric] += self.rng.poisson(rate[metric] * elapsed_s)
            bursts = self.rng.random(len(rate[metric])) < BURSTS_PER_HOUR * elapsed_s / 3600
            self.counts[metric] += np.where(bursts, self.rng.poisson(BURST, len(bursts)), 0)
        per_gpu = {
            sc.PCIE_REPLAY_COUNTER: self.counts[sc.PCIE_REPLAY_COUNTER],
            sc.NVLINK_CRC_FLIT_ERRORS: self.counts[sc.NVLINK_CRC_FLIT_ERRORS],
            sc.PCIE_LINK_GEN: np.full(self.ranks, float(PCIE_GEN)),
            sc.PCIE_LINK_WIDTH: width,
            sc.MEMORY_TEMP_C: memory,
        }
        per_port = {m: self.counts[m] for m in (sc.IB_SYMBOL_ERRORS, sc.IB_LINK_DOWNED)}
        names = np.array([f"mlx5_{p}/1" for p in range(IB_PORTS)], dtype=object)[ports % IB_PORTS]
        n, m = len(per_gpu), len(per_port)
        return pd.DataFrame(
            {
                "rank": np.concatenate([np.tile(gpus, n), np.tile(self.ports, m)]),
                "ts": now,
                "metric": np.repeat([*per_gpu, *per_port], [self.ranks] * n + [len(ports)] * m),
                "value": np.concatenate([*per_gpu.values(), *per_port.values()]),  # (a copy: counts go on)
                "gpu": np.concatenate([np.tile(gpus % self.per_host, n), np.full(len(ports) * m, np.nan)]),
                "port": np.concatenate([np.full(self.ranks * n, None, dtype=object), np.tile(names, m)]),
            }
        )
