"""Which GPU a rank gets: NVML's when the driver answers, else a simulated one.

Apart from agent/devices.py, the contract that agent/nvml.py and agent/simdevice.py
build on, so that the contract imports neither.
"""

from collections.abc import Callable

from agent.devices import Device
from agent.export import log


def open_device(local_index: int, utilization: Callable[[], float] | None = None) -> Device:
    """This rank's GPU through NVML when the driver answers and has a GPU at `local_index` (in
    CUDA_VISIBLE_DEVICES order), else a simulated one driven by `utilization` (0..1); logs
    which, and why."""
    import pynvml  # on first use, as before: importing the agent loads no NVML binding

    from agent.nvml import NvmlDevice
    from agent.simdevice import SimulatedDevice

    try:
        device = NvmlDevice(local_index)
        log.info("rankwatch: device telemetry from NVML, GPU %d", device.index)
        return device
    except (pynvml.NVMLError, IndexError, ValueError) as e:
        log.info(
            "rankwatch: no NVML GPU for local rank %d (%s: %s); device telemetry is simulated",
            local_index,
            type(e).__name__,
            e,
        )
        return SimulatedDevice(local_index, utilization=utilization)
