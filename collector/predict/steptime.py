"""A rank-step's compute time from the state it ran in: the features NCPP's groups read, and how much
of a rank's slowdown each group explains.

One row per rank-step. A device or host metric's feature is the mean of the rank's samples within the
step (the GPU's, sampled many times a second), or, where none fell in it, the latest sample before the
step's end, at most `STALE_S` old (host state, read once a second). The workload is the step's tokens
and model FLOPs (as logs: they span orders of magnitude) and the rank's place in the mesh.
"""

from collections.abc import Mapping

import numpy as np
import pandas as pd

from collector.predict.ncpp import Model
from rankwatch.agent import semconv as sc

TARGET = "compute_s"
STALE_S = 5.0
THROTTLES = {  # clock-event reason bits, by what a user acts on
    "throttle.power": 0x4 | 0x80,  # power cap, power brake
    "throttle.thermal": 0x20 | 0x40,  # software and hardware thermal slowdown
    "throttle.hardware": 0x8,  # hardware slowdown
}
GROUPS: dict[str, list[str]] = {
    "compute": [sc.SM_CLOCK_MHZ, sc.GPU_UTIL_PCT, *THROTTLES, sc.POWER_LIMIT_W],
    "memory": [sc.FB_USED_MIB, sc.MEM_CLOCK_MHZ, sc.ECC_SBE_VOLATILE, sc.ECC_DBE_VOLATILE],
    "power/thermal": [sc.POWER_INSTANT_W, sc.POWER_W, sc.GPU_TEMP_C],
    "interconnect": [sc.PCIE_TX_BPS, sc.PCIE_RX_BPS, sc.NVLINK_TX_BPS, sc.NVLINK_RX_BPS],
    "host": [
        sc.PROCESS_CPU_UTIL,
        sc.SYSTEM_MEMORY_UTIL,
        sc.PRESSURE_CPU,
        sc.PRESSURE_MEMORY,
        sc.PRESSURE_IO,
        sc.PROCESS_READ_BPS,
        sc.PROCESS_WRITE_BPS,
        sc.PROCESS_MAJOR_FAULTS,
        *sorted(sc.HOST_WIDE_METRICS),
    ],
    "workload": ["log_flops", "log_tokens", "world_size", "pp_stage", "tp_rank", "device"],
}
HARDWARE = ("compute", "memory", "power/thermal", "interconnect")  # the GPU's own state
_METRICS = {name for group in GROUPS.values() for name in group} - {"log_flops", "log_tokens"}
STEPS_SQL = f"""SELECT rank, step, epoch_ns(end_ts) AS end_ts, duration_s, compute_s, tokens,
                       TRY_CAST(attrs->>{sc.json_path(sc.STEP_FLOPS)} AS DOUBLE) AS flops
                FROM current_steps WHERE run_id = $run AND compute_s > 0 ORDER BY step, rank"""
SAMPLES_SQL = """SELECT rank, epoch_ns(ts) AS ts, metric, value FROM device_samples
                 WHERE run_id = $run AND metric IN (SELECT unnest($metrics))"""
RANKS_SQL = """SELECT rank, host, pp_stage, tp_rank, device,
                      (SELECT count(*) FROM ranks WHERE run_id = $run) AS world_size
               FROM ranks WHERE run_id = $run"""


def metrics_read() -> list[str]:
    """The device-sample metrics the features are drawn from."""
    return sorted((_METRICS - set(THROTTLES)) | {sc.CLOCK_EVENT_REASONS})


def _per_step(steps: pd.DataFrame, samples: pd.DataFrame, latest_only: bool = False) -> pd.Series:
    """One metric's feature for each rank-step (in `steps`' order): its samples' mean within the
    step, else (or with `latest_only`: a bitmask has no mean) the latest before the step's end."""
    s = samples.sort_values("ts", kind="stable")
    s = s.assign(total=s.groupby("rank")["value"].cumsum(), count=s.groupby("rank").cumcount() + 1)
    right = s[["ts", "rank", "total", "count", "value"]].assign(at=s["ts"])  # `ts` itself becomes the left's
    index = pd.DataFrame({"rank": steps["rank"].to_numpy(), "row": np.arange(len(steps))})

    def at(ts: np.ndarray) -> pd.DataFrame:
        left = index.assign(ts=ts).sort_values("ts", kind="stable")
        merged = pd.merge_asof(left, right, on="ts", by="rank", direction="backward")
        return merged.sort_values("row")

    end_ns = steps["end_ts"].to_numpy(dtype=np.int64)
    start_ns = end_ns - (steps["duration_s"].to_numpy(dtype=float) * 1e9).astype(np.int64)
    end, start = at(end_ns), at(start_ns)
    within = end["count"].to_numpy() - np.nan_to_num(start["count"].to_numpy())
    total = end["total"].to_numpy() - np.nan_to_num(start["total"].to_numpy())
    latest = np.where(end_ns - end["at"].to_numpy(dtype=float) <= STALE_S * 1e9, end["value"].to_numpy(), np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        return pd.Series(np.where((within > 0) & (not latest_only), total / within, latest), index=steps.index)


def _hosts_shared(samples: pd.DataFrame, ranks: pd.DataFrame) -> pd.DataFrame:
    """The samples with those of a host's disks and dirty pages, which one rank per host reads, given
    to every rank of the host (`ranks`' host column; as they are where it has none)."""
    wide = samples["metric"].isin(sc.HOST_WIDE_METRICS).to_numpy()
    if "host" not in ranks or not wide.any():
        return samples
    hosts = ranks[["rank", "host"]].dropna()
    shared = samples[wide].merge(hosts, on="rank").drop(columns="rank").merge(hosts, on="host")
    return pd.concat([samples[~wide], shared.drop(columns="host")], ignore_index=True)


def features(steps: pd.DataFrame, samples: pd.DataFrame, ranks: pd.DataFrame) -> pd.DataFrame:
    """The grouped features of each rank-step. `steps`: rank, step, end_ts (ns), duration_s, tokens,
    flops; `samples`: rank, ts (ns), metric, value; `ranks`: rank and any of host, pp_stage, tp_rank,
    device, world_size. Rows keep `steps`' index."""
    out = pd.DataFrame(index=steps.index)
    for metric, of_metric in _hosts_shared(samples, ranks).groupby("metric", sort=False):
        if metric == sc.CLOCK_EVENT_REASONS:
            mask = _per_step(steps, of_metric, latest_only=True).fillna(0).astype(np.int64)
            for name, bits in THROTTLES.items():
                out[name] = ((mask & bits) != 0).astype(float)
        elif metric in _METRICS:
            out[metric] = _per_step(steps, of_metric)
    for name in ("flops", "tokens"):
        if name in steps:
            out[f"log_{name}"] = np.log(pd.to_numeric(steps[name], errors="coerce").where(lambda v: v > 0))
    placed = steps[["rank"]].merge(ranks, on="rank", how="left").set_index(steps.index)
    for name in ("world_size", "pp_stage", "tp_rank", "device"):
        if name in placed:
            out[name] = placed[name]
    return out


def read(con, run_id: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A stored run's rank-steps (rank, step, end_ts, duration_s, compute_s, ...) and their features."""
    steps = con.execute(STEPS_SQL, {"run": run_id}).df()
    samples = con.execute(SAMPLES_SQL, {"run": run_id, "metrics": metrics_read()}).df()
    ranks = con.execute(RANKS_SQL, {"run": run_id}).df()
    return steps, features(steps, samples, ranks)


def explain(model: Model, mine: pd.DataFrame, peers: pd.DataFrame, predicted: float) -> dict[str, float]:
    """How much of a rank's predicted compute time (`predicted`, the median over its rank-steps `mine`)
    each group explains against its peers (`peers`): the seconds the prediction drops when the group's
    features are set to the peers' (medians; a category to their most common value), one group at a
    time. The prior reads some of them too (the analytic model the clock and the work)."""
    shares = {}
    for group, names in GROUPS.items():
        typical = {}
        for name in (n for n in names if n in mine and n in peers and peers[n].notna().any()):
            column = peers[name].dropna()
            typical[name] = column.median() if pd.api.types.is_numeric_dtype(column) else column.mode().iat[0]
        if typical:
            shares[group] = predicted - float(np.median(model.predict(mine.assign(**typical))))
    return shares


def named(shares: Mapping[str, float]) -> str:
    """The group that explains the most, or "" where none explains any."""
    group = max(shares, key=lambda g: shares[g], default="")
    return group if group and shares[group] > 0 else ""
