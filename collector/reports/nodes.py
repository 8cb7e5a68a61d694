"""A run's nodes as a scheduler reads them: each host, its ranks, and its health as the fleet analyzer
(collector/analysis/analyzers/fleet.py) last judged it, the unhealthy first; its drain list is the unhealthy
ones. `rankwatch nodes` prints it from a store file or a collector, whose query API answers it at
GET /v1/runs/{run}/nodes[?unhealthy=1].

Each node: {"host", "ranks", "state", "since_step", "score", "metrics"}. `state`: `critical` or `unhealthy`
while its newest `unhealthy_node` finding fires or held to the run's end (critical: it also straggles, its
errors keep rising, or its GPU's memory fails), else `healthy`; `since_step`: that finding's onset; `score`:
its distance to its peers (in their spreads; 6 sets a node apart); `metrics`: the metrics that set it apart,
each {"metric", "family", "value", "peers" (the median node's), "unit" (per_min: a counter's rate; step_share: a
step phase over its step's median, as a share of the step; level: a gauge's), "z" (its distance)}.
"""

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from collector.store.requests import Context, Request, handles
from collector.store.schema import ENDED

if TYPE_CHECKING:
    import duckdb

STATES = ("critical", "unhealthy", "healthy")  # worst first
_NODES = """WITH placed AS (SELECT host, list(rank ORDER BY rank) AS ranks FROM ranks
                             WHERE run_id = $run AND host IS NOT NULL GROUP BY host),
                  judged AS (SELECT evidence->>'host' AS host, severity, state, step_start, score,
                                    evidence->'metrics' AS metrics
                             FROM findings WHERE run_id = $run AND analyzer = $analyzer AND kind = $kind
                             QUALIFY row_number() OVER (PARTITION BY evidence->>'host' ORDER BY id DESC) = 1)
             SELECT p.host, p.ranks, j.severity, j.state, j.step_start, j.score, j.metrics
             FROM placed p LEFT JOIN judged j USING (host)"""
_KNOWN = "SELECT count(*) FROM runs WHERE run_id = $run"


@dataclass(frozen=True)
class RunNodes(Request[dict]):
    """A run's nodes (the unhealthy ones alone with `unhealthy`), through the store's writer."""

    run_id: str
    unhealthy: bool = False


@handles(RunNodes, beside=True, passes=(LookupError,))
def _run_nodes(context: Context, r: RunNodes) -> dict:
    return read(context.con, r.run_id, r.unhealthy)


def read(con: "duckdb.DuckDBPyConnection", run_id: str, unhealthy: bool = False) -> dict:
    """{"run", "nodes"}: the run's nodes, worst first (the unhealthy ones alone with `unhealthy`); LookupError
    for a run the store does not have."""
    from collector.analysis.analyzers import fleet  # (in the writer process, or a command that reads a store)

    if not con.execute(_KNOWN, {"run": run_id}).fetchall()[0][0]:
        raise LookupError(f"no run {run_id!r} in the store")
    judged = {"run": run_id, "analyzer": fleet.ANALYZER, "kind": fleet.UNHEALTHY}
    nodes = [_node(*row) for row in con.execute(_NODES, judged).fetchall()]
    nodes.sort(key=lambda n: (STATES.index(n["state"]), -(n["score"] or 0.0), n["host"]))
    return {"run": run_id, "nodes": [n for n in nodes if n["state"] != "healthy" or not unhealthy]}


def _node(host: str, ranks: list[int], severity, state, since, score, metrics) -> dict:
    """A node from its row: unhealthy while its newest finding fires or held to the run's end."""
    if state not in ("firing", ENDED):
        return {
            "host": host,
            "ranks": list(ranks),
            "state": "healthy",
            "since_step": None,
            "score": None,
            "metrics": [],
        }
    return {
        "host": host,
        "ranks": list(ranks),
        "state": "critical" if severity == "critical" else "unhealthy",
        "since_step": since,
        "score": score,
        "metrics": json.loads(metrics) if metrics else [],
    }
