"""What every page shares: the source, cached query results, the chosen run, widgets a link can
set, how a finding is shown (the answer in one line, its evidence one click away), and stored text
shown as written where Streamlit reads Markdown."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pandas as pd
import streamlit as st

from collector import quantities, ranksets
from collector.reports import runs as run_states
from collector.reports.runs import SILENT_S, RunStatus, clock
from collector.store.schema import ENDED, ROLLED_BACK, TRACE_ENDED
from dashboard import charts, evidence, queries, source, units
from dashboard.markdown import literal, literal_table
from dashboard.source import QueryFailed
from rankwatch.agent import semconv as sc
from rankwatch.agent.config import ANALYZE_EVERY_S

T = TypeVar("T")

CACHE_TTL_S = 2.0  # short: a live run changes every few seconds, and a page reads each query once
LIVE_REFRESH_S = ANALYZE_EVERY_S  # how often live parts of a page re-read a running collector (its analysis period)
RANK_BINS, STEP_BINS, POINTS = 128, 120, 400  # what a chart gets at most, however large the job
LEAD_STEPS = 10  # steps before a finding's onset its chart against peers shows, at least
SIMULATED = " · simulated"  # after the label of a figure drawn from simulated GPUs' samples
# A rank's figures in a table, as the Stragglers and the Ranks & nodes pages show them (its times `in_ms`)
RANK_COLUMNS = {
    "time_ratio": st.column_config.NumberColumn(
        "own time / median", format="%.3f", help="input wait and compute, over the step's median rank's"
    ),
    "data_ms": st.column_config.NumberColumn("input wait, ms", format="%.1f"),
    "compute_ms": st.column_config.NumberColumn("compute, ms", format="%.1f"),
    "comm_wait_ms": st.column_config.NumberColumn("exposed comm, ms", format="%.1f"),
    "step_ms": st.column_config.NumberColumn("step, ms", format="%.1f"),
    "watts": st.column_config.NumberColumn("power, W", format="%.0f"),
}
ONE_PROCESS = "One process: cross-rank analyses do not apply."  # said once, where a page would compare ranks
EVERY_STEP = (-(2**62), 2**62)  # a window with no bound: one open at the top follows a live run's newest step
STRAGGLERS_PAGE = "views/stragglers.py"  # takes ?ranks= (a rank filter) and ?step= (the timeline's step)


@st.cache_resource(show_spinner=False)
def data_source() -> source.Source:
    return source.from_environment()


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def _cached(label: str, name: str, params: tuple) -> pd.DataFrame:
    return source.to_frame(data_source().query(queries.QUERIES[name], dict(params)))


def frame(name: str, **params) -> pd.DataFrame:
    """A named query's rows (dashboard/queries.py); a failure stops the page with its reason."""
    try:
        return _cached(data_source().label, name, tuple(sorted(params.items())))
    except QueryFailed as e:
        st.error(f"Query {name} failed: {literal(e)}")
        st.stop()


def live_every() -> float | None:
    """The refresh period of live fragments: a collector's data moves, a stopped store's does not."""
    return LIVE_REFRESH_S if isinstance(data_source(), source.CollectorSource) else None


def not_live_because(run: str) -> str | None:
    """Why the run cannot be acted on now, in a few words; None for a live run. Present-tense
    figures ("Power now") and advice the job would have to apply (power caps) are for live runs
    only: one that ended, is hung, went silent, or is read from a store no collector writes."""
    row = frame("run_activity", run=run).iloc[0]
    if row["ranks"] and row["ended_ranks"] >= row["ranks"]:
        return "the run has ended"
    if row["hung"]:
        return "the run is hung"
    if row["imported"]:
        return "the run is an imported trace"
    if not isinstance(data_source(), source.CollectorSource):
        return "no collector is writing this store"
    if pd.isna(row["last_seen"]) or (now() - row["last_seen"]).total_seconds() > SILENT_S:
        return "the run has gone silent"
    return None


@dataclass(frozen=True)
class PowerFigure:
    """The job's power as a metric shows it."""

    label: str  # "Power now" for a live run, else "Last power"; SIMULATED after it where the GPUs are
    value: str
    help: str  # what it sums, and as of when
    simulated: bool
    as_of: pd.Timestamp | None


def power_figure(run: str, live: bool) -> PowerFigure:
    """The job's power at its newest samples (dashboard/queries.py POWER_NOW)."""
    row = frame("power_now", run=run).iloc[0]
    if pd.isna(row["watts"]):
        return PowerFigure("Power", "—", "no power samples", False, None)
    simulated = bool(row["simulated"])
    return PowerFigure(
        ("Power now" if live else "Last power") + (SIMULATED if simulated else ""),
        quantities.power(row["watts"]),
        f"{quantities.plural(int(row['ranks']), 'rank')}, each one's mean over its newest minute of samples, "
        f"summed, as of {row['as_of']:%Y-%m-%d %H:%M:%S} UTC"
        + ("; simulated GPUs (rankwatch's GPU model), not measured hardware" if simulated else ""),
        simulated,
        row["as_of"],
    )


@dataclass(frozen=True)
class GpuSamples:
    """Whether a run sent GPU samples (NVML's or a simulated GPU's), and whether any is simulated: figures
    drawn from simulated GPUs say so, and a run without GPU samples shows no GPU figure at all."""

    sent: bool
    simulated: bool


def gpu_samples(run: str) -> GpuSamples:
    """The run's GPU samples: whether there are any, and whether any is simulated (dashboard/queries.py)."""
    row = frame("gpu_samples", run=run).iloc[0]
    return GpuSamples(bool(row["gpus"]), bool(row["simulated"]))


def one_process(run: str) -> bool:
    """Whether the run is one process (its world, or the ranks it sent, one): no peers to compare it with."""
    runs = frame("runs")
    return bool((runs.loc[runs["run_id"] == run, "ranks"] == 1).any())


def in_ms(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with its durations (columns `*_s`) in milliseconds (`*_ms`), as a rank's phases read: an input
    wait of 0.4 ms, not 0.000 s."""
    seconds = [c for c in table.columns if c.endswith("_s")]
    shown = table.assign(**{c: table[c] * 1e3 for c in seconds})
    return shown.rename(columns={c: c.removesuffix("_s") + "_ms" for c in seconds})


def capitalized(text: str) -> str:
    """A phrase as a sentence starts: its first letter up, the rest as written ("rank 3 …" → "Rank 3 …")."""
    return text[:1].upper() + text[1:]


def picked_run() -> None:
    """The link names the run picked; another run's window of steps (`step_window`) is not this one's."""
    st.query_params.pop("steps", None)
    st.query_params["run"] = st.session_state["run"]


def current_run() -> str:
    """The run chosen in the sidebar (app.py makes sure there is one)."""
    return st.session_state["run"]


def now() -> pd.Timestamp:
    """The time the pages judge silence against."""
    return pd.Timestamp.now(tz="UTC")


def run_status(row: pd.Series, at: pd.Timestamp | None = None) -> RunStatus:
    """A run's status from its row of the `runs` query (collector/reports/runs.py), judged now unless `at`."""
    return run_states.run_status(row, isinstance(data_source(), source.CollectorSource), now() if at is None else at)


def runs_table(runs: pd.DataFrame) -> pd.DataFrame:
    """The run list: each run's status, duration, ranks and worst finding ever."""
    statuses = [run_status(row) for _, row in runs.iterrows()]
    return pd.DataFrame(
        {
            "run": runs["run_id"],
            "status": [s.words for s in statuses],
            "duration": [s.duration for s in statuses],
            "ranks": runs["ranks"],
            "last step": runs["last_step"],
            "worst finding": runs["worst"].fillna("none"),
        }
    )


def linked_finding() -> int | None:
    """The finding an alert's link names (`?finding=ID`), shown first on its page."""
    wanted = st.query_params.get("finding")
    return int(wanted) if wanted is not None and wanted.isdigit() else None


def finding_cost(row: pd.Series) -> str | None:
    """What a finding costs the job, from its evidence, where the analyzer measured it: the time the other
    ranks wait out per step (`lost_s_per_step`)."""
    measured = row["evidence"] or {}
    if measured.get("lost_s_per_step") is None:
        return None
    hours = measured.get("gpu_hours_lost")
    # as the analyzer's summary beside it writes small figures (0.001), whole hours past ten
    so_far = "" if hours is None else f", {hours:,.{3 if hours < 10 else 0}f} GPU-hours so far"
    return (
        f"Costs **{quantities.duration(measured['lost_s_per_step'])} per step** "
        f"({measured.get('lost_percent', 0):.1f}% of the step time){so_far}: the other ranks wait it out."
    )


def outcome(row: pd.Series) -> str:
    """How a finding that no longer fires ended: held to the run's (or the imported trace's) end,
    undone by a rollback, or over."""
    why = (row["evidence"] or {}).get("resolved")
    if row["state"] == ENDED:
        return "held to the trace's end" if why == TRACE_ENDED else "held to the run's end"
    if why == ROLLED_BACK:
        return "rolled back"
    return "resolved" if pd.isna(row["step_end"]) else f"resolved after step {int(row['step_end'])}"


def worst_first(findings: pd.DataFrame) -> pd.DataFrame:
    """Findings by how bad: a rank's failure first (it ended the job, whatever else went wrong), then critical
    ones, then by the GPU-hours they cost, then by their score."""
    hours = findings["evidence"].map(lambda e: (e or {}).get("gpu_hours_lost") or 0.0)
    order = pd.DataFrame(
        {
            "failed": findings["analyzer"] == "failures",
            "critical": findings["severity"] == "critical",
            "hours": hours,
            "score": findings["score"],
        }
    )
    return findings.loc[order.sort_values(["failed", "critical", "hours", "score"], ascending=False).index]


def show_finding(row: pd.Series, expanded: bool = False) -> None:
    """One finding: severity, ranks and summary (which says the cost) as the answer; evidence,
    steps and times behind an expander (open when `expanded`)."""
    where = f" on {ranksets.phrase(row['ranks'])}" if len(row["ranks"]) else ""
    head = f"**{row['analyzer']} / {row['kind']}**{where}: {literal(row['summary'])}"
    if row["state"] != "firing":
        st.info(f"{outcome(row)}: {head}")
    elif row["severity"] == "info":
        st.info(head)
    elif row["severity"] == "critical":
        st.error(head)
    else:
        st.warning(head)
    show_evidence(row, expanded)


def show_evidence(row: pd.Series, expanded: bool = False, label: str | None = None) -> None:
    """A finding's evidence behind an expander (`label`, else one naming the finding): what to do, a link to
    its ranks and steps on the Stragglers page, its figures in units, its per-rank values as the top ranks,
    its series and records, said to be simulated where they come from simulated GPUs; the raw JSON only as a
    download (a 1,024-rank map is 1,024 lines of floats)."""
    with st.expander(label or f"evidence of finding {row['id']}", expanded=expanded):
        score = "-" if pd.isna(row["score"]) else f"{row['score']:.2f}"
        steps = "" if pd.isna(row["step_start"]) else f"steps {int(row['step_start'])}-{int(row['step_end'])}, "
        st.caption(
            f"{row['analyzer']} / {row['kind']}, finding {row['id']}: {steps}score {score}, first seen "
            f"{row['created_at']:%Y-%m-%d %H:%M:%S}, last {row['updated_at']:%H:%M:%S} UTC"
        )
        if todo := evidence.next_step(row):
            st.markdown(f"**What to do:** {todo}")
        _link_to_stragglers(row)
        _against_peers(row)
        raw = row["evidence"] or {}
        if any(key in raw for key in evidence.FROM_DEVICES) and gpu_samples(current_run()).simulated:
            st.info(
                "Its GPU readings come from **simulated GPUs** (rankwatch's GPU model), not from hardware.",
                icon=":material/science:",
            )
        read = evidence.read(raw)
        if not read.figures.empty:
            st.table(literal_table(read.figures.set_index("what")))
        for key, values in read.by_rank:
            title = _titled(key)
            st.altair_chart(charts.top_ranks(values, title, evidence.TOP_RANKS), width="stretch")
            st.caption(f"{title}: the {min(len(values), evidence.TOP_RANKS)} highest ranks")
            if rest := evidence.rest_of_ranks(key, values):
                st.caption(f"and {rest}")
        in_unit: dict[str, list[tuple[str, pd.Series]]] = {}  # series of one unit share a chart (measured, predicted)
        for key, values in read.by_step:
            found = units.unit(key)
            in_unit.setdefault(found.axis if found and found.axis else key, []).append((key, values))
        for axis, members in in_unit.items():
            title = _titled(members[0][0]) if len(members) == 1 else axis
            st.altair_chart(charts.by_step({units.label(k): v for k, v in members}, title), width="stretch")
        for key, table in read.tables:
            st.caption(
                units.label(key)
                + (f", the first {evidence.TABLE_ROWS} of {len(table):,}" if len(table) > evidence.TABLE_ROWS else "")
            )
            st.table(literal_table(table.head(evidence.TABLE_ROWS).set_index(table.columns[0])))
        st.download_button(
            "raw evidence (JSON)",
            json.dumps(raw, indent=1, default=str),
            file_name=f"finding-{row['id']}.json",
            mime="application/json",
            key=f"evidence_json_{row['id']}",
            on_click="ignore",
        )


def _titled(key: str) -> str:
    """An evidence key as a chart's axis title: its words, then the unit of its stored values."""
    found = units.unit(key)
    return units.label(key) + (f", {found.axis}" if found and found.axis else "")


def _against_peers(row: pd.Series) -> None:
    """A slow-rank finding's ranks against their peers, step by step over its episode and as many steps
    before it (at least LEAD_STEPS), so the onset shows; for the stragglers analyzer's findings of
    ranks, which say who is slower than whom."""
    if row["analyzer"] != "stragglers" or not len(row["ranks"]) or pd.isna(row["step_start"]):
        return
    start, end = int(row["step_start"]), int(row["step_end"])
    series = frame(
        "suspects_vs_peers",
        run=current_run(),
        ranks=[int(r) for r in row["ranks"]],
        first=start - max(LEAD_STEPS, end - start),
        last=end,
        points=POINTS,
    )
    phase = sc.KIND_DATA if (row["evidence"] or {}).get("phase") == sc.KIND_DATA else sc.KIND_COMPUTE
    theirs, peers, _ = charts.SUSPECT_SERIES_NAMES[phase]
    if series[theirs].notna().any() and series[peers].notna().any():
        st.altair_chart(charts.suspects_vs_peers(series, start, phase), width="stretch")
        st.caption(
            f"{capitalized(ranksets.phrase(row['ranks']))} against the other ranks, median {evidence.PHASES[phase]} "
            f"per step, from before the onset (the dashed line, step {start}) to step {end}."
        )


def _link_to_stragglers(row: pd.Series) -> None:
    """A link to the finding's ranks (the heatmap's rows, the timeline's slowest) and its first step
    (the timeline) on the Stragglers page, which takes them as `?ranks=` and `?step=`; none for a
    recommendation or a note (severity info), whose ranks are no suspects."""
    if row["severity"] == "info":
        return
    params = {"run": current_run()}
    said = []
    if len(row["ranks"]):
        params["ranks"] = ranksets.typed(row["ranks"])
        said.append(f"the heatmap rows of {ranksets.phrase(row['ranks'])}")
    if pd.notna(row["step_start"]):
        params["step"] = str(int(row["step_start"]))
        said.append(f"the timeline of step {params['step']}")
    if said:
        st.page_link(STRAGGLERS_PAGE, label="See " + " and ".join(said), icon=":material/grid_on:", query_params=params)


def step_window(run: str) -> tuple[int, int]:
    """The steps a page's charts and tables cover (`$first`, `$last` of the queries that take them):
    every step, unless narrowed in the sidebar's slider or by a link's `?steps=A-B`. The window is
    kept per run across pages; one that reaches the run's newest step stays open at the top, so it
    follows a live run's new steps. Its wall-clock span is written under it."""
    bounds = frame("step_range", run=run)
    if bounds.empty or bounds["last"].isna().any() or bounds["first"].iloc[0] == bounds["last"].iloc[0]:
        return EVERY_STEP
    first, last = int(bounds["first"].iloc[0]), int(bounds["last"].iloc[0])
    kept: dict[str, str] = st.session_state.setdefault("step_windows", {})
    text = st.query_params.get("steps", kept.get(run))
    try:
        lo, hi = sorted(int(bound) for bound in (text or "").split("-", 1))
        wanted = (min(max(lo, first), last), max(min(hi, last), first))
        kept[run] = f"{wanted[0]}-{wanted[1]}"
    except ValueError:  # none given, or not two steps
        wanted = (first, last)
    # set on every run: a page's slider is a widget of its own, which starts from this, never from the last page's
    st.session_state["steps"] = wanted

    def written() -> None:
        lo, hi = st.session_state["steps"]
        if (lo, hi) == (first, last):
            st.query_params.pop("steps", None)
            kept.pop(run, None)
        else:
            kept[run] = st.query_params["steps"] = f"{lo}-{hi}"

    lo, hi = st.sidebar.slider(  # type: ignore[misc]  # a range slider: a tuple value gives a tuple back
        "Steps",
        first,
        last,
        key="steps",
        on_change=written,
        help="The window of steps this page's charts and tables cover; a link can set it (`?steps=100-200`).",
    )
    times = frame("step_times", run=run, first=lo, last=hi).iloc[0]
    if pd.notna(times["start_ts"]):
        st.sidebar.caption(f"{clock(times['start_ts'])} to {clock(times['end_ts'])}")
    return (EVERY_STEP[0] if lo == first else lo, EVERY_STEP[1] if hi == last else hi)


def linked(key: str, param: str, default: T, read: Callable[[str], T]) -> Callable[[], None]:
    """Keep widget `key` and the page's `?param=` one, so that a link can set the widget (a rank
    filter, a step): the widget takes the parameter's value (`read` from text; `default` where
    there is none or it does not read) whenever the two differ. Edits are written back by the
    on_change returned, so the two differ only when a link changed the URL."""
    text = st.query_params.get(param)
    try:
        wanted = default if text is None else read(text)
    except ValueError:
        wanted = default
    if st.session_state.get(key) != wanted:
        st.session_state[key] = wanted

    def written() -> None:
        value = st.session_state[key]
        if value == default:
            st.query_params.pop(param, None)
        else:
            st.query_params[param] = str(value)

    return written


def show_findings(findings: pd.DataFrame, empty: str, shown: tuple[int, ...] = ()) -> None:
    """Each finding once: those the page has already shown (`shown`, and the one an alert's link
    put first) are not repeated."""
    if findings.empty:
        st.success(empty)
    for _, row in findings[~findings["id"].isin([*shown, linked_finding()])].iterrows():
        show_finding(row)


def show_linked_finding() -> None:
    """The finding an alert's link names (`?finding=ID`, collector/alerts/rules.py), first on the
    page with its evidence open: whoever followed the page lands on what paged them."""
    wanted = st.query_params.get("finding")
    if wanted is None:
        return
    findings = frame("findings", run=current_run())
    linked = findings[findings["id"] == linked_finding()]
    if linked.empty:
        st.warning(f"The link names finding {literal(wanted)}, which run {literal(current_run())} does not have.")
        return
    st.caption("The finding the link is about:")
    show_finding(linked.iloc[0], expanded=True)
    st.divider()
