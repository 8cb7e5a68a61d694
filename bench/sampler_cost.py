"""CPU cost of one device sample: the sampler reading the simulated GPU, with the metrics it
read before GPU memory, ECC, XID, NVLink and PCIe were added (A) and with all of them (B).

The two readers alternate in rounds on one thread; each figure is the median over rounds of
the thread's CPU time per `Sampler._read_all` (the sampling thread's whole job: read, stamp,
keep the energy counter). At 10 Hz, a sample's cost x 10 is the sampler's share of one core.

Usage: python bench/sampler_cost.py [--rounds 9] [--samples 20000]
"""

import argparse
import statistics
import time

from rankwatch.agent import semconv as sc
from rankwatch.agent.sampler import Sampler
from rankwatch.agent.simdevice import SimulatedDevice

BEFORE = {
    sc.POWER_INSTANT_W,
    sc.ENERGY_J,
    sc.SM_CLOCK_MHZ,
    sc.MEM_CLOCK_MHZ,
    sc.GPU_TEMP_C,
    sc.GPU_UTIL_PCT,
    sc.POWER_LIMIT_W,
    sc.POWER_LIMIT_MIN_W,
    sc.POWER_LIMIT_MAX_W,
    sc.CLOCK_EVENT_REASONS,
}


class Before(SimulatedDevice):
    """The simulated GPU as it read before: the same model, the ten earlier metrics."""

    def _read(self):
        return [reading for reading in super()._read() if reading[0] in BEFORE]


def per_sample_us(sampler: Sampler, samples: int) -> float:
    started = time.thread_time_ns()
    for _ in range(samples):
        sampler._read_all()
    return (time.thread_time_ns() - started) / samples / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--samples", type=int, default=20000)
    args = parser.parse_args()
    samplers = {
        name: Sampler([cls(0, utilization=lambda: 0.7)], lambda batch: True)
        for name, cls in (("A: before", Before), ("B: all metrics", SimulatedDevice))
    }
    times: dict[str, list[float]] = {name: [] for name in samplers}
    for i in range(args.rounds):
        for name in list(samplers) if i % 2 == 0 else list(samplers)[::-1]:
            times[name].append(per_sample_us(samplers[name], args.samples))
    for name, sampler in samplers.items():
        median = statistics.median(times[name])
        print(
            f"{name:16} {len(sampler._read_all()):3d} points/sample  {median:6.1f} us CPU/sample  "
            f"{median * 10 / 1e4:.4f}% of a core at 10 Hz"
        )
    a, b = (statistics.median(t) for t in times.values())
    print(f"B / A: {b / a:.2f}x CPU per sample")


if __name__ == "__main__":
    main()
