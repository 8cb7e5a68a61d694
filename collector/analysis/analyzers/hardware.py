"""Hardware that explains a slow rank: its GPU's clocks held back (power cap, heat), its GPU
memory full, or its GPU raising ECC errors or XIDs; and the faults beyond the GPU core that blame
a machine: its PCIe link replaying or running below the generation or width its peers' run at,
its NVLinks erring, its memory rows failing to remap, its HBM hotter than its peers', its host's
InfiniBand ports erring or going down.

Pure: device samples (rank, metric, value; DCGM names; `ts` and `host` where known) and the slow
ranks in, causes out. A condition every GPU shares (the whole job power-capped, every GPU's memory
nearly full) explains no one rank's slowness, so held clocks, full memory and the faults beyond
the core count only where most peers are clear of them; ECC errors and XIDs that arise on a slow
rank's GPU always count. A fault counter's rise is what it gained from reading to reading (a drop,
the driver reloaded, gains nothing): it shows where the samples span two of its readings (10 s
apart, rankwatch/agent/faults.py). A host's InfiniBand ports, read by one rank of the host, speak for
every rank of it (`host`: `with_hosts`; without one, for the rank that read them).
"""

from collections.abc import Callable, Iterable
from functools import reduce
from operator import or_

import pandas as pd

from collector import ranksets
from rankwatch.agent import semconv as sc

SLOWING = 0x4 | 0x8 | 0x20 | 0x40 | 0x80  # clock-event reasons that slow compute: power cap, slowdowns, brake
HELD_SHARE = 0.5  # a GPU is held back when a reason is set in at least this share of its samples
FULL = 0.95  # GPU memory this full leaves the allocator thrashing (cache flushes, retries)
PEERS_SHARE = 0.5  # a fault beyond the core that this share of the peers (GPUs, hosts) has too explains no one rank
HOTTER_C = 10.0  # HBM this much hotter than its peers' median: its cooling, not the job's load, heats it
_NVLINK_ERRORS = {
    sc.NVLINK_CRC_FLIT_ERRORS: "CRC flit",
    sc.NVLINK_CRC_DATA_ERRORS: "CRC data",
    sc.NVLINK_REPLAY_ERRORS: "replay",
    sc.NVLINK_RECOVERY_ERRORS: "recovery",
}
_IB_ERRORS = {
    sc.IB_SYMBOL_ERRORS: "symbol error",
    sc.IB_LINK_DOWNED: "link down",
    sc.IB_RCV_ERRORS: "receive error",
    sc.IB_XMIT_DISCARDS: "send discard",
}
_PCIE_LINK = {sc.PCIE_LINK_GEN: "Gen {:.0f}", sc.PCIE_LINK_WIDTH: "x{:.0f}"}
Devices = Callable[[int | None, int | None], pd.DataFrame]  # an analyzer's Frames.devices


def with_hosts(devices: Devices | None, ranks: pd.DataFrame | None) -> Devices | None:
    """`devices(since_ns, until_ns)` with each sample's host (a `host` column) from the ranks' placement
    (`ranks`: rank, host), so that a host's InfiniBand ports speak for all its ranks; as it is where the
    placement names no host."""
    if devices is None or ranks is None or "host" not in ranks or ranks["host"].isna().all():
        return devices
    hosts = ranks.drop_duplicates("rank").set_index("rank")["host"]

    def placed(since_ns: int | None, until_ns: int | None) -> pd.DataFrame:
        samples = devices(since_ns, until_ns)
        return samples.assign(host=samples["rank"].map(hosts))

    return placed


def causes(devices: pd.DataFrame | None, slow: list[int]) -> list[dict]:
    """The hardware causes among `slow` ranks: [{"cause", "ranks", "detail"}], where cause is
    `clocks_held_back` (detail: the reasons in words), `memory_full` (the fullest GPU's share),
    `ecc_errors` (corrected and uncorrected errors that arose in the samples' span) or `xid`
    (the XID codes); and the faults beyond the core (`beyond_core`), which name their metric too."""
    if devices is None or devices.empty:
        return []
    found = []
    mine = devices[devices["rank"].isin(slow)]
    peers = devices[~devices["rank"].isin(slow)]

    def metric(frame: pd.DataFrame, name: str) -> pd.Series:
        return frame.loc[frame["metric"] == name].groupby("rank")["value"]

    reasons = metric(mine, sc.CLOCK_EVENT_REASONS)
    peer_bits = peers.loc[peers["metric"] == sc.CLOCK_EVENT_REASONS, "value"].astype("int64")
    held: dict[int, int] = {}
    for rank, values in reasons:
        bits = values.astype("int64")
        for bit in (1 << i for i in range(SLOWING.bit_length()) if SLOWING & (1 << i)):
            if ((bits & bit) > 0).mean() >= HELD_SHARE and not ((peer_bits & bit) > 0).mean() >= HELD_SHARE:
                held[int(rank)] = held.get(int(rank), 0) | bit
    if held:
        found.append(
            {
                "cause": "clocks_held_back",
                "ranks": sorted(held),
                "detail": ", ".join(sc.clock_event_words(reduce(or_, held.values()))),
            }
        )

    fill = (metric(mine, sc.FB_USED_MIB).median() / metric(mine, sc.FB_TOTAL_MIB).median()).dropna()
    peer_fill = (metric(peers, sc.FB_USED_MIB).median() / metric(peers, sc.FB_TOTAL_MIB).median()).dropna()
    full = fill[fill >= FULL]
    if not full.empty and not (peer_fill >= FULL).mean() >= 0.5:
        found.append(
            {
                "cause": "memory_full",
                "ranks": sorted(int(r) for r in full.index),
                "detail": f"{100 * full.max():.0f}% full",
            }
        )

    rise = pd.DataFrame(
        {
            name: metric(mine, name).max() - metric(mine, name).min()
            for name in (sc.ECC_SBE_VOLATILE, sc.ECC_DBE_VOLATILE)
        }
    ).fillna(0.0)
    erring = rise[(rise > 0).any(axis=1)]
    if not erring.empty:
        found.append(
            {
                "cause": "ecc_errors",
                "ranks": sorted(int(r) for r in erring.index),
                "detail": f"{int(erring[sc.ECC_SBE_VOLATILE].sum())} corrected, "
                f"{int(erring[sc.ECC_DBE_VOLATILE].sum())} uncorrected ECC errors",
            }
        )

    xids = mine[mine["metric"] == sc.XID_ERRORS]
    if not xids.empty:
        found.append(
            {
                "cause": "xid",
                "ranks": sorted(int(r) for r in xids["rank"].unique()),
                "detail": "XID " + ", ".join(str(int(v)) for v in sorted(xids["value"].unique())),
            }
        )
    return found + beyond_core(devices, slow)


def beyond_core(devices: pd.DataFrame, slow: list[int]) -> list[dict]:
    """The faults beyond the GPU core among `slow` ranks: [{"cause", "ranks", "detail", "metric"}] (metric:
    the one that drove it), where cause is `pcie_replays`, `pcie_link_degraded` (below the peers' median
    generation or width), `nvlink_errors`, `row_remapping` (a remap failed, or uncorrectable rows were
    remapped), `memory_hot` (HBM HOTTER_C or more above the peers' median) or `infiniband_errors` (on
    the rank's host, against the other hosts)."""
    found = []
    replays = _rises(devices, [sc.PCIE_REPLAY_COUNTER])
    if ranks := _apart(replays.sum(axis=1) > 0, slow):
        detail = _counted(replays.loc[ranks].to_numpy().sum(), "PCIe replay")
        found.append(_cause("pcie_replays", ranks, detail, sc.PCIE_REPLAY_COUNTER))

    below: dict[str, list[int]] = {}
    said = []
    for name, form in _PCIE_LINK.items():
        level = _per_rank(devices, name)
        peers = level[~level.index.isin(slow)].median()
        if ranks := _apart(level < peers, slow):
            below[name] = ranks
            said.append(f"{form.format(level.loc[ranks].min())}, peers' {form.format(peers)}")
    if below:
        either = sorted({rank for low in below.values() for rank in low})
        found.append(_cause("pcie_link_degraded", either, "; ".join(said), next(iter(below))))

    nvlink = _rises(devices, _NVLINK_ERRORS)
    if ranks := _apart(nvlink.sum(axis=1) > 0, slow):
        gained = nvlink.loc[ranks].sum()
        detail = ", ".join(f"{int(n)} {_NVLINK_ERRORS[m]}" for m, n in gained.items() if n > 0)
        found.append(_cause("nvlink_errors", ranks, detail, str(gained.idxmax())))

    rows = pd.concat(
        {
            "failed": _per_rank(devices, sc.ROW_REMAP_FAILURE, "max"),
            "remapped": _rises(devices, [sc.REMAPPED_ROWS_UNCORRECTABLE]).sum(axis=1),
        },
        axis=1,
    ).fillna(0.0)
    if ranks := _apart((rows > 0).any(axis=1), slow):
        failing, remapped = bool(rows.loc[ranks, "failed"].any()), int(rows.loc[ranks, "remapped"].sum())
        said = ["a row remap failed"] if failing else []
        said += [_counted(remapped, "uncorrectable row") + " remapped"] if remapped else []
        metric = sc.ROW_REMAP_FAILURE if failing else sc.REMAPPED_ROWS_UNCORRECTABLE
        found.append(_cause("row_remapping", ranks, ", ".join(said), metric))

    temperature = _per_rank(devices, sc.MEMORY_TEMP_C)
    peers = temperature[~temperature.index.isin(slow)].median()
    if ranks := _apart(temperature >= peers + HOTTER_C, slow):
        detail = f"{temperature.loc[ranks].max():.0f} °C, peers' {peers:.0f} °C"
        found.append(_cause("memory_hot", ranks, detail, sc.MEMORY_TEMP_C))

    infiniband = _rises(devices, _IB_ERRORS)  # by the rank that read the ports
    hosts = _hosts(devices)
    by_host = infiniband.groupby(hosts.reindex(infiniband.index)).sum()
    if erring := _apart(by_host.sum(axis=1) > 0, hosts.reindex(slow).dropna().unique()):
        gained = by_host.loc[erring]
        detail = "; ".join(
            f"{host}: " + ", ".join(_counted(n, _IB_ERRORS[m]) for m, n in counts.items() if n > 0)
            for host, counts in gained.iterrows()
        )
        ranks = sorted(r for r in slow if hosts.get(r) in erring)
        found.append(_cause("infiniband_errors", ranks, detail, str(gained.sum().idxmax())))
    return found


def _counted(n: float, thing: str) -> str:
    return f"{int(n)} {thing}{'' if int(n) == 1 else 's'}"


def _cause(cause: str, ranks: list[int], detail: str, metric: str) -> dict:
    return {"cause": cause, "ranks": [int(r) for r in ranks], "detail": detail, "metric": metric}


def _per_rank(devices: pd.DataFrame, name: str, how: str = "median") -> pd.Series:
    """A metric's samples, per rank: their median (or `how`)."""
    return devices.loc[devices["metric"] == name].groupby("rank")["value"].agg(how)


def _rises(devices: pd.DataFrame, metrics: Iterable[str]) -> pd.DataFrame:
    """Per rank (rows) and metric (columns): what each counter gained from reading to reading over the
    samples (the series of one reading summed: a host's ports), a drop (the driver reloaded) gaining
    nothing. Readings in time order (`ts`), else in the samples' order."""
    of = devices.loc[devices["metric"].isin(list(metrics))]
    if of.empty:
        return pd.DataFrame(index=pd.Index([], name="rank"))
    if "ts" in of:
        of = of.groupby(["rank", "metric", "ts"], as_index=False)["value"].sum()
    gained = of.groupby(["rank", "metric"])["value"].diff().clip(lower=0).fillna(0.0)
    return gained.groupby([of["rank"], of["metric"]]).sum().unstack("metric", fill_value=0.0)


def _apart(flags: pd.Series, slow: Iterable) -> list:
    """The entries of `flags` (by rank, or by host) among `slow` that are set, unless PEERS_SHARE or more of
    the others are set too: a fault most of them share explains none of theirs."""
    mine = flags.index.isin(list(slow))
    if flags[~mine].mean() >= PEERS_SHARE:
        return []
    return sorted(flags.index[mine & flags.to_numpy(dtype=bool)].tolist())


def _hosts(devices: pd.DataFrame) -> pd.Series:
    """Each rank's host (rank -> name); a rank whose host is unknown stands for its own."""
    ranks = pd.Index(devices["rank"].unique())
    own = pd.Series([f"rank {r}'s host" for r in ranks], index=ranks, dtype=object)
    if "host" not in devices:
        return own
    return devices.groupby("rank")["host"].first().reindex(ranks).combine_first(own)


def describe(found: list[dict]) -> str:
    """One clause per cause: "GPU clocks held back (thermal slowdown) on rank 12"."""
    words = {
        "clocks_held_back": "GPU clocks held back ({})",
        "memory_full": "GPU memory {}",
        "ecc_errors": "{}",
        "xid": "{}",
        "pcie_replays": "{}",
        "pcie_link_degraded": "PCIe link below its peers' ({})",
        "nvlink_errors": "NVLink errors ({})",
        "row_remapping": "GPU memory: {}",
        "memory_hot": "GPU memory (HBM) at {}",
        "infiniband_errors": "InfiniBand errors on the host ({})",
    }
    return "; ".join(f"{words[c['cause']].format(c['detail'])} on {ranksets.phrase(c['ranks'])}" for c in found)
