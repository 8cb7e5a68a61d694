"""A training curve for the fleet simulator: each step's loss and gradient norm, shaped like
GPT-2's first steps on an H100 (tests/data/h100_gpt2_first_attempts.csv).

The loss falls as a power law toward a floor, `floor + (start - floor) * (1 + step / tau) ** -power`
(10.95 -> 7.3 by step 20, 5.7 by 100 and 5.0 by 190, as on the H100), times lognormal noise. The
gradient norm falls from 1.5 to 0.45 over the first steps, then drifts up (0.7 by step 190), times
lognormal noise; on top of it come natural excursions: bursts that lift it 1.2x to 3x over two steps
and fade over a few more (the H100's 0.43 -> 0.75 -> 1.01 while the loss kept falling), more
often and larger early in training (up to 8x there), lifting the loss by a few percent with them.
None of this is an anomaly; the faults the trainer injects are: `spike` scales one step's loss,
and with it its gradients (the trainer back-propagates the scaled loss), and `nan` makes both NaN.

Every rank reports the step's gradient norm (DDP all-reduces the gradients) and its own loss (its
own batch: the step's loss times its own lognormal noise). The draws come from their own generator,
one step at a time, so a curve does not change the simulator's timing draws, and its first steps
are the same however many steps are drawn.
"""

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from trainer.faults import Fault

CURVE_KINDS = ("spike", "nan")  # the faults a curve takes; the trainer injects them the same way


@dataclass(frozen=True)
class Curve:
    start: float = 10.95  # the loss at step 0: ln of GPT-2's vocabulary, 50,257 tokens
    floor: float = 3.0
    tau: float = 5.0  # steps: how soon the early fall slows
    power: float = 0.38
    loss_noise: float = 0.01  # lognormal sigma of the step's loss (the H100's, past its first steps)
    rank_noise: float = 0.01  # lognormal sigma of a rank's loss about the step's
    grad_start: float = 1.5
    grad_base: float = 0.45
    grad_drift: float = 300.0  # steps for the gradient norm's base to rise by its own size
    grad_noise: float = 0.08  # lognormal sigma of the gradient norm
    excursion_rate: float = 0.01  # natural gradient-norm excursions per step, late in training
    early_rate: float = 0.15  # more of them at the start, fading over `early_steps`
    early_steps: float = 15.0
    excursion_size: tuple[float, float] = (1.2, 3.0)  # the least and most an excursion lifts the gradient norm
    excursion_decay: float = 0.7  # per step, of an excursion's log size once it has risen
    loss_coupling: float = 0.04  # the loss rises by this times the excursion's log size (3% at 2.3x)

    def scaled(self, noise: float) -> "Curve":
        """This curve with its noise (loss, ranks, gradient norm) and excursion rates `noise` times."""
        return replace(
            self,
            loss_noise=self.loss_noise * noise,
            rank_noise=self.rank_noise * noise,
            grad_noise=self.grad_noise * noise,
            excursion_rate=self.excursion_rate * noise,
            early_rate=self.early_rate * noise,
        )


def curve(c: Curve, ranks: int, faults: list[Fault], seed: int = 0) -> Iterator[tuple[np.ndarray, float]]:
    """Step after step, each rank's loss and the step's gradient norm, with the `spike` and `nan`
    faults of `faults` applied (the others are not about the curve)."""
    rng = np.random.default_rng([seed, 1])  # not the timing's generator
    low, high = math.log(c.excursion_size[0]), math.log(c.excursion_size[1])
    level = pending = 0.0  # the excursion's log size now, and what it has yet to rise
    step = 0
    while True:
        early = math.exp(-step / c.early_steps)
        level = level * c.excursion_decay + pending
        pending = 0.0
        if rng.random() < c.excursion_rate + c.early_rate * early:  # rises over this step and the next
            size = rng.uniform(low, high) + early * math.log(8.0 / c.excursion_size[1]) * rng.random()
            level, pending = level + size / 2, size / 2
        loss = (c.floor + (c.start - c.floor) * (1 + step / c.tau) ** -c.power) * math.exp(
            rng.normal(0.0, c.loss_noise) + c.loss_coupling * level
        )
        grad = (
            c.grad_base * (1 + step / c.grad_drift) + (c.grad_start - c.grad_base) * math.exp(-step / 3)
        ) * math.exp(rng.normal(0.0, c.grad_noise) + level)
        losses = loss * np.exp(rng.normal(0.0, c.rank_noise, ranks))
        for f in faults:
            if f.kind in CURVE_KINDS and f.active(step):
                scale = f.get("scale") if f.kind == "spike" else math.nan
                losses, grad = losses * scale, grad * scale
        yield losses, grad
        step += 1
