"""Sharded training state through the checkpointer: a 2-rank FSDP2 job (the trainer's 3D code with
dp = 2) snapshots its model and AdamW state as each rank's local shards (trainer/sharded.py), trains
on, and restores: every shard comes back bit for bit, as the same DTensors (mesh and placements),
from memory and from disk, and the next step after the restore is the step taken after the snapshot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.long


def _rank(rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainer.checkpoint import Checkpointer
    from trainer.data import TokenStream
    from trainer.job import CONFIGS
    from trainer.layout import Layout
    from trainer.model import GPT
    from trainer.sharded import Local
    from trainer.threed import ThreeD

    # a file rendezvous: no port another test could take in between
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    torch.manual_seed(0)
    job = ThreeD(GPT(CONFIGS["tiny"]), Layout(dp=2, tp=1, pp=1), torch.device("cpu"), 4, list)
    optimizer = torch.optim.AdamW(job.module.parameters(), lr=1e-3)
    data = TokenStream(512, 64, 4, job.replica)

    def lowest(value: int) -> int:
        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t)

    def train_step() -> float:
        loss = job.forward_backward(*data.next(), [])
        job.clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    def shards() -> dict:
        state = {f"model.{k}": v for k, v in job.module.state_dict().items()}
        for i, s in optimizer.state_dict()["state"].items():
            state.update({f"optimizer.{i}.{k}": v for k, v in s.items()})
        return {k: v.to_local().clone() if isinstance(v, DTensor) else v.clone() for k, v in state.items()}

    directory, state = (
        Path(out) / f"rank-{rank}",
        {"model": Local(job.module), "optimizer": Local(optimizer), "data": data},
    )
    ckpt = Checkpointer(directory, state, memory=2, agree=lowest)
    train_step()
    ckpt.reserve(wait=True)
    ckpt.snapshot(1)  # one step done: the state after it
    ckpt.wait_until_safe()  # its copy taken
    saved, after = shards(), train_step()
    ckpt.make_durable(1)
    train_step()
    restored = {"memory": ckpt.restore(1)}
    same_memory = all(torch.equal(saved[k], v) for k, v in shards().items())
    placements = {k: str(v.placements) for k, v in job.module.state_dict().items() if isinstance(v, DTensor)}
    replayed = train_step()
    ckpt.close()
    fresh = Checkpointer(directory, state, memory=2, agree=lowest)  # a new process's: the disk alone
    restored["disk"] = fresh.restore(1)
    same_disk = all(torch.equal(saved[k], v) for k, v in shards().items())
    fresh.close()
    with open(f"{out}/rank-{rank}.json", "w") as f:
        json.dump(
            {
                "restored": restored,
                "same_memory": same_memory,
                "same_disk": same_disk,
                "placements": placements,
                "after": after,
                "replayed": replayed,
                "sharded": len(placements),
            },
            f,
        )
    dist.destroy_process_group()


def test_a_sharded_state_is_restored_exactly_from_memory_and_disk(tmp_path):
    code = "import sys; from tests.trainer.test_sharded_state import _rank; _rank(int(sys.argv[1]), sys.argv[2])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(r), str(tmp_path)], env=env) for r in (0, 1)]
    assert [p.wait(timeout=180) for p in ranks] == [0, 0]
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert found["restored"] == {"memory": 1, "disk": 1}
        assert found["same_memory"] and found["same_disk"]
        assert found["sharded"] > 0 and all(p == "(Shard(dim=0),)" for p in found["placements"].values())
        assert found["replayed"] == found["after"]  # the step after the restore is the one taken after the snapshot
