"""The dashboard's charts, as Altair specs built from the already-aggregated frames of
dashboard/queries.py (Vega-Lite draws them in the browser)."""

import altair as alt
import pandas as pd

PHASE_COLORS = alt.Scale(domain=["data", "compute", "exposed comm", "forward", "backward", "optimizer", "all_reduce"],
                         range=["#9ecae1", "#3182bd", "#e6550d", "#6baed6", "#08519c", "#74c476", "#fd8d3c"])


def step_times(series: pd.DataFrame) -> alt.Chart:
    """Median step time, compute and exposed communication over the run."""
    long = series.melt("step", ["step_s", "compute_s", "comm_wait_s"], "what", "seconds").dropna()
    return alt.Chart(long).mark_line().encode(
        x=alt.X("step:Q"), y=alt.Y("seconds:Q", title="seconds (median rank)"),
        color=alt.Color("what:N", legend=alt.Legend(orient="bottom")),
        tooltip=["step", "what", alt.Tooltip("seconds:Q", format=".3f")]).properties(height=260)


def heatmap(cells: pd.DataFrame) -> alt.Chart:
    """Rank x step cells coloured by compute over the step's median: a straggler is a row that glows."""
    top = max(1.1, float(cells["ratio"].quantile(0.999)))
    return alt.Chart(cells).mark_rect().encode(
        x=alt.X("step_lo:Q", title="step", scale=alt.Scale(nice=False)), x2="step_hi",
        y=alt.Y("rank_lo:Q", title="rank", sort="descending", scale=alt.Scale(nice=False)), y2="rank_hi",
        color=alt.Color("ratio:Q", title="compute / median", scale=alt.Scale(scheme="magma", domain=[0.9, top],
                                                                             clamp=True)),
        tooltip=[alt.Tooltip("worst_rank:Q", title="worst rank"), alt.Tooltip("worst_step:Q", title="at step"),
                 alt.Tooltip("ratio:Q", format=".2f"), "rank_lo", "step_lo"]).properties(height=360)


def timeline(spans: pd.DataFrame) -> alt.Chart:
    """One step of a few ranks: a bar per phase or collective, from the step's first start; phases
    and collectives overlap in time, so each kind has its own lane."""
    return alt.Chart(spans).mark_bar(height={"band": 0.8}).encode(
        x=alt.X("start_s:Q", title="seconds from the step's start"), x2="end_s", y=alt.Y("rank:N", title="rank"),
        yOffset=alt.YOffset("kind:N"),  # phases and collectives in lanes of their own
        color=alt.Color("name:N", scale=PHASE_COLORS, legend=alt.Legend(orient="bottom")),
        tooltip=["rank", "kind", "name", alt.Tooltip("start_s:Q", format=".3f"), alt.Tooltip("end_s:Q", format=".3f")],
    ).properties(height=alt.Step(18))


def busbw(table: pd.DataFrame) -> alt.Chart:
    """Median bus bandwidth per collective and size, with the 10th percentile as a tick."""
    table = table.assign(size=table["op"] + " " + (table["bytes"] / 2**20).round(1).astype(str) + " MiB")
    base = alt.Chart(table).encode(y=alt.Y("size:N", title=None))
    return (base.mark_bar().encode(x=alt.X("busbw_gbps:Q", title="bus bandwidth, GB/s (median)"),
                                   tooltip=["op", "bytes", "group_size", "calls",
                                            alt.Tooltip("busbw_gbps:Q", format=".1f")])
            + base.mark_tick(color="black").encode(x="busbw_p10_gbps:Q")).properties(height=alt.Step(28))


def by_rank(bins: pd.DataFrame, value: str, title: str,
            band: tuple[str, str] | None = None) -> alt.LayerChart | alt.Chart:
    """A per-rank value over bins of ranks, with the bins' spread as a band."""
    line = alt.Chart(bins).mark_line(point=len(bins) <= 64).encode(
        x=alt.X("rank_lo:Q", title="rank"), y=alt.Y(f"{value}:Q", title=title, scale=alt.Scale(zero=False)),
        tooltip=[c for c in bins.columns if c != "metric"])
    if band is None:
        return line.properties(height=220)
    area = alt.Chart(bins).mark_area(opacity=0.25).encode(x="rank_lo:Q", y=f"{band[0]}:Q", y2=f"{band[1]}:Q")
    return (area + line).properties(height=220)


def with_markers(series: pd.DataFrame, value: str, markers: pd.DataFrame) -> alt.LayerChart:
    """A per-step value with vertical rules where anomalies, rollbacks and checkpoints happened."""
    line = alt.Chart(series.dropna(subset=[value])).mark_line().encode(
        x=alt.X("step:Q"), y=alt.Y(f"{value}:Q", scale=alt.Scale(zero=False), axis=alt.Axis(format=".4~g")),
        tooltip=["step", value])
    rules = alt.Chart(markers).mark_rule(strokeDash=[4, 3]).encode(
        x="step:Q", color=alt.Color("marker:N", legend=alt.Legend(orient="bottom")),
        tooltip=["step", "marker", "detail"])
    return (line + rules).properties(height=260)


def tradeoff(curve: pd.DataFrame, picked_w: float) -> alt.LayerChart:
    """The job's time/energy trade-off, one point per power limit (the job-cap finding's curve):
    energy saved against step time lost, the policy's pick ringed."""
    points = curve.assign(slowdown_pct=100 * (curve["slowdown"] - 1), saving_pct=100 * curve["energy_saving"],
                          picked=curve["cap_w"] == picked_w)
    base = alt.Chart(points).encode(
        x=alt.X("slowdown_pct:Q", title="step time, % longer"), y=alt.Y("saving_pct:Q", title="energy per step, % less"),
        tooltip=[alt.Tooltip("cap_w:Q", title="limit, W"), alt.Tooltip("slowdown_pct:Q", format="+.1f"),
                 alt.Tooltip("saving_pct:Q", format=".1f")])
    return (base.mark_line(point=True) + base.mark_point(size=250, color="#e6550d").transform_filter("datum.picked")
            + base.mark_text(dy=-10, fontSize=10).encode(text="cap_w:Q")).properties(height=260)
