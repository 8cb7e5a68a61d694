"""The tasks the store's writer runs beside its commits, built in the writer's process: the analysis, with the
consumers its findings are published to (the alert outbox, rollbacks for anomalies, stacks requests for hangs),
the alert delivery, and a lake's upkeep.

The server hands the store a WriterTasks: a description of them, which crosses to each writer process started
pickled and is called there. So the analysis, and what it imports (pandas, the analyzers, the step-time model),
loads in the writer alone: the server's process receives, answers and counts, and starts without it.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from collector.alerts.config import AlertConfig
from collector.store.upkeep import Upkeep

if TYPE_CHECKING:
    from collector.predict.stepmodel import Fitted
    from collector.store.writer import Task


@dataclass(frozen=True)
class WriterTasks:
    """The writer's tasks, as the collector's configuration (collector/server.py's Config) sets them; calling
    it builds them."""

    analyze_every_s: float
    hang_after_s: float
    power_every_s: float | None  # None: power caps never redrawn
    rollback_on: frozenset[str]  # the anomalies that become a rollback; none: no rollbacks
    alerts: AlertConfig
    upkeep: Upkeep
    model: "Fitted | None" = None

    def __call__(self) -> "tuple[Task, ...]":
        # imported here, in the writer's process (the module's docstring says why)
        from collector.alerts.delivery import Delivery
        from collector.alerts.outbox import Outbox
        from collector.analysis.analyzers import hangs, predicted
        from collector.analysis.live import Analysis
        from collector.control.commands import RollbackPolicy, Rollbacks, StacksRequests
        from collector.reports import powercaps

        rollbacks = [Rollbacks(RollbackPolicy(on=self.rollback_on))] if self.rollback_on else []
        analysis = Analysis(
            self.analyze_every_s,
            hang_settings=hangs.Settings(floor_s=self.hang_after_s),
            consumers=[Outbox(self.alerts), *rollbacks, StacksRequests()],
            power_report=powercaps.live_report,
            power_every_s=self.power_every_s,
            predicted_settings=predicted.Settings(model=self.model),
        )
        return (analysis, Delivery(self.alerts), self.upkeep)
