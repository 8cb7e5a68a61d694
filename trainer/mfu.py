"""Model FLOPs utilisation: 6 x params x tokens / step time / peak FLOP/s.

Peak comes from the GPU's datasheet (dense BF16 tensor-core FLOP/s) when the
device is known, else from a short matmul calibration on this machine.
"""

import time

import torch

PEAK_FLOPS = {  # dense BF16, per GPU
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "V100": 125e12,
}


def peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of `device`: the datasheet figure, or a measured CPU matmul rate."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_FLOPS.items():
            if key in name:
                return flops
    return measure_matmul_flops()


def measure_matmul_flops(n: int = 512, seconds: float = 0.1) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start)


def mfu(params: int, tokens: int, step_seconds: float, peak: float) -> float:
    return 6 * params * tokens / step_seconds / peak if step_seconds > 0 else 0.0
