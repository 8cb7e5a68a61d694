"""A stock Lightning job that knows nothing of rankwatch (tests/agent/test_frameworks.py runs it under
`rankwatch run -- torchrun`): a tiny LightningModule with automatic optimization (Lightning hands the
optimizer a closure that runs the forward and backward: they run inside `optimizer.step`), DDP on CPUs
(gloo; with --cuda a wider MLP on the ranks' GPUs, NCCL), gradient clipping and gradient accumulation
over `--accum` batches. The loss Lightning optimized at each optimizer step (the sum of the batches'
losses it back-propagated, each scaled by 1/accum: their mean), and when each step ended (wall clock,
and the process's CPU time) are written by each rank to OUT/rank-<rank>.json."""

import argparse
import json
import os
import time
from pathlib import Path

import lightning
import torch


class Regression(lightning.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Seen(lightning.Callback):
    """What Lightning saw at each optimizer step: the batches' losses it optimized, summed, and when it ended."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._loss = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._loss += outputs["loss"].item()  # the closure's loss, already divided by accumulate_grad_batches
        if trainer.global_step > len(self.steps):  # this batch's optimizer step ran
            ended = {"end_s": time.perf_counter(), "cpu_s": time.process_time(), "thread_cpu_s": time.thread_time()}
            self.steps.append({"step": len(self.steps), "loss": self._loss, **ended})
            self._loss = 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation: batches per step")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("JOB_OUT", ".")))
    parser.add_argument("--cuda", action="store_true", help="a wider model on the ranks' GPUs, NCCL")
    args = parser.parse_args()
    lightning.seed_everything(args.seed, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", 2))
    n = args.steps * args.accum * args.batch * world
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(n, 32, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :1] * 2 + 0.1 * torch.randn(n, 1, generator=g))
    seen = Seen()
    trainer = lightning.Trainer(
        accelerator="gpu" if args.cuda else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
        strategy="ddp",
        accumulate_grad_batches=args.accum,
        gradient_clip_val=1.0,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[seen],
    )
    trainer.fit(Regression(8192 if args.cuda else 64), torch.utils.data.DataLoader(data, batch_size=args.batch))
    rank = trainer.global_rank
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "steps": seen.steps}))


if __name__ == "__main__":
    main()
