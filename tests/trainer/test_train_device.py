"""Which device a job trains on: a GPU per rank or the CPU, never several NCCL ranks on one GPU.
The choice is a pure function of the ranks and the GPUs (tested for machines this one is not);
`rankwatch train --device cuda` without a GPU per rank is refused before anything starts."""

import pytest
import torch

from tests.support.commands import rankwatch_cli
from trainer.device import DeviceError, choose


@pytest.mark.parametrize(
    "requested, ranks, gpus, device",
    [
        ("auto", 4, 0, "cpu"),
        ("auto", 4, 4, "cuda"),
        ("auto", 2, 8, "cuda"),
        ("auto", 4, 1, "cpu"),
        ("cpu", 2, 8, "cpu"),
        ("cuda", 1, 1, "cuda"),
        ("cuda", 8, 8, "cuda"),
    ],
)
def test_ranks_get_a_gpu_each_or_the_cpu(requested, ranks, gpus, device):
    assert choose(requested, ranks, gpus)[0] == device


def test_auto_says_in_one_line_why_gpus_are_left_unused():
    device, notice = choose("auto", 4, 1)
    assert device == "cpu" and "\n" not in notice and "4 ranks on 1 GPU" in notice and "--nproc 1" in notice
    assert choose("auto", 4, 0)[1] is None  # a machine without GPUs needs no excuse


@pytest.mark.parametrize("ranks, gpus", [(2, 0), (4, 1), (8, 7)])
def test_cuda_without_a_gpu_per_rank_is_refused(ranks, gpus):
    with pytest.raises(DeviceError, match=f"{ranks} ranks on this machine, {gpus} GPU"):
        choose("cuda", ranks, gpus)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has a GPU for each of 2 ranks")
def test_train_refuses_cuda_without_a_gpu_per_rank_in_one_line():
    result = rankwatch_cli("train", "--nproc", "2", "--steps", "1", "--device", "cuda")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"rankwatch: error: --device cuda needs a GPU for every rank: 2 ranks on this "
        f"machine, {torch.cuda.device_count()} GPU"
        f"{'s' if torch.cuda.device_count() != 1 else ''}"
    )
