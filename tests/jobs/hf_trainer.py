"""A stock Hugging Face `transformers.Trainer` job that knows nothing of rankwatch (tests/agent/test_frameworks.py
runs it under `rankwatch run -- torchrun`): a tiny GPT-2 built from its config, random tokens, on CPUs
(gloo; with --cuda, GPT-2's 124M parameters on the rank's GPU, NCCL, bf16), with gradient clipping and
gradient accumulation over `--accum` micro-batches. The loss the Trainer logs at each optimizer step (it
logs every step: it logs the average over its logging window, and over the ranks), its gradient norm, and
when each step ended (wall clock, and the process's CPU time) are written by each rank to
OUT/rank-<rank>.json."""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

VOCAB, SEQ = 128, 16


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every run of a seed; the labels are the inputs (GPT-2 shifts)."""

    def __init__(self, n: int, seed: int, vocab: int, seq: int):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Seen(TrainerCallback):
    """What the Trainer saw at each optimizer step: its logged loss and gradient norm, and when the step ended (by the
    clock, the process's CPU time and the training thread's)."""

    def __init__(self) -> None:
        self.steps: dict[int, dict] = {}

    def on_step_end(self, args, state, control, **kwargs):
        ended = {"end_s": time.perf_counter(), "cpu_s": time.process_time(), "thread_cpu_s": time.thread_time()}
        self.steps.setdefault(state.global_step, {}).update(ended)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.setdefault(state.global_step, {}).update(loss=logs["loss"], grad_norm=logs.get("grad_norm"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation: micro-batches per step")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch and rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("JOB_OUT", ".")))
    parser.add_argument("--cuda", action="store_true", help="GPT-2 (124M) on the rank's GPU, NCCL, bf16")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    vocab, seq = (50257, 512) if args.cuda else (VOCAB, SEQ)
    config = (
        GPT2Config(vocab_size=vocab, n_positions=seq)
        if args.cuda
        else GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    )
    model = GPT2LMHeadModel(config)
    seen = Seen()
    world = int(os.environ.get("WORLD_SIZE", 1))
    with tempfile.TemporaryDirectory() as scratch:
        training = TrainingArguments(
            output_dir=scratch,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=args.accum,
            learning_rate=1e-3,
            max_grad_norm=1.0,
            logging_steps=1,
            logging_nan_inf_filter=False,
            save_strategy="no",
            report_to=[],
            use_cpu=not args.cuda,
            bf16=args.cuda,
            ddp_backend="nccl" if args.cuda else "gloo",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=args.seed,
        )
        dataset = Tokens(args.steps * args.accum * args.batch * world, args.seed, vocab, seq)
        Trainer(model=model, args=training, train_dataset=dataset, callbacks=[seen]).train()
    rank = int(os.environ.get("RANK", 0))
    steps = [{"step": step - 1, **seen.steps[step]} for step in sorted(seen.steps) if step > 0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "steps": steps}))


if __name__ == "__main__":
    main()
