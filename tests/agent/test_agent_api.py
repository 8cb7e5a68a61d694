"""The agent's public functions used out of order say so at once, rather than inside training."""

import pytest
import torch.distributed as dist

from rankwatch import agent

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these


def test_watching_collectives_before_init_says_so(monkeypatch):
    monkeypatch.setattr(agent, "_session", None)
    all_reduce = dist.all_reduce
    with pytest.raises(RuntimeError, match=r"agent\.init\(\)"):
        agent.watch_collectives()
    assert dist.all_reduce is all_reduce  # nothing wrapped
