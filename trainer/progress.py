"""Rank 0's progress line, without a sync: the loss is copied to the host on its stream and the line
printed once the copy has landed (`.item()` on a GPU tensor would wait for the whole queue of
launched work every time a line is due)."""

from collections import deque

import torch


class Progress:
    """Prints `step, loss, ms` every `every` steps and at `last`, in order, as the losses arrive."""

    def __init__(self, every: int, last: int):
        self.every, self.last = every, last
        self._due: deque = deque()  # (step, loss on the host, the copy's event or None, ms)

    def step(self, step: int, loss: torch.Tensor, ms: float) -> None:
        if step % self.every == 0 or step == self.last:
            copied = None
            host = loss.detach().to("cpu", non_blocking=True)
            if loss.is_cuda:
                copied = torch.cuda.Event()
                copied.record()
            self._due.append((step, host, copied, ms))
        self.flush()

    def flush(self, wait: bool = False) -> None:
        while self._due and (wait or self._due[0][2] is None or self._due[0][2].query()):
            step, host, copied, ms = self._due.popleft()
            if copied is not None:
                copied.synchronize()
            print(f"step {step:5d}  loss {host.item():7.4f}  {ms:7.1f} ms", flush=True)
