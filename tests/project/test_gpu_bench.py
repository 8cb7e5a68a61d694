"""bench/gpu.py where no GPU is needed: its profiler-side split of a step, and its refusal without CUDA.

Covered: on real Kineto traces of NCCL jobs (tests/data/kineto/), each
ProfilerStep's span on the GPU, compute (time some compute kernel runs), NCCL kernel time and
exposed NCCL time (no compute kernel running) match a count on a 1 µs grid, kernels tied to the
step that launched them; without CUDA the bench exits 2 with one line saying CUDA is required.
"""

import gzip
import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.support.kineto import kernels_by_step
from tests.support.paths import ROOT

DATA = ROOT / "tests" / "data" / "kineto"


def bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grid_split(doc: dict) -> dict[int, dict[str, float]]:
    """Per step, on the trace's 1 µs grid: its GPU span (first to last of its kernels and copies),
    compute kernels' union, NCCL kernels' sum, and NCCL
    time with no compute kernel running; a kernel belongs to the step its launch falls in."""
    windows, launched, kernels, origin, size = kernels_by_step(doc)
    copies = [e for e in doc["traceEvents"] if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    split = {}
    for step, start, end in windows:
        mine = [e for e in kernels if start <= launched[e["args"]["correlation"]] <= end]
        gpu = [e for e in copies if start <= launched.get(e["args"]["correlation"], -1) <= end] + mine
        busy, comm = np.zeros(size, bool), np.zeros(size, bool)
        for e in mine:
            (comm if e["name"].startswith("ncclKernel") else busy)[
                int(e["ts"]) - origin : int(e["ts"] + e["dur"]) - origin
            ] = True
        split[step] = {
            "step": (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) / 1e6,
            "compute": busy.sum() / 1e6,
            "exposed": (comm & ~busy).sum() / 1e6,
            "comm": sum(e["dur"] for e in mine if e["name"].startswith("ncclKernel")) / 1e6,
        }
    return split


# the sampled traces' times are whole µs; nccl_data's have fractions the grid rounds off (a µs a few kernels)
@pytest.mark.parametrize(
    "name, tolerance",
    [("sampled_rank-0.json.gz", 1e-9), ("sampled_rank-1.json.gz", 1e-9), ("nccl_data.json.gz", 20e-6)],
)
def test_profiler_split_matches_the_kernels_on_a_grid(name, tolerance):
    with gzip.open(DATA / name) as f:
        expected = grid_split(json.load(f))
    split = bench_gpu().profiler_split(DATA / name)
    assert sorted(split) == sorted(expected)
    for step, values in expected.items():
        assert split[step] == pytest.approx(values, abs=tolerance), step
    assert any(v["comm"] > 0 for v in split.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_exits_2_in_one_line():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "bench/gpu.py: CUDA is required: torch sees no GPU on this machine"
