"""Optimizer offload (trainer/offload.py) and what the agent records of it: the offloaded AdamW steps as
torch's does, its disk is read past the page cache and paced by a slow-disk fault, and a step's copies
between tiers become transfer spans with the time compute did not hide (a real collector)."""

import json
import os
import resource
import threading
import time
from pathlib import Path

import pytest
import torch

from rankwatch import agent
from rankwatch.agent import semconv as sc
from rankwatch.agent.session import Session
from tests.support.otlp_payloads import query
from trainer.job import SCHEDULES, Spec
from trainer.offload import ActivationsToDisk, Disk, OffloadedAdamW, groups_of, probe


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


@pytest.mark.parametrize(
    "where, schedule", [("host", "serial"), ("host", "overlap"), ("disk", "serial"), ("disk", "overlap")]
)
def test_the_offloaded_adamw_steps_as_torchs_and_its_state_round_trips(tmp_path, where, schedule):
    ours, theirs = model(), model()
    offloaded = OffloadedAdamW(groups_of(ours), Spec(where, schedule), tmp_path, lr=1e-2, weight_decay=0.1)
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    data = torch.randn(8, 16)
    try:
        for step in range(4):
            offloaded.prefetch()  # with overlap, read back while the forward computes
            for net, opt in ((ours, offloaded), (theirs, reference)):
                net(data * (step + 1)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        saved = offloaded.state_dict()
        offloaded.load_state_dict({**saved, "moments": [torch.zeros_like(m) for m in saved["moments"]]})
        offloaded.load_state_dict(saved)
        assert all(torch.equal(a, b) for a, b in zip(offloaded.state_dict()["moments"], saved["moments"], strict=True))
    finally:
        offloaded.close()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_host_step_allocates_nothing_the_size_of_a_group(tmp_path, schedule):
    """A step of separate tensor ops allocates temporaries as large as the group, whose pages are handed
    back and faulted in again at every step (above 32 MB, glibc's largest mmap threshold, always): the
    fused step allocates none."""
    layer = torch.nn.Linear(3000, 3000, bias=False)  # 36 MB of parameters: one group
    layer.weight.grad = torch.randn_like(layer.weight)
    offloaded = OffloadedAdamW([[layer.weight]], Spec("host", schedule), tmp_path, 1e-3, 0.1)
    try:
        offloaded.step()  # the first step allocates what the next reuse
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            offloaded.step()
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted
    finally:
        offloaded.close()
    pages = layer.weight.numel() * 4 // resource.getpagesize()
    assert faulted < 3 * pages / 4, f"{faulted} pages faulted in over 3 steps: a temporary of {pages} a step"


def test_groups_are_a_module_list_block_each_and_hold_each_parameter_once():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.scale = torch.nn.Parameter(torch.ones(1))

    net = Net()
    groups = groups_of(net)
    assert [len(g) for g in groups] == [1, 2, 2, 2, 1]
    assert sorted(id(p) for g in groups for p in g) == sorted(id(p) for p in net.parameters())


def _read_bytes() -> int:
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["read_bytes"])


def test_the_disk_is_read_past_the_page_cache_and_a_slow_disk_is_paced(tmp_path):
    if not Path("/proc/self/io").exists() or os.statvfs(tmp_path).f_blocks == 0:
        pytest.skip("needs Linux's per-process I/O counters and a disk-backed directory")
    block = torch.arange(1 << 20, dtype=torch.float32)  # 4 MB
    disk = Disk(tmp_path)
    try:
        disk.write("state", block)
        before, back = _read_bytes(), torch.empty_like(block)
        disk.read("state", back)
        if _read_bytes() == before:
            pytest.skip(f"{tmp_path} is not on a disk (tmpfs keeps its pages): nothing to read past")
        assert _read_bytes() - before >= block.numel() * 4 and torch.equal(back, block)
    finally:
        disk.close()
    slow = Disk(tmp_path, rate_mbps=lambda: 40.0)
    try:
        started = time.perf_counter()
        slow.write("paced", block)
        assert time.perf_counter() - started >= 4.19e6 / 40e6 * 0.99  # 4.19 MB at 40 MB/s
    finally:
        slow.close()
    read, write = probe(tmp_path, 8 << 20)
    assert read > 0 and write > 0 and not (tmp_path / "probe").exists()


def test_a_steps_copies_are_transfers_with_what_compute_did_not_hide(collector):
    """A swap worker reads state while the forward computes (hidden); the forward's own thread writes an
    activation out (it stalls: exposed); then the step writes the state back and steps the optimizer on
    the host outside compute (exposed): spans of kind transfer and host, and the step's transfer, exposed
    and host-optimizer seconds."""
    session = Session("run-tiers", 0, 1, collector.url, collector.token)
    try:
        with session.step(0):
            with session.phase("forward"):
                worker = threading.Thread(target=_copy, args=(session, sc.TIER_DISK, sc.TIER_HOST, 0.2))
                worker.start()
                time.sleep(0.1)
                _copy(session, sc.TIER_HOST, sc.TIER_DISK, 0.05, "activations")
                worker.join()
                time.sleep(0.1)
            _copy(session, sc.TIER_HOST, sc.TIER_DISK, 0.1)
            with session.host_work("optimizer"):
                time.sleep(0.05)
    finally:
        session.shutdown()
    collector.stop()  # the session's shutdown waited for the collector to take the step
    ((attrs,),) = query(collector.db, "SELECT attrs FROM steps WHERE run_id = 'run-tiers'")
    step = json.loads(attrs)
    assert 0.3 <= step[sc.TRANSFER_S] < 0.6, step
    assert 0.15 <= step[sc.TRANSFER_EXPOSED_S] < 0.3, step  # the writes: the read (0.2 s) hid under the forward
    assert 0.05 <= step[sc.HOST_OPTIMIZER_S] < 0.1, step
    ops = query(
        collector.db,
        f"""SELECT name, kind, attrs->>{sc.json_path(sc.TRANSFER_BYTES)}, attrs->>{sc.json_path(sc.TRANSFER_FOR)}
            FROM ops WHERE run_id = 'run-tiers' AND kind IN ('transfer', 'host') ORDER BY start_ts""",
    )
    assert ops == [
        ("disk->host", "transfer", "1000", "optimizer_state"),
        ("host->disk", "transfer", "1000", "activations"),
        ("host->disk", "transfer", "1000", "optimizer_state"),
        ("optimizer", "host", None, None),
    ]


def _copy(session: Session, src: str, dst: str, seconds: float, what: str = "optimizer_state") -> None:
    with session.transfer(src, dst, 1000, what):
        time.sleep(seconds)


def test_activations_go_to_disk_in_forward_and_come_back_for_backward_unchanged(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    data = torch.randn(512, 256)
    net(data).square().mean().backward()
    expected = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    disk = Disk(tmp_path)
    swapped = ActivationsToDisk(disk)
    try:
        swapped.start()
        with swapped.saving():
            loss = net(data).square().mean()
        files = sorted(p.name for p in tmp_path.iterdir())
        loss.backward()
    finally:
        disk.close()
    assert files and all(name.startswith("activation-") for name in files)  # 512 x 512 floats: 1 MB each
    for got, want in zip((p.grad for p in net.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_without_a_session_the_agents_transfer_and_host_work_are_no_ops():
    with agent.transfer(sc.TIER_GPU, sc.TIER_PINNED, 10), agent.host_work("optimizer"):
        pass


def test_the_offload_spec_reads_as_the_command_line_writes_it():
    spec = Spec.parse("optimizer=disk,activations=disk", "overlap")
    assert (spec.optimizer, spec.schedule, spec.activations) == ("disk", "overlap", True)
    assert Spec.parse(str(spec), "overlap") == spec and str(Spec.parse("optimizer=host")) == "optimizer=host"
    for bad in ("optimizer=gpu", "activations=disk", "optimizer=disk,activations=host", "optimizer=disk,x=1"):
        with pytest.raises(ValueError, match="expected optimizer=host or optimizer=disk"):
            Spec.parse(bad)
