"""The tasks the store's writer runs beside its commits, built in the writer's process: the analysis, with the
consumers its findings are published to (the alert outbox, rollbacks for anomalies, stacks requests for hangs),
the alert delivery, and a lake's upkeep.

The server hands the store a WriterTasks, its Config (collector/config.py) in it, which crosses to each writer
process started pickled and is called there. So the analysis, and what it imports (pandas, the analyzers, the
step-time model), loads in the writer alone: the server's process receives, answers and counts, and starts
without it.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from collector.config import Config

if TYPE_CHECKING:
    from collector.store.writer import Task


@dataclass(frozen=True)
class WriterTasks:
    """The writer's tasks, as the collector's configuration sets them; calling it builds them."""

    config: Config

    def __call__(self) -> "tuple[Task, ...]":
        # imported here, in the writer's process (the module's docstring says why)
        from collector.alerts.delivery import Delivery
        from collector.alerts.outbox import Outbox
        from collector.analysis.analyzers import hangs, predicted
        from collector.analysis.live import Analysis
        from collector.control.commands import RollbackPolicy, Rollbacks, StacksRequests
        from collector.reports import powercaps

        c = self.config
        rollbacks = [Rollbacks(RollbackPolicy(on=c.rollback_on))] if c.rollback_on else []
        analysis = Analysis(
            c.analyze_every_s,
            hang_settings=hangs.Settings(floor_s=c.hang_after_s),
            consumers=[Outbox(c.alerts), *rollbacks, StacksRequests()],
            power_report=powercaps.live_report,
            power_every_s=c.power_every_s or None,
            predicted_settings=predicted.Settings(model=c.model),
        )
        return (analysis, Delivery(c.alerts), c.upkeep)
