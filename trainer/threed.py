"""One rank of a 3D-parallel job (FSDP2 x tensor x pipeline parallelism, trainer/parallel.py): its
stage of the model, how a batch goes forward and backward through it (the pipeline schedule's step,
or the model's forward and backward without stages), the gradient norm across every shard, and where
the rank stands in the mesh.
"""

import torch

from rankwatch import agent
from rankwatch.agent import semconv as sc
from trainer import parallel
from trainer.faults import Fault
from trainer.inject import ComputeFaults
from trainer.layout import Layout
from trainer.model import GPT, loss


class ThreeD:
    """`model` cut to this rank's stage, split over tp and sharded over dp. `active()`: the faults of
    the current step on this rank (its compute faults apply to each forward of the stage)."""

    def __init__(self, model: GPT, layout: Layout, device: torch.device, batch: int, active):
        self.layout, self.device = layout, device
        self.mesh = parallel.mesh(layout, device.type)
        where = parallel.coordinates(self.mesh)
        self.stage, self.replica = where["pp"], where["dp"]
        self.first, self.last = self.stage == 0, self.stage == layout.pp - 1
        self.resource = {sc.DP_RANK: where["dp"], sc.PP_STAGE: where["pp"], sc.TP_RANK: where["tp"]}
        model = model.stage(self.stage, layout.pp)
        self.params_per_rank = model.num_params() // layout.tp  # each tp rank computes its share
        self.module = parallel.parallelize(model.to(device), self.mesh)
        self._faults: list[Fault] = []
        ComputeFaults(self.module, active, self.stage, device.type == "cuda")
        self.schedule = None
        if layout.pp > 1:
            self.schedule = parallel.schedule(
                self.module, self.mesh, parallel.microbatches(batch, layout.pp), device, self._loss
            )

    def watch(self) -> None:
        """The agent's view of it: every collective (FSDP's, TP's functional ones, the stages' sends and
        receives), the pipeline's forward and backward chunks."""
        agent.watch_collectives()
        if self.schedule is not None:
            agent.watch_pipeline(self.schedule)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = loss(logits, targets)
        for f in self._faults:
            if f.kind == "spike":
                out = out * f.get("scale")
            elif f.kind == "nan":
                out = out * float("nan")
        return out

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, faults: list[Fault]) -> torch.Tensor | None:
        """The batch's loss (the mean of its microbatches' on the last stage; None on the others)."""
        self._faults = faults
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            if self.schedule is None:
                with agent.phase("forward"):
                    out = self._loss(self.module(inputs), targets)
                with agent.phase("backward"):
                    out.backward()
                return out
            losses: list[torch.Tensor] = []
            self.schedule.step(
                *((inputs,) if self.first else ()),
                target=targets if self.last else None,
                losses=losses if self.last else None,
            )
        return torch.stack(losses).mean() if losses else None

    def clip(self) -> torch.Tensor:
        with torch.no_grad():
            return parallel.clip_grad_norm(list(self.module.parameters()), 1.0, self.mesh)
