"""A deterministic token stream whose position is part of the training state.

Batches come from a fixed-seed generator indexed by (rank, position), so a
restored position replays exactly the same batches (rollback and resume
depend on it), and `skip` jumps over a window of them.
"""

from dataclasses import dataclass

import torch


@dataclass
class TokenStream:
    vocab: int
    seq_len: int
    batch: int
    rank: int
    seed: int = 1234
    position: int = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the next batch: a noisy copy task the model can learn."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 7919 + self.position)
        self.position += 1
        base = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=g)
        tokens = torch.cumsum(base % 7, dim=1) % self.vocab  # structure: each token predicts the next
        return tokens[:, :-1], tokens[:, 1:]

    def skip(self, batches: int) -> None:
        self.position += batches

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "rank": self.rank}

    def load_state_dict(self, state: dict) -> None:
        self.position, self.seed = state["position"], state["seed"]
