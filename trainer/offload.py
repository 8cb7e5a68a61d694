"""Optimizer offload, the reference for swap-bound training (ZeRO-Offload and ZeRO-Infinity, Fuyou).

The optimizer's state lives on the host (`optimizer=host`), or is spilled to a local file per parameter
group (`optimizer=disk`) and read back from the disk at every step: written, synced and dropped from the
page cache, so that each read is the disk's. AdamW steps on the host's CPUs, a group at a time, on flat
fp32 buffers: torch's fused CPU AdamW, one pass over each group's buffers that allocates nothing (a
step of separate tensor ops allocates temporaries the size of the group, whose pages the allocator hands
back and faults in again at every step, on one thread and not another). Its swaps and steps run on a
worker thread of the optimizer's, on the rank's share of the host's cores (`host_threads`: a rank
starts with one intra-op thread, OMP_NUM_THREADS=1, and one whose device computes leaves the rest idle
while its optimizer steps); OpenMP keeps a count per thread, so the training thread's stays as it is
(changing it there and back at every group cost milliseconds a change: docs/benchmarks.md). Two
schedules:

- `serial`: after backward, every gradient is copied to the host, then each group's state is read,
  stepped and written in turn (ZeRO-Infinity's order), the training thread copying each group's
  parameters back once it is stepped: the step waits for every swap and for the host optimizer.
- `overlap`: the worker reads each group's state back while the step computes, steps each group
  once its gradients are on the host while the next group's are copied, and writes their state out
  while the next step computes (Fuyou's idea): the step waits only for what compute could not hide.

With `activations=disk` the activations autograd saves in forward go to disk and come back in backward
(`ActivationsToDisk`), the swap ZeRO-Infinity and Fuyou make of activations too. Every copy between tiers
is an `agent.transfer`, every group's step an `agent.host_work("optimizer")`.
A `slow-disk` fault caps this rank's swap bandwidth (`rate_mbps`). `probe` times the disk with large
sequential I/O at start: what the analysis compares the bandwidth achieved with.
"""

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.optim.adamw import adamw

from rankwatch import agent
from rankwatch.agent import semconv as sc
from trainer.job import Spec

PROBE_BYTES = 32 << 20  # large enough to time the disk, not its cache or its latency
STATE = "optimizer_state"


class Disk:
    """Files of one rank's swapped state, each read and written whole, past the page cache. `rate_mbps`:
    the bandwidth a slow disk gives (None: what the disk gives), enforced by waiting out the rest."""

    def __init__(self, directory: Path, rate_mbps: Callable[[], float | None] = lambda: None):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self._rate = directory, rate_mbps
        self._files: dict[str, int] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        started, data = time.perf_counter(), _bytes(tensor)
        fd = self._fd(name)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], done)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read is the disk's
        self._pace(len(data), started)

    def read(self, name: str, into: torch.Tensor) -> None:
        started, data = time.perf_counter(), _bytes(into)
        fd = self._fd(name)
        done = 0
        while done < len(data):
            got = os.preadv(fd, [data[done:]], done)
            if got == 0:
                raise EOFError(f"{self.directory / name}: {done} of {len(data)} bytes")
            done += got
        self._pace(len(data), started)

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def _fd(self, name: str) -> int:
        if name not in self._files:
            self._files[name] = os.open(self.directory / name, os.O_RDWR | os.O_CREAT, 0o600)
        return self._files[name]

    def _pace(self, nbytes: int, started: float) -> None:
        if (rate := self._rate()) is not None:
            time.sleep(max(0.0, nbytes / (rate * 1e6) - (time.perf_counter() - started)))


def probe(directory: Path, nbytes: int = PROBE_BYTES) -> tuple[float, float]:
    """(read, write) bytes/s of the disk under `directory` for large sequential I/O past the page cache."""
    disk = Disk(directory)
    block = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    try:
        started = time.perf_counter()
        disk.write("probe", block)
        write = nbytes / (time.perf_counter() - started)
        started = time.perf_counter()
        disk.read("probe", block)
        return nbytes / (time.perf_counter() - started), write
    finally:
        disk.close()
        (directory / "probe").unlink(missing_ok=True)


class _Group:
    """One parameter group's flat fp32 buffers on the host: its parameters (the master copy), gradients
    and AdamW moments (where the state is on disk, read into at each step and written out after it)."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], pinned: bool):
        self.name, self.params = f"group-{index:03d}", params
        n = sum(p.numel() for p in params)
        make = lambda: torch.zeros(n, dtype=torch.float32, pin_memory=pinned)  # noqa: E731
        self.master, self.grads, self.moments = make(), make(), torch.zeros(2 * n, dtype=torch.float32)
        torch.cat([p.detach().reshape(-1).float().cpu() for p in params], out=self.master)
        self.nbytes = self.moments.numel() * 4

    def adamw(self, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """torch.optim.AdamW's update, fused, on the flat buffers (`step`: the one this update makes)."""
        exp_avg, exp_avg_sq = self.moments.chunk(2)
        adamw(
            [self.master],
            [self.grads],
            [exp_avg],
            [exp_avg_sq],
            [],
            [torch.tensor(step - 1.0)],  # the steps taken before: the update counts its own
            fused=True,
            amsgrad=False,
            beta1=betas[0],
            beta2=betas[1],
            lr=lr,
            weight_decay=weight_decay,
            eps=eps,
            maximize=False,
        )


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW whose state and step are off the GPU (`spec`), its groups one module each of `groups`."""

    def __init__(
        self,
        groups: Iterable[list[torch.nn.Parameter]],
        spec: Spec,
        directory: Path,
        lr: float,
        weight_decay: float,
        rate_mbps: Callable[[], float | None] = lambda: None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        threads: int | None = None,
    ):
        """`threads`: the intra-op threads AdamW's step takes on the host (None: `host_threads()`)."""
        groups = [g for g in groups if g]
        super().__init__([p for g in groups for p in g], {"lr": lr, "weight_decay": weight_decay})
        self.spec, self.betas, self.eps, self.steps = spec, betas, eps, 0
        self.threads = threads or host_threads()
        self._device = groups[0][0].device
        cuda = self._device.type == "cuda"
        self._groups = [_Group(i, g, pinned=cuda) for i, g in enumerate(groups)]
        self._host_tier = sc.TIER_PINNED if cuda else sc.TIER_HOST
        self._disk = Disk(directory, rate_mbps) if spec.optimizer == "disk" else None
        for g in self._groups:
            self._move(g, True)
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="rankwatch-offload", daemon=True)
        self._worker.start()
        self._read_ahead: list[threading.Event] = []
        self._written: threading.Event = threading.Event()
        self._written.set()
        self._failed: BaseException | None = None

    @property
    def state_bytes(self) -> int:
        """The optimizer state's bytes, what a step reads and writes where it is on disk."""
        return sum(g.nbytes for g in self._groups)

    def prefetch(self) -> None:
        """At a step's start: with `overlap`, the worker reads every group's state back while it computes."""
        if self.spec.schedule == "overlap" and self._disk is not None:
            self._read_ahead = [threading.Event() for _ in self._groups]
            for g, done in zip(self._groups, self._read_ahead, strict=True):
                self._jobs.put((self._move, g, False, done))

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # no closure: AdamW needs none
        """Step every group on the host; returns once the parameters are updated (with `overlap`, the
        state's writes go on while the next step computes)."""
        self.steps += 1
        group = self.param_groups[0]
        settings = (self.steps, group["lr"], self.betas, self.eps, group["weight_decay"])
        overlap = self.spec.schedule == "overlap"
        if not overlap:  # every gradient on the host before the first group's state is read
            for g in self._groups:
                self._gradients(g)
        prefetched, updated = bool(self._read_ahead), [threading.Event() for _ in self._groups]
        self._written = threading.Event()
        for g, done in zip(self._groups, updated, strict=True):  # stepped after the reads queued before them
            if overlap:
                self._gradients(g)  # while the worker steps the groups before
            self._jobs.put((self._update, g, prefetched, settings, done))
            if not overlap:  # written before the next group is read
                self._jobs.put((self._move, g, True))
        if overlap:  # written once every group is stepped, while the next step computes
            for g in self._groups:
                self._jobs.put((self._move, g, True))
        self._jobs.put((self._written.set,))
        self._read_ahead = []
        for g, done in zip(self._groups, updated, strict=True):
            done.wait()
            self._raise_failed()
            self._parameters(g)  # while the worker goes on with the groups after
        if not overlap:  # the step waits for every write too
            self._written.wait()
            self._raise_failed()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None

    def drain(self) -> None:
        """Wait for the worker's writes (before the state is read whole: a snapshot, a restore)."""
        self._written.wait()
        for done in self._read_ahead:
            done.wait()
        self._raise_failed()

    def state_dict(self) -> dict:
        """The state as of the last step (each group's buffers hold what its file holds)."""
        self.drain()
        return {
            "steps": self.steps,
            "param_groups": [{k: v for k, v in self.param_groups[0].items() if k != "params"}],
            "moments": [g.moments.clone() for g in self._groups],
            "master": [g.master.clone() for g in self._groups],
        }

    def load_state_dict(self, state: dict) -> None:
        self.drain()
        self.steps = state["steps"]
        self.param_groups[0].update(state["param_groups"][0])
        for g, moments, master in zip(self._groups, state["moments"], state["master"], strict=True):
            g.moments.copy_(moments)
            g.master.copy_(master)
            self._move(g, True)

    def close(self) -> None:
        self.drain()
        self._jobs.put(None)
        self._worker.join()
        if self._disk is not None:
            self._disk.close()

    # -- a group's part of a step ---------------------------------------------------------------------
    def _gradients(self, g: _Group) -> None:
        """The group's gradients into its flat host buffer (a copy from the GPU where it trains on one)."""
        grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in g.params]
        if self._device.type == "cuda":
            with agent.transfer(sc.TIER_GPU, self._host_tier, g.grads.numel() * 4, "gradients"):
                g.grads.copy_(torch.cat(grads).float(), non_blocking=True)
                torch.cuda.current_stream().synchronize()
        else:
            torch.cat([t.float() for t in grads], out=g.grads)

    def _parameters(self, g: _Group) -> None:
        """The group's updated master copy into the model's parameters."""
        if self._device.type == "cuda":
            with agent.transfer(self._host_tier, sc.TIER_GPU, g.master.numel() * 4, "parameters"):
                on_gpu = g.master.to(self._device, non_blocking=True)
        else:
            on_gpu = g.master
        offset = 0
        for p in g.params:
            p.copy_(on_gpu[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def _move(self, g: _Group, to_disk: bool, done: threading.Event | None = None) -> None:
        """The group's moments written out to its file (`to_disk`) or read back from it; with the state on the
        host, nothing moves. `done`: set once it is done (a prefetch the update waits for)."""
        if self._disk is not None:
            src, dst = (sc.TIER_HOST, sc.TIER_DISK) if to_disk else (sc.TIER_DISK, sc.TIER_HOST)
            with agent.transfer(src, dst, g.nbytes, STATE):
                (self._disk.write if to_disk else self._disk.read)(g.name, g.moments)
        if done is not None:
            done.set()

    def _update(self, g: _Group, prefetched: bool, settings: tuple, done: threading.Event) -> None:
        """On the worker: the group's state read back where no prefetch did, then its AdamW step."""
        if not prefetched:
            self._move(g, False)
        with agent.host_work("optimizer"), intra_op_threads(self.threads):
            g.adamw(*settings)
        done.set()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job[0](*job[1:])
            except BaseException as e:  # a full disk, a short file: the training loop raises it where it waits
                self._failed = self._failed or e
                for arg in job[1:]:
                    if isinstance(arg, threading.Event):
                        arg.set()

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"the offload worker failed: {self._failed}") from self._failed


class ActivationsToDisk:
    """The activations autograd saves for backward, those of `least_bytes` or more, written to disk as the
    forward makes them and read back as the backward needs them (`saved_tensors_hooks`), past the page
    cache; parameters stay where they are. `start()` at each step: its files are reused step after step."""

    def __init__(self, disk: Disk, least_bytes: int = 256 << 10):
        self._disk, self._least, self._count = disk, least_bytes, 0

    def start(self) -> None:
        self._count = 0

    def close(self) -> None:
        self._disk.close()

    def saving(self):
        """The context the forward runs in."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self._least or (tensor.is_leaf and tensor.requires_grad):
            return tensor
        name, self._count = f"activation-{self._count:04d}", self._count + 1
        on_gpu = tensor.device.type == "cuda"
        if on_gpu:
            with agent.transfer(sc.TIER_GPU, sc.TIER_HOST, nbytes, "activations"):
                host = tensor.detach().to("cpu")
        else:
            host = tensor.detach().contiguous()
        with agent.transfer(sc.TIER_HOST, sc.TIER_DISK, nbytes, "activations"):
            self._disk.write(name, host)
        return name, tensor.shape, tensor.dtype, tensor.device

    def _unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        name, shape, dtype, device = packed
        host = torch.empty(shape, dtype=dtype)
        nbytes = host.numel() * host.element_size()
        with agent.transfer(sc.TIER_DISK, sc.TIER_HOST, nbytes, "activations"):
            self._disk.read(name, host)
        if device.type != "cuda":
            return host
        with agent.transfer(sc.TIER_HOST, sc.TIER_GPU, nbytes, "activations"):
            return host.to(device)


def host_threads() -> int:
    """The intra-op threads a rank's host optimizer takes: its share of the cores this process may run on,
    the host's ranks (torchrun's LOCAL_WORLD_SIZE) sharing them."""
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """The calling thread's torch ops on `threads` intra-op threads, its own count back after: with OpenMP
    each thread has its own count, so another thread's ops (the training loop's) keep theirs."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def groups_of(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """The model's trainable parameters by top-level module, a ModuleList's (a transformer's blocks) one
    group each, in order; each parameter once (tied weights in the first group that holds them)."""
    seen: set[int] = set()

    def take(module: torch.nn.Module) -> list[torch.nn.Parameter]:
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        return params

    out: list[list[torch.nn.Parameter]] = []
    for child in model.children():
        out += [take(block) for block in child] if isinstance(child, torch.nn.ModuleList) else [take(child)]
    out.append(take(model))  # the model's own parameters
    return [g for g in out if g]


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous tensor's memory as bytes, whatever its dtype (no copy): what the disk reads into and
    writes from."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # a buffer
