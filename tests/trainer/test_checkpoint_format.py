"""Checkpoints written before the snapshot format had a module of its own (trainer/snapshotformat.py)
still load: their pickles name the format's two classes, `_Ref` and `_Tensor`, in trainer.checkpoint.
The restricted unpickler takes those two names for the format's, and no other name of either module.

A checkpoint of then is written the way it was: the real checkpointer writes real files with the two
classes placed, for the writing, where they lived then (their module and name are what a pickle
records); a fresh checkpointer loads them.
"""

import pickle

import pytest
import torch

from trainer import checkpoint, snapshotformat
from trainer.checkpoint import META, Checkpointer
from trainer.snapshotformat import read_state_file

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these


def test_a_checkpoint_naming_the_classes_where_they_were_loads(tmp_path, monkeypatch):
    torch.manual_seed(0)
    saved = torch.nn.Linear(8, 4)
    with monkeypatch.context() as then:
        for name in ("_Ref", "_Tensor"):
            cls = getattr(snapshotformat, name)
            then.setattr(cls, "__module__", "trainer.checkpoint")
            then.setattr(checkpoint, name, cls, raising=False)
        ckpt = Checkpointer(tmp_path, {"model": saved}, memory=1, disk_every=1)
        ckpt.reserve(wait=True)
        ckpt.snapshot(1)
        ckpt.close()
    state_file = (tmp_path / "step-00000001" / META).read_bytes()
    assert b"trainer.checkpoint" in state_file and b"snapshotformat" not in state_file

    torch.manual_seed(1)
    fresh = torch.nn.Linear(8, 4)
    assert not torch.equal(fresh.weight, saved.weight)
    ckpt = Checkpointer(tmp_path, {"model": fresh}, memory=1, disk_every=1)
    assert ckpt.restore(1) == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.state_dict().items())
    ckpt.close()


@pytest.mark.parametrize(
    "module, name",
    [
        ("trainer.checkpoint", "Checkpointer"),
        ("trainer.checkpoint", "_Tensor"),  # outside a snapshot's pickled state there is no tensor to stand for
        ("trainer.snapshotformat", "_Unpickler"),
    ],
)
def test_no_other_name_of_either_module_is_taken(module, name):
    named = f"c{module}\n{name}\n.".encode()  # a pickle of one global (protocol 0's GLOBAL)
    with pytest.raises(pickle.UnpicklingError, match=f"it names {module}.{name}, which no checkpoint holds"):
        read_state_file(named)
    assert read_state_file(b"ctrainer.checkpoint\n_Ref\n.") is snapshotformat._Ref
