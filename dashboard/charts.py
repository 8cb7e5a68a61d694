"""The dashboard's charts, as Altair specs built from the already-aggregated frames of
dashboard/queries.py (Vega-Lite draws them in the browser)."""

import altair as alt
import numpy as np
import pandas as pd

from collector import quantities
from rankwatch.agent import semconv as sc

NUMBER = ",.4~r"  # axes and tooltips: 416.5, 0.1234, 41,150 (never 416.500000, nor 4.115e+4)
SIGNIFICANT = ",.3~r"  # a measured figure's three significant digits: 0.0234, 412, 1,230
FEW_RANKS = 32  # up to this many ranks a per-rank chart is bars, one per rank
# A value axis spans at least this fraction of its values' size: a flat series with float noise on it
# (a gradient norm of 1.15 +- 1e-7) is drawn flat, not zig-zagging between two ticks both labelled 1.15.
MIN_SPAN = 0.01
# A value axis of a per-step series leaves out the few values that stand far apart from the rest (at most
# OUTLIER_SHARE of them, at least one): those whose gap to the rest is wider than the rest's whole span and
# than OUTLIER_GAP of the rest's size. A loss spike of 100 (or two) among values of 3 to 11 is a mark at the
# axis' edge, not an axis that flattens the curve; a falling curve's first steps, or a bump on a flat series,
# stay on it. The rest span the axis, ROBUST_MARGIN of their span wider at each end.
OUTLIER_SHARE = 0.05
OUTLIER_GAP = 0.5
ROBUST_MARGIN = 0.1
STEP_SERIES_NAMES = {
    "step_s": "step time",
    "data_s": "data (input wait)",
    "compute_s": "compute",
    "comm_wait_s": "exposed comm",
}
# Fit the container's width, keep the height asked for: Streamlit fits a chart's whole height otherwise, and
# a legend under it shrank a 220 px chart to a 60 px plot.
FIT_WIDTH = alt.AutoSizeParams(type="fit-x", contains="padding")
PHASE_COLORS = alt.Scale(
    domain=["data", "compute", "exposed comm", "forward", "backward", "optimizer", "all_reduce"],
    range=["#9ecae1", "#3182bd", "#e6550d", "#6baed6", "#08519c", "#74c476", "#fd8d3c"],
)


def value_scale(*values: pd.Series) -> alt.Scale:
    """The scale of a value axis: the values' own range, zero left out, but at least MIN_SPAN of their
    size wide, centred on them."""
    finite = np.concatenate([pd.to_numeric(v, errors="coerce").to_numpy(float) for v in values] or [np.empty(0)])
    finite = finite[np.isfinite(finite)]
    if not finite.size:
        return alt.Scale(zero=False)
    lo, hi = float(finite.min()), float(finite.max())
    span = MIN_SPAN * max(abs(lo), abs(hi))
    if hi - lo >= span:
        return alt.Scale(zero=False)
    middle = (lo + hi) / 2
    return alt.Scale(zero=False, domain=[middle - span / 2, middle + span / 2])


def _sized(chart, height: int | alt.Step):
    """`chart` as tall as `height` (its plot's height, legend and axes apart), as wide as its container."""
    return chart.properties(height=height, autosize=FIT_WIDTH)


def _step_axis() -> alt.Axis:
    """An axis of steps: whole steps only, never a tick at step 1.5."""
    return alt.Axis(format="d", tickMinStep=1)


def _x(wall_clock: bool) -> alt.X:
    """The time axis of a per-step chart: steps, or when they ended (UTC)."""
    if wall_clock:
        return alt.X("end_ts:T", title="time (UTC)", axis=alt.Axis(format="%H:%M:%S"))
    return alt.X("step:Q", title="step", axis=_step_axis())


def step_times(series: pd.DataFrame, wall_clock: bool = False) -> alt.Chart:
    """Median step time, input wait, compute and exposed communication over the run, by step or by
    wall clock; drag to zoom in on a stretch of time, double-click to zoom out."""
    long = series.melt(["step", "end_ts"], list(STEP_SERIES_NAMES), "what", "seconds").dropna()
    long["what"] = long["what"].map(STEP_SERIES_NAMES)
    chart = (
        alt.Chart(long)
        .mark_line()
        .encode(
            x=_x(wall_clock),
            y=alt.Y("seconds:Q", title="seconds (median rank)", axis=alt.Axis(format=NUMBER)),
            color=alt.Color(
                "what:N", title=None, sort=list(STEP_SERIES_NAMES.values()), legend=alt.Legend(orient="bottom")
            ),
            tooltip=[
                alt.Tooltip("step:Q", format="d"),
                alt.Tooltip("end_ts:T", title="ended", format="%H:%M:%S"),
                "what",
                alt.Tooltip("seconds:Q", format=NUMBER),
            ],
        )
    )
    return _sized(chart, 260).interactive(bind_y=False)


def compare(series: pd.DataFrame, x: str, value: str, title: str, x_title: str, whole: bool = False) -> alt.Chart:
    """Runs overlaid (a `run` column tells them apart), zoomable along x; `whole`: x is whole steps."""
    chart = (
        alt.Chart(series.dropna(subset=[value]))
        .mark_line()
        .encode(
            x=alt.X(f"{x}:Q", title=x_title, axis=_step_axis() if whole else alt.Axis(format=NUMBER)),
            y=alt.Y(f"{value}:Q", title=title, scale=value_scale(series[value]), axis=alt.Axis(format=NUMBER)),
            color=alt.Color("run:N", title=None, legend=alt.Legend(orient="bottom")),
            tooltip=[
                "run",
                alt.Tooltip(f"{x}:Q", format="d" if whole else NUMBER),
                alt.Tooltip(f"{value}:Q", format=NUMBER),
            ],
        )
    )
    return _sized(chart, 220).interactive(bind_y=False)


def heatmap(cells: pd.DataFrame) -> alt.Chart:
    """Rank x step cells coloured by own time over the step's median: a straggler is a row that glows.
    A cell spans its first rank (step) to its last, each a whole unit centred on its number, so a
    rank's row sits on its tick and the axes end at the last rank and step, not one past them."""
    top = max(1.1, float(cells["ratio"].quantile(0.999)))
    edges = cells.assign(
        step_from=cells["step_lo"] - 0.5,
        step_to=cells["step_hi"] + 0.5,
        rank_from=cells["rank_lo"] - 0.5,
        rank_to=cells["rank_hi"] + 0.5,
    )
    whole = alt.Scale(nice=False, zero=False)
    chart = (
        alt.Chart(edges)
        .mark_rect()
        .encode(
            x=alt.X("step_from:Q", title="step", scale=whole, axis=_step_axis()),
            x2="step_to",
            y=alt.Y("rank_from:Q", title="rank", sort="descending", scale=whole, axis=_step_axis()),
            y2="rank_to",
            color=alt.Color(
                "ratio:Q",
                title="own time / median",
                scale=alt.Scale(scheme="magma", domain=[0.9, top], clamp=True),
            ),
            tooltip=[
                alt.Tooltip("worst_rank:Q", title="worst rank"),
                alt.Tooltip("worst_step:Q", title="at step"),
                alt.Tooltip("ratio:Q", format=".2f"),
                alt.Tooltip("rank_lo:Q", title="ranks from", format="d"),
                alt.Tooltip("rank_hi:Q", title="to", format="d"),
                alt.Tooltip("step_lo:Q", title="steps from", format="d"),
                alt.Tooltip("step_hi:Q", title="to", format="d"),
            ],
        )
    )
    return _sized(chart, 360)


def timeline(spans: pd.DataFrame) -> alt.Chart:
    """One step of a few ranks: a bar per phase or collective, from the step's first start; phases
    and collectives overlap in time, so each kind has its own lane."""
    chart = (
        alt.Chart(spans)
        .mark_bar(height={"band": 0.8})
        .encode(
            x=alt.X("start_s:Q", title="seconds from the step's start"),
            x2="end_s",
            y=alt.Y("rank:N", title="rank"),
            yOffset=alt.YOffset("kind:N"),  # phases and collectives in lanes of their own
            color=alt.Color("name:N", scale=PHASE_COLORS, legend=alt.Legend(orient="bottom")),
            tooltip=[
                "rank",
                "kind",
                "name",
                alt.Tooltip("start_s:Q", format=".3f"),
                alt.Tooltip("end_s:Q", format=".3f"),
            ],
        )
    )
    return _sized(chart, alt.Step(18))


def busbw(table: pd.DataFrame) -> alt.LayerChart:
    """Median bus bandwidth per collective and size, with the 10th percentile as a tick; three significant
    digits, so a slow link's 0.02 GB/s reads as such, not as 0.0."""
    table = table.assign(size=table["op"] + " " + table["bytes"].map(quantities.data_size))
    base = alt.Chart(table).encode(y=alt.Y("size:N", title=None))
    chart = base.mark_bar().encode(
        x=alt.X("busbw_gbps:Q", title="bus bandwidth, GB/s (median)", axis=alt.Axis(format=NUMBER)),
        tooltip=[
            "op",
            alt.Tooltip("bytes:Q", format=","),
            "group_size",
            "calls",
            alt.Tooltip("busbw_gbps:Q", title="busbw, GB/s", format=SIGNIFICANT),
            alt.Tooltip("busbw_p10_gbps:Q", title="10th percentile, GB/s", format=SIGNIFICANT),
        ],
    ) + base.mark_tick(color="black").encode(x="busbw_p10_gbps:Q")
    return _sized(chart, alt.Step(28))


def by_rank(
    bins: pd.DataFrame, value: str, title: str, band: tuple[str, str] | None = None
) -> alt.LayerChart | alt.Chart:
    """A per-rank value: a bar per rank when the job has few (a 2-rank job has ranks 0 and 1,
    nothing between), else a line over bins of ranks with the bins' spread as a band."""
    tooltip = [
        alt.Tooltip(f"{c}:Q", format="d" if "rank" in c else NUMBER)
        for c in bins.columns
        if c != "metric" and pd.api.types.is_numeric_dtype(bins[c])
    ]
    y = alt.Y(f"{value}:Q", title=title, axis=alt.Axis(format=NUMBER))
    if len(bins) <= FEW_RANKS:
        bars = (
            alt.Chart(bins)
            .mark_bar()
            .encode(
                x=alt.X("rank_lo:O", title="rank", axis=alt.Axis(labelAngle=0)),
                y=y,
                tooltip=tooltip,
            )
        )
        return _sized(bars, 220)
    x = alt.X("rank_lo:Q", title="rank", axis=alt.Axis(format="d", tickMinStep=1), scale=alt.Scale(nice=False))
    line = (
        alt.Chart(bins)
        .mark_line(point=len(bins) <= 64)
        .encode(
            x=x,
            y=alt.Y(f"{value}:Q", title=title, scale=value_scale(bins[value]), axis=alt.Axis(format=NUMBER)),
            tooltip=tooltip,
        )
    )
    if band is None:
        return _sized(line, 220)
    area = alt.Chart(bins).mark_area(opacity=0.25).encode(x=x, y=f"{band[0]}:Q", y2=f"{band[1]}:Q")
    return _sized(area + line, 220)


def robust_range(values: pd.Series) -> tuple[float, float] | None:
    """The span of a value axis that leaves out values standing far apart from the rest (a spike; see
    OUTLIER_SHARE), as (low, high); None where no value does, and the axis takes them all (`value_scale`)."""
    v = np.sort(pd.to_numeric(values, errors="coerce").to_numpy(float))
    v = v[np.isfinite(v)]
    n = len(v)
    if n < 3:
        return None
    most = max(1, int(OUTLIER_SHARE * n))

    def apart(gap: float, rest: np.ndarray) -> bool:
        return gap > rest[-1] - rest[0] and gap > OUTLIER_GAP * np.abs(rest).max()

    top = max((k for k in range(1, most + 1) if apart(v[n - k] - v[n - k - 1], v[: n - k])), default=0)
    inner = v[: n - top]
    bottom = max((k for k in range(1, most + 1) if apart(inner[k] - inner[k - 1], inner[k:])), default=0)
    if not top and not bottom:
        return None
    low, high = float(inner[bottom]), float(inner[-1])
    margin = max(ROBUST_MARGIN * (high - low), MIN_SPAN * max(abs(low), abs(high)) / 2)
    return low - margin, high + margin


def with_markers(series: pd.DataFrame, value: str, markers: pd.DataFrame, rolled_back: pd.DataFrame) -> alt.LayerChart:
    """A per-step value (dark line) with the values of the steps rollbacks abandoned (red points: a
    spike that was rolled back is no longer on the line) and vertical rules where anomalies,
    rollbacks and checkpoints on disk happened, in colours apart from both. The value axis spans the
    values' robust range (`robust_range`): values beyond it are triangles at its edge, their values
    in their tooltips."""
    abandoned_values = rolled_back[value] if value in rolled_back else pd.Series(dtype=float)
    clipped = robust_range(pd.concat([series[value], abandoned_values], ignore_index=True))
    scale = value_scale(series[value], abandoned_values) if clipped is None else alt.Scale(domain=list(clipped))
    x, y = _x(False), alt.Y(f"{value}:Q", title=value, scale=scale, axis=alt.Axis(format=NUMBER))
    tooltip = [alt.Tooltip("step:Q", format="d"), alt.Tooltip(f"{value}:Q", format=NUMBER)]
    line = (
        alt.Chart(series.dropna(subset=[value])).mark_line(color="#333333", clip=True).encode(x=x, y=y, tooltip=tooltip)
    )
    abandoned = (
        alt.Chart(rolled_back.dropna(subset=[value]).assign(what="rolled back"))
        .mark_point(color="#d62728", filled=True, size=40, clip=True)
        .encode(x=x, y=y, tooltip=[*tooltip, "what:N"])
    )
    rules = (
        alt.Chart(markers)
        .mark_rule(strokeDash=[4, 3])
        .encode(
            x="step:Q",
            color=alt.Color("marker:N", scale=alt.Scale(scheme="dark2"), legend=alt.Legend(orient="bottom")),
            tooltip=[alt.Tooltip("step:Q", format="d"), "marker:N", "detail:N"],
        )
    )
    layers = [line, abandoned, rules]
    if clipped is not None:
        low, high = clipped
        drawn = pd.concat(
            [
                series[["step", value]].assign(what="beyond the axis", colour="#333333"),
                rolled_back.reindex(columns=["step", value]).assign(
                    what="rolled back, beyond the axis", colour="#d62728"
                ),
            ],
            ignore_index=True,
        ).dropna(subset=[value])
        beyond = drawn[(drawn[value] < low) | (drawn[value] > high)]
        edges = beyond.assign(
            at=beyond[value].clip(low, high), shape=np.where(beyond[value] > high, "triangle-up", "triangle-down")
        )
        layers.append(
            alt.Chart(edges)
            .mark_point(filled=True, size=70, opacity=1)
            .encode(
                x=x,
                y=alt.Y("at:Q", title=value, scale=scale),
                shape=alt.Shape("shape:N", scale=None, legend=None),
                color=alt.Color("colour:N", scale=None, legend=None),
                tooltip=[*tooltip, "what:N"],
            )
        )
    return _sized(alt.layer(*layers), 260)


def tradeoff(curve: pd.DataFrame, picked_w: float) -> alt.LayerChart:
    """The job's time/energy trade-off, one point per power limit (the job-cap finding's curve):
    energy saved against step time lost, the policy's pick ringed."""
    points = curve.assign(
        slowdown_pct=100 * (curve["slowdown"] - 1),
        saving_pct=100 * curve["energy_saving"],
        picked=curve["cap_w"] == picked_w,
    )
    base = alt.Chart(points).encode(
        x=alt.X("slowdown_pct:Q", title="step time, % longer"),
        y=alt.Y("saving_pct:Q", title="energy per step, % less"),
        tooltip=[
            alt.Tooltip("cap_w:Q", title="limit, W"),
            alt.Tooltip("slowdown_pct:Q", format="+.1f"),
            alt.Tooltip("saving_pct:Q", format=".1f"),
        ],
    )
    return _sized(
        base.mark_line(point=True)
        + base.mark_point(size=250, color="#e6550d").transform_filter("datum.picked")
        + base.mark_text(dy=-10, fontSize=10).encode(text="cap_w:Q"),
        260,
    )


def top_ranks(values: pd.Series, title: str, top: int) -> alt.Chart:
    """The `top` ranks with the highest values, highest first, a bar each (the rest of a 1,024-rank
    job is said in words beside it)."""
    ranked = values.sort_values(ascending=False).head(top).rename_axis("rank").reset_index(name="value")
    chart = (
        alt.Chart(ranked)
        .mark_bar()
        .encode(
            x=alt.X("value:Q", title=title, axis=alt.Axis(format=NUMBER)),
            y=alt.Y("rank:N", title="rank", sort=None),  # the frame's order: highest first
            tooltip=["rank", alt.Tooltip("value:Q", format=NUMBER)],
        )
    )
    return _sized(chart, alt.Step(18))


# What a finding's chart against peers draws, by the phase it blames: its ranks' time in it, their peers', the step
SUSPECT_SERIES_NAMES = {
    sc.KIND_DATA: {"suspects_data_s": "their input wait", "peers_data_s": "peers' input wait", "step_s": "step time"},
    sc.KIND_COMPUTE: {
        "suspects_compute_s": "their compute",
        "peers_compute_s": "peers' compute",
        "step_s": "step time",
    },
}


def suspects_vs_peers(series: pd.DataFrame, onset: int, phase: str) -> alt.LayerChart:
    """A finding's ranks against their peers over its episode (and the steps before it): their median time
    in the `phase` the finding blames (input wait, or compute), the others', and the median step time, a
    rule at the onset the finding states."""
    names = SUSPECT_SERIES_NAMES[phase]
    long = series.melt("step", list(names), "what", "seconds").dropna()
    long["what"] = long["what"].map(names)
    base = alt.Chart(long)
    lines = base.mark_line().encode(
        x=_x(False),
        y=alt.Y("seconds:Q", title="seconds (median)", axis=alt.Axis(format=NUMBER)),
        color=alt.Color("what:N", title=None, sort=list(names.values()), legend=alt.Legend(orient="bottom")),
        tooltip=[alt.Tooltip("step:Q", format="d"), "what", alt.Tooltip("seconds:Q", format=NUMBER)],
    )
    rule = base.transform_sample(1).mark_rule(strokeDash=[4, 3], color="#888").encode(x=alt.datum(onset))
    return _sized(lines + rule, 200)


def by_step(series: dict[str, pd.Series], title: str) -> alt.Chart:
    """Per-step values of a finding, a line each, named where there are several in one unit (a spike
    and the steps around it; a job's compute measured against its prediction)."""
    frame = pd.concat(
        [values.rename_axis("step").reset_index(name="value").assign(what=name) for name, values in series.items()],
        ignore_index=True,
    )
    chart = (
        alt.Chart(frame)
        .mark_line(point=True)
        .encode(
            x=_x(False),
            y=alt.Y("value:Q", title=title, scale=value_scale(frame["value"]), axis=alt.Axis(format=NUMBER)),
            tooltip=[alt.Tooltip("step:Q", format="d"), alt.Tooltip("value:Q", format=NUMBER), "what"],
        )
    )
    return _sized(chart.encode(color=alt.Color("what:N", title=None)) if len(series) > 1 else chart, 180)
