"""Which GPU a rank gets: NVML's when the driver answers, else a simulated one where asked for
(`--simulate-gpu`), else none: a job on CPUs has no GPU telemetry to invent.

Apart from rankwatch/agent/devices.py, the contract that rankwatch/agent/nvml.py and rankwatch/agent/simdevice.py
build on, so that the contract imports neither.
"""

import logging
from collections.abc import Callable

from rankwatch.agent.devices import Device

log = logging.getLogger("rankwatch.agent")


def open_device(
    local_index: int, utilization: Callable[[], float] | None = None, simulate: bool = False
) -> Device | None:
    """This rank's GPU through NVML when the driver answers and has a GPU at `local_index` (in
    CUDA_VISIBLE_DEVICES order); else, with `simulate`, a simulated one driven by `utilization` (0..1); else
    None. Logs which, and why."""
    import pynvml  # on first use, as before: importing the agent loads no NVML binding

    from rankwatch.agent.nvml import NvmlDevice
    from rankwatch.agent.simdevice import SimulatedDevice

    try:
        device = NvmlDevice(local_index)
        log.info("rankwatch: device telemetry from NVML, GPU %d", device.index)
        return device
    except (pynvml.NVMLError, IndexError, ValueError) as e:
        why = f"no NVML GPU for local rank {local_index} ({type(e).__name__}: {e})"
    if simulate:
        log.info("rankwatch: %s; device telemetry is simulated", why)
        return SimulatedDevice(local_index, utilization=utilization)
    log.info("rankwatch: %s; no GPU telemetry (--simulate-gpu simulates one)", why)
    return None
