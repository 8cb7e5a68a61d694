"""Alert rules: the alert a finding raises, with the labels and annotations receivers route on.

One alert name per analyzer; the labels follow Alertmanager's conventions
(alertname, severity) and say where (run, analyzer, kind, ranks, and what an
analyzer's evidence adds: a failed rank's host and cause), so the alerts of
one run and analyzer form one group, and an existing routing tree can page on
`severity="critical"` as it does for every other source. A hang's alert says
where every rank is (annotation `stacks`) once its ranks answered, and what their Flight Recorders say
(`flight_recorder`).
"""

from collections.abc import Mapping
from urllib.parse import quote, urlencode

from collector import ranksets
from collector.analysis import stacks
from collector.findings import CRITICAL, WARNING

ALERTNAMES = {
    "stragglers": "RankwatchStraggler",
    "links": "RankwatchSlowLink",
    "hangs": "RankwatchHang",
    "anomalies": "RankwatchTrainingAnomaly",
    "power": "RankwatchPowerRecommendation",
    "rollbacks": "RankwatchJobStopped",
    "failures": "RankwatchRankFailed",
    "collector": "RankwatchCollector",
}
FALLBACK_ALERTNAME = "RankwatchFinding"  # an analyzer without a rule of its own still alerts
GROUP_BY = ("alertname", "run")  # the labels one notification's alerts share
# The dashboard page (rankwatch dashboard, dashboard/app.py) that shows each analyzer's findings;
# others link to the overview.
PAGES = {
    "stragglers": "stragglers",
    "links": "collectives",
    "hangs": "hangs",
    "anomalies": "checkpoints",
    "rollbacks": "checkpoints",
    "power": "power",
}
# Evidence an analyzer's alerts carry as labels besides the finding's own, for receivers to route on (the host
# to drain, the cause to page on)
EVIDENCE_LABELS = {"failures": ("rank", "host", "cause")}
_SEVERITY_RANK = {WARNING: 0, CRITICAL: 1}
_RANGES_SHOWN = 4  # a long rank list is cut after this many ranges: labels stay short

# Prometheus' label-set fingerprint (FNV-1a 64 over sorted names and values, 0xff between),
# which Alertmanager puts in its webhooks: the same alert has the same fingerprint in both.
_FNV_OFFSET, _FNV_PRIME, _SEPARATOR = 14695981039346656037, 1099511628211, 0xFF


def alertname(analyzer: str) -> str:
    return ALERTNAMES.get(analyzer, FALLBACK_ALERTNAME)


def labels(
    run_id: str, analyzer: str, kind: str, ranks: list[int], severity: str, evidence: Mapping | None = None
) -> dict[str, str]:
    """An alert's labels; no `run` for the collector's own findings (run "": Alertmanager, like
    Prometheus, treats an empty label as none); the analyzer's EVIDENCE_LABELS where its evidence has them."""
    given = evidence or {}
    told = {key: str(given[key]) for key in EVIDENCE_LABELS.get(analyzer, ()) if given.get(key) is not None}
    return {
        "alertname": alertname(analyzer),
        **({"run": run_id} if run_id else {}),
        "analyzer": analyzer,
        "kind": kind,
        "severity": severity,
        "ranks": short_ranks(ranks),
        **told,
    }


def group_labels(alert_labels: dict[str, str]) -> dict[str, str]:
    return {k: alert_labels[k] for k in GROUP_BY if k in alert_labels}


def dashboard_link(dashboard_url: str, run_id: str, analyzer: str, finding_id: int) -> str:
    """The dashboard page of the analyzer's findings, on the run (its `run` parameter picks it);
    the dashboard's front page for the collector's own findings, which no run has."""
    if not run_id:
        return f"{dashboard_url.rstrip('/')}/"
    query = urlencode({"run": run_id, "finding": finding_id}, quote_via=quote)
    return f"{dashboard_url.rstrip('/')}/{PAGES.get(analyzer, '')}?{query}"


def annotations(summary: str, link: str, evidence: Mapping | None = None) -> dict[str, str]:
    """What an alert says: the finding's summary, its dashboard page, and where its evidence has where every
    rank is (a hang's `stacks`, once every rank asked answered or its request settled), those lines, with what
    the ranks' Flight Recorder entries say matched across ranks (`flight_recorder`), where they held any."""
    told = {"summary": summary, "dashboard": link}
    merged = (evidence or {}).get("stacks")
    if isinstance(merged, Mapping) and merged.get("settled") and merged.get("groups"):
        told["stacks"] = "\n".join(stacks.lines(merged))
        if isinstance(recorder := (evidence or {}).get("flight_recorder"), Mapping):
            from collector.analysis import recorded  # (the matchers: read for a hang's alert alone)

            told["flight_recorder"] = "\n".join(recorded.lines(recorder))
    return told


def escalates(severity: str, to: str) -> bool:
    """Whether a firing alert of `severity` is raised again at `to` (only ever upwards, so a
    finding near a threshold cannot flap between pages)."""
    return _SEVERITY_RANK.get(to, 0) > _SEVERITY_RANK.get(severity, 0)


def short_ranks(ranks: list[int]) -> str:
    """Ranks as ranges, "24-31" or "3,7,9-11", cut to a few ranges ("... +N" says how many more
    ranks); "none" for a finding about the whole job."""
    ranges = ranksets.ranges(ranks)
    text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges[:_RANGES_SHOWN])
    rest = sum(b - a + 1 for a, b in ranges[_RANGES_SHOWN:])
    return (text + (f"... +{rest}" if rest else "")) or "none"


def fingerprint(alert_labels: dict[str, str]) -> str:
    """16 hex digits identifying the label set, as Prometheus and Alertmanager compute it."""
    h = _FNV_OFFSET
    for name in sorted(alert_labels):
        for part in (name, alert_labels[name]):
            for byte in part.encode() + bytes([_SEPARATOR]):
                h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"
