"""Node health, after Minder (NSDI'25): a machine about to fail drifts away from its peers in what it reports
before its ranks slow down or stop, so the node whose metrics stand apart from the other nodes', window after
window, is named for draining before it straggles.

Time is cut into windows of `window_s` seconds (multiples of it since the epoch: the same windows live and after
the fact). In each, every node's metrics of each family (temperatures; clocks; PCIe, NVLink and GPU memory error
rates; InfiniBand error rates; the PCIe link's generation and width; host pressure; and the node's step phases:
its ranks' compute and input wait over their step's median, as a share of the step) are denoised into one value
each: a counter's events over the window (what it gained from reading to reading, a drop gaining nothing), a
gauge's median, the node's worst device or port (its hottest GPU, its narrowest link). Each value is taken
against the other nodes': its distance to the median node, in units of the nodes' spread (their MAD, floored at
what a metric's resolution, or a single event in a window, makes noise), and only in the direction that is bad
(hotter, slower clocks, more errors, a narrower link). A family's distance is the norm of its metrics'. A node is
far in a window when a family of its devices or host is `z` or more away (slow step phases alone make a
straggler, which the straggler analyzer names), and flagged once it is far in `persist` consecutive windows: a
one-off (a burst of errors, a hot sample) never flags. A flagged node is a warning; critical when it is also a
straggler (its step phases stand apart too: its ranks compute, or wait for input, longer than the other
nodes'), when its error rates rose in each of those windows (to twice the first), or when its GPU's memory
fails beyond correcting (uncorrected ECC errors, uncorrectable rows remapped, a row remap failed).

The job is also judged against its own history: the windows' mean step time, split where its level changes (a
change point). A rise the whole job shares (what is left once the time every rank waits for the slowest ones is
taken out) blames no node: a job-wide regression (the code, the data, the network, the storage changed).

A window is judged once a step past it comes (its device samples: `Frames.node_samples`, read by time);
what the steps say of each window is folded in as the steps come and kept between passes (`Frames.kept`).
"""

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from collector import ranksets
from collector.analysis.analyzers import Frames, Reads
from collector.analysis.analyzers.changepoint import change_point
from collector.analysis.analyzers.hardware import SLOWING
from collector.findings import Finding
from rankwatch.agent import semconv as sc

ANALYZER = "fleet"
UNHEALTHY, JOB_SLOWDOWN = "unhealthy_node", "job_slowdown"  # the kinds of findings
STEP = "step"  # the family of the node's step phases
COMPUTE, DATA = "compute", "input wait"  # its metrics
HELD_BACK = "clocks_held_back"  # the share of a GPU's samples whose clock-event reasons slow it (SLOWING)
SAMPLES_PER_WINDOW = 6  # a window's samples are read thinned to the last of each of this many slices


@dataclass(frozen=True)
class Metric:
    """How a metric is denoised and compared: its family; a counter (events per window) or a gauge (its
    median); +1 where higher is worse, -1 where lower is; the least spread its values are scaled by
    (a gauge's in its unit; a counter's in events per window)."""

    family: str
    counter: bool
    worse: int
    floor: float


METRICS = {
    sc.GPU_TEMP_C: Metric("temperature", False, 1, 1.5),
    sc.MEMORY_TEMP_C: Metric("temperature", False, 1, 1.5),
    sc.SM_CLOCK_MHZ: Metric("clocks", False, -1, 15.0),
    HELD_BACK: Metric("clocks", False, 1, 0.1),
    sc.PCIE_REPLAY_COUNTER: Metric("pcie", True, 1, 1.0),
    sc.NVLINK_CRC_FLIT_ERRORS: Metric("nvlink", True, 1, 1.0),
    sc.NVLINK_CRC_DATA_ERRORS: Metric("nvlink", True, 1, 1.0),
    sc.NVLINK_REPLAY_ERRORS: Metric("nvlink", True, 1, 1.0),
    sc.NVLINK_RECOVERY_ERRORS: Metric("nvlink", True, 1, 1.0),
    sc.ECC_SBE_VOLATILE: Metric("gpu_memory", True, 1, 1.0),
    sc.ECC_DBE_VOLATILE: Metric("gpu_memory", True, 1, 1 / 6),  # one uncorrected error is far
    sc.REMAPPED_ROWS_CORRECTABLE: Metric("gpu_memory", True, 1, 1.0),
    sc.REMAPPED_ROWS_UNCORRECTABLE: Metric("gpu_memory", True, 1, 1 / 6),
    sc.ROW_REMAP_FAILURE: Metric("gpu_memory", False, 1, 0.1),
    sc.IB_SYMBOL_ERRORS: Metric("infiniband", True, 1, 1.0),
    sc.IB_RCV_ERRORS: Metric("infiniband", True, 1, 1.0),
    sc.IB_XMIT_DISCARDS: Metric("infiniband", True, 1, 1.0),
    sc.IB_LINK_DOWNED: Metric("infiniband", True, 1, 1 / 6),  # a port going down once a window is far
    sc.PCIE_LINK_GEN: Metric("pcie_link", False, -1, 0.1),  # any step down is far
    sc.PCIE_LINK_WIDTH: Metric("pcie_link", False, -1, 0.1),
    sc.PRESSURE_CPU: Metric("host", False, 1, 0.02),
    sc.PRESSURE_MEMORY: Metric("host", False, 1, 0.02),
    sc.PRESSURE_IO: Metric("host", False, 1, 0.02),
    COMPUTE: Metric(STEP, False, 1, 0.005),  # a share of the step time: 0.5% of it
    DATA: Metric(STEP, False, 1, 0.005),
}
COUNTERS = {m: metric.counter for m, metric in METRICS.items()}
WORSE = {m: metric.worse for m, metric in METRICS.items()}
SAMPLED = sorted({*METRICS, sc.CLOCK_EVENT_REASONS} - {HELD_BACK, COMPUTE, DATA})  # the metrics read from samples
UNCORRECTABLE = (sc.ECC_DBE_VOLATILE, sc.REMAPPED_ROWS_UNCORRECTABLE, sc.ROW_REMAP_FAILURE)  # critical at once
WORDS = {  # each metric as a person reads it
    sc.GPU_TEMP_C: "GPU temperature",
    sc.MEMORY_TEMP_C: "GPU memory (HBM) temperature",
    sc.SM_CLOCK_MHZ: "SM clock",
    HELD_BACK: "clocks held back",
    sc.PCIE_REPLAY_COUNTER: "PCIe replays",
    sc.NVLINK_CRC_FLIT_ERRORS: "NVLink CRC flit errors",
    sc.NVLINK_CRC_DATA_ERRORS: "NVLink CRC data errors",
    sc.NVLINK_REPLAY_ERRORS: "NVLink replays",
    sc.NVLINK_RECOVERY_ERRORS: "NVLink recoveries",
    sc.ECC_SBE_VOLATILE: "corrected ECC errors",
    sc.ECC_DBE_VOLATILE: "uncorrected ECC errors",
    sc.REMAPPED_ROWS_CORRECTABLE: "memory rows remapped (correctable)",
    sc.REMAPPED_ROWS_UNCORRECTABLE: "memory rows remapped (uncorrectable)",
    sc.ROW_REMAP_FAILURE: "row remap failure",
    sc.IB_SYMBOL_ERRORS: "InfiniBand symbol errors",
    sc.IB_RCV_ERRORS: "InfiniBand receive errors",
    sc.IB_XMIT_DISCARDS: "InfiniBand send discards",
    sc.IB_LINK_DOWNED: "InfiniBand link downs",
    sc.PCIE_LINK_GEN: "PCIe link generation",
    sc.PCIE_LINK_WIDTH: "PCIe link width",
    sc.PRESSURE_CPU: "CPU pressure",
    sc.PRESSURE_MEMORY: "memory pressure",
    sc.PRESSURE_IO: "I/O pressure",
    COMPUTE: "compute over the step median",
    DATA: "input wait over the step median",
}
TO_DO = {  # what to have checked on a drained node, by the family that drove it
    "temperature": "its cooling (fans, heat sinks, airflow)",
    "clocks": "why its GPU clocks are held back (cooling, power delivery)",
    "pcie": "the GPU's PCIe link (riser, slot, seating)",
    "pcie_link": "the GPU's PCIe link (riser, slot, seating)",
    "nvlink": "its NVLinks and NVSwitches",
    "gpu_memory": "the GPU's memory (replace the GPU)",
    "infiniband": "the InfiniBand port's cable, transceiver and switch port",
    "host": "what else loads the host",
}


@dataclass(frozen=True)
class Settings:
    window_s: float = 30.0  # fault counters are read every 10 s (rankwatch/agent/faults.py): three a window
    persist: int = 3  # consecutive windows a node stands apart in before it is flagged
    z: float = 6.0  # the distance (in its peers' spreads) that sets a node apart
    min_nodes: int = 4  # nodes needed to judge any of them: a median node and its spread
    history: int = 20  # windows of the job's step time its regressions are judged over
    min_segment: int = 3  # windows a regression's level before and after spans at least
    min_regression: float = 0.05  # the least rise of the job's step time that is a regression
    regression_z: float = 6.0  # and in spreads of the windows before it
    shared: float = 0.5  # the least share of the rise that every rank shares (not waits for a slow one)


READS = Reads(history=0, linger=1, node_samples=True)


@dataclass
class _Window:
    """What the steps said of one window: its steps, the sums of its per-step job figures, and per node the sums
    of its per-step phase excesses (over its stage's median, as a share of the step) and their count."""

    first: int
    last: int
    steps: int = 0
    step_s: float = 0.0
    shared_s: float = 0.0
    phases: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=[COMPUTE, DATA, "n"], dtype=float))

    def add(self, steps: pd.DataFrame, phases: pd.DataFrame) -> None:
        self.first, self.last = min(self.first, int(steps.index.min())), max(self.last, int(steps.index.max()))
        self.steps += len(steps)
        self.step_s += float(steps["step_s"].sum())
        self.shared_s += float(steps["shared_s"].sum())
        self.phases = self.phases.add(phases, fill_value=0.0)


def judge(frames: Frames, settings: Settings = Settings()) -> list[Finding]:
    """The findings of the windows that end among the new steps (and at the run's end, the last window's),
    then the flagged nodes and the regression standing at the newest step."""
    if frames.new_steps.empty:
        return []
    kept = frames.kept.setdefault(ANALYZER, {})
    ended = _fold(frames, kept, settings)
    history = [window for window, last in ended if last < frames.first_new]  # steps read again: judged before
    if history and "standing" not in kept:  # what stood at the newest of them, were nothing kept
        kept["standing"] = _judged(frames, kept, history[-1], settings)
    found: list[Finding] = []
    for window, last in ended:
        if last >= frames.first_new:
            kept["standing"] = _judged(frames, kept, window, settings)
            found += kept["standing"]
    standing = kept.get("standing", [])
    found += [f.spanning(f.step_start or 0, frames.last) for f in standing if (f.step_end or 0) < frames.last]
    return found


def _fold(frames: Frames, kept: dict, s: Settings) -> list[tuple[int, int]]:
    """The steps not yet folded into `kept`'s windows folded in; the windows they ended (window, its last step),
    and at the run's end the window it ended in."""
    new = frames.steps if "upto" not in kept else frames.steps_after(kept["upto"])
    if new.empty:
        return []
    window_ns = int(s.window_s * 1e9)
    per_step, phases = _per_step(new, frames.ranks)
    per_step["window"] = (per_step["end_ns"] // window_ns).astype(np.int64)
    windows: dict[int, _Window] = kept.setdefault("windows", {})
    ended = []
    open_window = kept.get("open")
    for window, steps in per_step.groupby("window", sort=True):
        w = int(window)
        if open_window is not None and w > open_window:
            ended.append((open_window, windows[open_window].last))
        if open_window is None or w > open_window:
            open_window = w
        of_window = phases[phases.index.get_level_values("step").isin(steps.index)]
        windows.setdefault(w, _Window(int(steps.index.min()), int(steps.index.max()))).add(
            steps, of_window.groupby(level="host").sum()
        )
    if frames.ended_ns is not None and open_window is not None:
        ended.append((open_window, windows[open_window].last))
    kept.update(upto=int(new["step"].max()), open=open_window)
    keep = max(s.history, s.persist) + 1
    for w in [w for w in windows if w < (open_window or 0) - keep]:
        del windows[w]
    return ended


def _per_step(steps: pd.DataFrame, placement: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per step (index): its median end (ns), its median step time and the part of it every rank shares (less
    the time the others wait for the slowest rank's own time: compute and input wait); and per step and host
    (index), the sums of its ranks' compute and input wait excesses over their stage's median in the step, as a
    share of the step's time, with their count. In numpy, grouped by sorting: it runs at every pass with new
    steps, and pandas' grouping costs milliseconds a call whatever the frame's size."""
    duration = _floats(steps["duration_s"])
    wait = np.nan_to_num(_floats(steps["comm_wait_s"]), nan=0.0)
    data = np.nan_to_num(_floats(steps["data_s"]), nan=0.0) if "data_s" in steps else np.zeros(len(steps))
    compute = _floats(steps["compute_s"])
    compute = np.where(np.isnan(compute), duration - wait - data, compute)
    own = compute + data
    step_ids, of_step = np.unique(steps["step"].to_numpy(), return_inverse=True)
    n = len(step_ids)
    step_s = _medians(of_step, duration, n)
    own_max = np.full(n, -np.inf)
    np.maximum.at(own_max, of_step, own)
    per_step = pd.DataFrame(
        {
            "end_ns": _medians(of_step, _floats(steps["end_ts"]), n),
            "step_s": step_s,
            "own_median": _medians(of_step, own, n),
            "own_max": own_max,
        },
        index=pd.Index(step_ids, name="step"),
    )
    per_step["shared_s"] = per_step["step_s"] - (per_step["own_max"] - per_step["own_median"])
    hosts, stages = _placed(steps["rank"].to_numpy(), placement)
    placed_rows = pd.notna(hosts)
    if not placed_rows.any():
        unplaced = pd.MultiIndex.from_tuples([], names=["step", "host"])
        return per_step, pd.DataFrame(columns=[COMPUTE, DATA, "n"], index=unplaced, dtype=float)
    _, of_stage_step = np.unique(np.stack([of_step, stages]), axis=1, return_inverse=True)
    of_stage_step = of_stage_step.reshape(-1)
    groups = of_stage_step.max() + 1
    share = step_s[of_step]
    compute_excess = (compute - _medians(of_stage_step, compute, groups)[of_stage_step]) / share
    data_excess = (data - _medians(of_stage_step, data, groups)[of_stage_step]) / share
    host_ids, of_host = np.unique(hosts[placed_rows], return_inverse=True)
    keys, of_node = np.unique(np.stack([of_step[placed_rows], of_host.reshape(-1)]), axis=1, return_inverse=True)
    of_node = of_node.reshape(-1)
    node = pd.DataFrame(
        {
            COMPUTE: _medians(of_node, compute_excess[placed_rows], keys.shape[1]),
            DATA: _medians(of_node, data_excess[placed_rows], keys.shape[1]),
            "n": 1.0,
        },
        index=pd.MultiIndex(levels=[step_ids, host_ids], codes=[keys[0], keys[1]], names=["step", "host"]),
    )
    return per_step, node


def _placed(ranks: np.ndarray, placement: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's host (None where unknown) and pipeline stage (0 where unknown), by its first row in `placement`."""
    hosts, stages = np.full(len(ranks), None, dtype=object), np.zeros(len(ranks))
    if placement.empty or "host" not in placement:
        return hosts, stages
    known, first = np.unique(placement["rank"].to_numpy(), return_index=True)
    at = pd.Index(known).get_indexer(ranks)
    found = at >= 0
    hosts[found] = placement["host"].to_numpy(dtype=object)[first][at[found]]
    if "pp_stage" in placement:
        stages[found] = np.nan_to_num(_floats(placement["pp_stage"])[first][at[found]], nan=0.0)
    return hosts, stages


def _floats(column: pd.Series) -> np.ndarray:
    return column.to_numpy(dtype=float, na_value=np.nan)


def _medians(groups: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """The median of `values` in each of the `n` groups `groups` numbers (0..n-1), NaN skipped (all NaN: NaN)."""
    kept = ~np.isnan(values)
    groups, values = groups[kept], values[kept]
    order = np.lexsort((values, groups))
    ordered = values[order]
    counts = np.bincount(groups, minlength=n)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    medians = np.full(n, np.nan)
    has = counts > 0
    low, high = starts[has] + (counts[has] - 1) // 2, starts[has] + counts[has] // 2
    medians[has] = (ordered[low] + ordered[high]) / 2
    return medians


def _judged(frames: Frames, kept: dict, window: int, s: Settings) -> list[Finding]:
    """The findings window `window` ends: the nodes far from their peers in it and the `persist - 1` windows
    before, and the job's regression over the windows up to it."""
    windows: dict[int, _Window] = kept["windows"]
    found = _nodes(frames, windows, window, s)
    regression = _regression(frames.run_id, windows, window, s)
    return found + ([regression] if regression else [])


def _nodes(frames: Frames, windows: dict, window: int, s: Settings) -> list[Finding]:
    placement = frames.ranks
    if frames.node_samples is None or placement.empty or "host" not in placement:
        return []
    hosts = placement.dropna(subset=["host"]).drop_duplicates("rank")
    if hosts["host"].nunique() < s.min_nodes:
        return []
    judged = list(range(window - s.persist + 1, window + 1))
    window_ns = int(s.window_s * 1e9)
    samples = frames.node_samples(  # from the window before: a counter's first gain in the first
        (judged[0] - 1) * window_ns, (window + 1) * window_ns - 1, window_ns // SAMPLES_PER_WINDOW, SAMPLED
    )
    values = _values(samples, hosts.set_index("rank")["host"], window_ns)
    for w in judged:  # the step phases the windows' steps said
        if w in windows and windows[w].phases["n"].gt(0).any():
            phases = windows[w].phases
            mean = phases[[COMPUTE, DATA]].div(phases["n"], axis=0)
            values = pd.concat([values, mean.rename_axis("host").assign(window=w).set_index("window", append=True)])
    if values.empty:
        return []
    values = values.groupby(level=["host", "window"]).first()  # samples' and phases' columns side by side
    present = set(values.index.get_level_values("window"))
    apart = [_apart(values.xs(w, level="window"), s) for w in judged if w in present]
    if len(apart) < s.persist or window not in windows:
        return []
    far = set.intersection(*(set(a.far) for a in apart))
    onset = next(windows[w].first for w in judged if w in windows)  # the first window it stood apart in
    ranks_of = hosts.groupby("host")["rank"].agg(lambda r: sorted(int(x) for x in r))
    return [
        _unhealthy(frames.run_id, host, ranks_of[host], onset, windows[window].last, apart, s)
        for host in sorted(far, key=str)
    ]


def _values(samples: pd.DataFrame, host_of: pd.Series, window_ns: int) -> pd.DataFrame:
    """Each node's value of each sampled metric in each window: a counter's events (gained from reading to reading,
    a drop gaining nothing, over each series: a GPU, a port), a gauge's median; the node's worst series."""
    if samples.empty:
        return pd.DataFrame(index=pd.MultiIndex.from_tuples([], names=["host", "window"]))
    samples = samples.assign(host=samples["rank"].map(host_of)).dropna(subset=["host"])
    for column in ("gpu", "port"):
        if column not in samples:
            samples[column] = None
    reasons = samples["metric"] == sc.CLOCK_EVENT_REASONS
    samples.loc[reasons, "value"] = ((samples.loc[reasons, "value"].astype("int64") & SLOWING) > 0).astype(float)
    samples.loc[reasons, "metric"] = HELD_BACK
    samples = samples.sort_values("ts", kind="stable")
    samples["window"] = samples["ts"] // window_ns
    series = ["metric", "host", "rank", "gpu", "port"]
    counters = samples["metric"].map(COUNTERS).fillna(False).astype(bool)
    gained = samples[counters].groupby(series, dropna=False)["value"].diff().clip(lower=0.0)
    of_counters = samples[counters].assign(value=gained).dropna(subset=["value"])
    per_series = pd.concat(
        [
            of_counters.groupby([*series, "window"], dropna=False)["value"].sum(),
            samples[~counters].groupby([*series, "window"], dropna=False)["value"].median(),
        ]
    ).reset_index()
    per_series = per_series[per_series["metric"].isin(list(METRICS))]
    signed = per_series["value"] * per_series["metric"].map(WORSE)  # the worst series: the greatest, signed
    worst = signed.groupby([per_series["host"], per_series["window"], per_series["metric"]]).max()
    return (worst * worst.index.get_level_values("metric").map(WORSE)).unstack("metric")


@dataclass
class _Apart:
    """One window's judgement: each node's one-sided distance by metric (z) and by family, the median node's
    values, and the nodes far from it."""

    values: pd.DataFrame  # host x metric
    z: pd.DataFrame  # host x metric
    families: pd.DataFrame  # host x family
    peers: pd.Series  # metric -> the median node's value
    far: list


def _apart(values: pd.DataFrame, s: Settings) -> _Apart:
    """How far each node stands from the median node in one window (`values`: host x metric)."""
    judged = values.loc[:, values.notna().sum() >= s.min_nodes]
    center = judged.median()
    spread = 1.4826 * (judged - center).abs().median()
    floors = pd.Series({m: METRICS[m].floor for m in judged.columns}, dtype=float)
    worse = pd.Series({m: METRICS[m].worse for m in judged.columns}, dtype=float)
    z = ((judged - center) * worse / np.maximum(spread, floors)).clip(lower=0.0).fillna(0.0)
    families = (z**2).T.groupby(lambda m: METRICS[m].family).sum().T ** 0.5
    hardware = families.drop(columns=[STEP], errors="ignore")
    far = hardware.index[(hardware >= s.z).any(axis=1)].tolist() if not hardware.empty else []
    return _Apart(judged, z, families, center, far)


def _unhealthy(
    run_id: str, host, ranks: list[int], onset: int, end: int, windows: list[_Apart], s: Settings
) -> Finding:
    """The finding of a node (`host`) far from its peers in each of `windows` (the newest last)."""
    newest = windows[-1]
    z, values = newest.z.loc[host], newest.values.loc[host]
    families = newest.families.loc[host]
    driving = [m for m in z.sort_values(ascending=False).index if z[m] >= s.z / 2]
    counters = [m for m in driving if METRICS[m].counter and METRICS[m].family != STEP]
    rising = [m for m in counters if _rising([w.values.loc[host, m] if m in w.values else np.nan for w in windows])]
    straggler = families.get(STEP, 0.0) >= s.z
    uncorrectable = [m for m in driving if m in UNCORRECTABLE]
    per_minute = 60.0 / s.window_s

    def shown(m: str, value: float) -> float:
        return float(value * per_minute) if METRICS[m].counter else float(value)

    metrics = [
        {
            "metric": m,
            "family": METRICS[m].family,
            "value": shown(m, values[m]),
            "peers": shown(m, newest.peers[m]),
            "unit": "per_min" if METRICS[m].counter else "step_share" if METRICS[m].family == STEP else "level",
            "z": float(z[m]),
        }
        for m in driving
    ]
    said = "; ".join(map(said_of, metrics[:4]))
    why = [
        *(["its ranks are slower than the other nodes' (a straggler)"] if straggler else []),
        *([f"its {', '.join(WORDS[m] for m in rising)} rose window after window"] if rising else []),
        *([f"{', '.join(WORDS[m] for m in uncorrectable)} on its GPU"] if uncorrectable else []),
    ]
    drove = [f for f in families.drop(STEP, errors="ignore").sort_values(ascending=False).index if families[f] >= s.z]
    checks = list(dict.fromkeys(TO_DO[f] for f in drove if f in TO_DO))
    score = float(families.max())
    return Finding(
        run_id,
        UNHEALTHY,
        ranks,
        onset,
        end,
        "critical" if why else "warning",
        score,
        f"node {host} ({ranksets.phrase(ranks)}) stands apart from its {len(newest.values) - 1} peers since step "
        f"{onset}: {said}" + (f"; {'; '.join(why)}" if why else "") + ": drain it before it fails",
        {
            "host": str(host),
            "metrics": metrics,
            "families": {f: float(d) for f, d in families.items() if d > 0},
            "straggler": bool(straggler),
            "rising": rising,
            "peers": len(newest.values) - 1,
            "windows": s.persist,
            "window_s": s.window_s,
            "what_to_do": f"drain {host} and have {'; '.join(checks) or 'it'} checked",
        },
        analyzer=ANALYZER,
    )


def _rising(rates: list[float]) -> bool:
    """Whether a counter's rates over consecutive windows keep rising: up in each, to twice the first at least
    (a steady rate's noise goes up three windows in a row one time in six)."""
    return bool(np.all(np.diff(rates) > 0) and rates[-1] >= 2 * rates[0])


def said_of(m: dict) -> str:
    """A metric that sets a node apart (an item of a finding's evidence `metrics`), in words: "PCIe replays
    212/min against 0/min" (the median node's)."""
    words = WORDS.get(m["metric"], m["metric"])
    if m["unit"] == "per_min":
        return f"{words} {m['value']:.3g}/min against {m['peers']:.3g}/min"
    if m["unit"] == "step_share":
        return f"{words} {100 * m['value']:+.1f}% of the step against {100 * m['peers']:+.1f}%"
    return f"{words} {m['value']:.4g} against {m['peers']:.4g}"


def _regression(run_id: str, windows: dict, window: int, s: Settings) -> Finding | None:
    """A job-wide regression of the step time up to `window`: a change point in the windows' mean step time,
    the level after it `min_regression` and `regression_z` spreads above the level before, most of the rise
    (`shared`) in what every rank shares."""
    judged = sorted(w for w in windows if window - s.history < w <= window and windows[w].steps)
    if len(judged) < 2 * s.min_segment:
        return None
    step_s = np.array([windows[w].step_s / windows[w].steps for w in judged])
    shared_s = np.array([windows[w].shared_s / windows[w].steps for w in judged])
    split = change_point(step_s)
    if split < s.min_segment or len(judged) - split < s.min_segment:
        return None
    before, after = float(np.median(step_s[:split])), float(np.median(step_s[split:]))
    spread = max(1.4826 * float(np.median(np.abs(step_s[:split] - before))), 0.005 * before)
    rise = after - before
    shared = float(np.median(shared_s[split:]) - np.median(shared_s[:split]))
    if rise < s.min_regression * before or rise < s.regression_z * spread or shared < s.shared * rise:
        return None
    onset = windows[judged[split]].first
    return Finding(
        run_id,
        JOB_SLOWDOWN,
        [],
        onset,
        windows[window].last,
        "warning",
        after / before,
        f"every rank slowed together since step {onset}: the job's step time went from {before:.3g} s to "
        f"{after:.3g} s ({100 * rise / before:+.0f}%) against its own history, and no node or rank holds the "
        "others up: a change the whole job shares (its code, data, network, storage or neighbours)",
        {
            "step_s_before": before,
            "step_s_after": after,
            "slowdown": after / before,
            "shared_share": shared / rise,
            "windows_before": split,
            "windows_after": len(judged) - split,
            "window_s": s.window_s,
        },
        analyzer=ANALYZER,
    )
