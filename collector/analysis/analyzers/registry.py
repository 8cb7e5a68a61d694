"""The analyzers the engine runs (collector/analysis/engine.py), live and after the fact alike: adding one
is its module (ANALYZER, READS, judge) and a line here. Power recommendations (analyzers/power.py)
and the collector's health (analyzers/health.py) are drawn apart: the first on a timer of its
own (a bootstrap over the ranks, seconds at a thousand), the second on the server's counters."""

from collector.analysis.analyzers import (
    anomalies,
    failures,
    fleet,
    hangs,
    links,
    predicted,
    rollbacks,
    stragglers,
    tiers,
)

ANALYZERS = (stragglers, links, anomalies, hangs, rollbacks, predicted, tiers, failures, fleet)
