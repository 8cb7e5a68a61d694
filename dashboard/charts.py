"""The dashboard's charts, as Altair specs built from the already-aggregated frames of
dashboard/queries.py (Vega-Lite draws them in the browser)."""

import altair as alt
import numpy as np
import pandas as pd

NUMBER = ",.4~g"  # axes and tooltips: 416.5, 0.1234, 12,500 (never 416.500000)
FEW_RANKS = 32  # up to this many ranks a per-rank chart is bars, one per rank
# A value axis spans at least this fraction of its values' size: a flat series with float noise on it
# (a gradient norm of 1.15 +- 1e-7) is drawn flat, not zig-zagging between two ticks both labelled 1.15.
MIN_SPAN = 0.01
STEP_SERIES_NAMES = {"step_s": "step time", "compute_s": "compute", "comm_wait_s": "exposed comm"}
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


def _x(wall_clock: bool) -> alt.X:
    """The time axis of a per-step chart: steps, or when they ended (UTC)."""
    if wall_clock:
        return alt.X("end_ts:T", title="time (UTC)", axis=alt.Axis(format="%H:%M:%S"))
    return alt.X("step:Q", title="step", axis=alt.Axis(format="d", tickMinStep=1))


def step_times(series: pd.DataFrame, wall_clock: bool = False) -> alt.Chart:
    """Median step time, compute and exposed communication over the run, by step or by wall
    clock; drag to zoom in on a stretch of time, double-click to zoom out."""
    long = series.melt(["step", "end_ts"], list(STEP_SERIES_NAMES), "what", "seconds").dropna()
    long["what"] = long["what"].map(STEP_SERIES_NAMES)
    return (
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
                alt.Tooltip("seconds:Q", format=".3f"),
            ],
        )
        .properties(height=260)
        .interactive(bind_y=False)
    )


def compare(series: pd.DataFrame, x: str, value: str, title: str, x_title: str) -> alt.Chart:
    """Runs overlaid (a `run` column tells them apart), zoomable along x."""
    return (
        alt.Chart(series.dropna(subset=[value]))
        .mark_line()
        .encode(
            x=alt.X(f"{x}:Q", title=x_title, axis=alt.Axis(format=NUMBER)),
            y=alt.Y(f"{value}:Q", title=title, scale=value_scale(series[value]), axis=alt.Axis(format=NUMBER)),
            color=alt.Color("run:N", title=None, legend=alt.Legend(orient="bottom")),
            tooltip=["run", alt.Tooltip(f"{x}:Q", format=NUMBER), alt.Tooltip(f"{value}:Q", format=NUMBER)],
        )
        .properties(height=220)
        .interactive(bind_y=False)
    )


def heatmap(cells: pd.DataFrame) -> alt.Chart:
    """Rank x step cells coloured by compute over the step's median: a straggler is a row that glows."""
    top = max(1.1, float(cells["ratio"].quantile(0.999)))
    return (
        alt.Chart(cells)
        .mark_rect()
        .encode(
            x=alt.X("step_lo:Q", title="step", scale=alt.Scale(nice=False, zero=False), axis=alt.Axis(format="d")),
            x2="step_hi",
            y=alt.Y(
                "rank_lo:Q",
                title="rank",
                sort="descending",
                scale=alt.Scale(nice=False, zero=False),
                axis=alt.Axis(format="d"),
            ),
            y2="rank_hi",
            color=alt.Color(
                "ratio:Q", title="compute / median", scale=alt.Scale(scheme="magma", domain=[0.9, top], clamp=True)
            ),
            tooltip=[
                alt.Tooltip("worst_rank:Q", title="worst rank"),
                alt.Tooltip("worst_step:Q", title="at step"),
                alt.Tooltip("ratio:Q", format=".2f"),
                "rank_lo",
                "step_lo",
            ],
        )
        .properties(height=360)
    )


def timeline(spans: pd.DataFrame) -> alt.Chart:
    """One step of a few ranks: a bar per phase or collective, from the step's first start; phases
    and collectives overlap in time, so each kind has its own lane."""
    return (
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
        .properties(height=alt.Step(18))
    )


def busbw(table: pd.DataFrame) -> alt.Chart:
    """Median bus bandwidth per collective and size, with the 10th percentile as a tick."""
    table = table.assign(size=table["op"] + " " + (table["bytes"] / 2**20).round(1).astype(str) + " MiB")
    base = alt.Chart(table).encode(y=alt.Y("size:N", title=None))
    return (
        base.mark_bar().encode(
            x=alt.X("busbw_gbps:Q", title="bus bandwidth, GB/s (median)"),
            tooltip=["op", "bytes", "group_size", "calls", alt.Tooltip("busbw_gbps:Q", format=".1f")],
        )
        + base.mark_tick(color="black").encode(x="busbw_p10_gbps:Q")
    ).properties(height=alt.Step(28))


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
        return (
            alt.Chart(bins)
            .mark_bar()
            .encode(
                x=alt.X("rank_lo:O", title="rank", axis=alt.Axis(labelAngle=0)),
                y=y,
                tooltip=tooltip,
            )
            .properties(height=220)
        )
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
        return line.properties(height=220)
    area = alt.Chart(bins).mark_area(opacity=0.25).encode(x=x, y=f"{band[0]}:Q", y2=f"{band[1]}:Q")
    return (area + line).properties(height=220)


def with_markers(series: pd.DataFrame, value: str, markers: pd.DataFrame, rolled_back: pd.DataFrame) -> alt.LayerChart:
    """A per-step value (dark line) with the values of the steps rollbacks abandoned (red points: a
    spike that was rolled back is no longer on the line) and vertical rules where anomalies,
    rollbacks and checkpoints on disk happened, in colours apart from both."""
    scale = value_scale(series[value], rolled_back[value] if value in rolled_back else pd.Series(dtype=float))
    x, y = _x(False), alt.Y(f"{value}:Q", scale=scale, axis=alt.Axis(format=NUMBER))
    tooltip = [alt.Tooltip("step:Q", format="d"), alt.Tooltip(f"{value}:Q", format=NUMBER)]
    line = alt.Chart(series.dropna(subset=[value])).mark_line(color="#333333").encode(x=x, y=y, tooltip=tooltip)
    abandoned = (
        alt.Chart(rolled_back.dropna(subset=[value]).assign(what="rolled back"))
        .mark_point(color="#d62728", filled=True, size=40)
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
    return (line + abandoned + rules).properties(height=260)


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
    return (
        base.mark_line(point=True)
        + base.mark_point(size=250, color="#e6550d").transform_filter("datum.picked")
        + base.mark_text(dy=-10, fontSize=10).encode(text="cap_w:Q")
    ).properties(height=260)


def top_ranks(values: pd.Series, title: str, top: int) -> alt.Chart:
    """The `top` ranks with the highest values, highest first, a bar each (the rest of a 1,024-rank
    job is said in words beside it)."""
    ranked = values.sort_values(ascending=False).head(top).rename_axis("rank").reset_index(name="value")
    return (
        alt.Chart(ranked)
        .mark_bar()
        .encode(
            x=alt.X("value:Q", title=title, axis=alt.Axis(format=NUMBER)),
            y=alt.Y("rank:N", title="rank", sort=None),  # the frame's order: highest first
            tooltip=["rank", alt.Tooltip("value:Q", format=NUMBER)],
        )
        .properties(height=alt.Step(18))
    )


SUSPECT_SERIES_NAMES = {"suspects_s": "their compute", "peers_s": "peers' compute", "step_s": "step time"}


def suspects_vs_peers(series: pd.DataFrame, onset: int) -> alt.LayerChart:
    """A finding's ranks against their peers over its episode (and the steps before it): their median
    compute, the others', and the median step time, a rule at the onset the finding states."""
    long = series.melt("step", list(SUSPECT_SERIES_NAMES), "what", "seconds").dropna()
    long["what"] = long["what"].map(SUSPECT_SERIES_NAMES)
    base = alt.Chart(long)
    lines = base.mark_line().encode(
        x=_x(False),
        y=alt.Y("seconds:Q", title="seconds (median)", axis=alt.Axis(format=NUMBER)),
        color=alt.Color(
            "what:N", title=None, sort=list(SUSPECT_SERIES_NAMES.values()), legend=alt.Legend(orient="bottom")
        ),
        tooltip=[alt.Tooltip("step:Q", format="d"), "what", alt.Tooltip("seconds:Q", format=".3f")],
    )
    rule = base.transform_sample(1).mark_rule(strokeDash=[4, 3], color="#888").encode(x=alt.datum(onset))
    return (lines + rule).properties(height=200)


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
        .properties(height=180)
    )
    return chart.encode(color=alt.Color("what:N", title=None)) if len(series) > 1 else chart
