"""Hardware that explains a slow rank: its GPU's clocks held back (power cap, heat), its GPU
memory full, or its GPU raising ECC errors or XIDs.

Pure: device samples (rank, metric, value; DCGM names) and the slow ranks in, causes out. A
condition every GPU shares (the whole job power-capped, every GPU's memory nearly full)
explains no one rank's slowness, so held clocks and full memory count only where most peers
are clear of them; errors that arise on a slow rank's GPU always count.
"""

from functools import reduce
from operator import or_

import pandas as pd

from collector import ranksets
from rankwatch.agent import semconv as sc

SLOWING = 0x4 | 0x8 | 0x20 | 0x40 | 0x80  # clock-event reasons that slow compute: power cap, slowdowns, brake
HELD_SHARE = 0.5  # a GPU is held back when a reason is set in at least this share of its samples
FULL = 0.95  # GPU memory this full leaves the allocator thrashing (cache flushes, retries)


def causes(devices: pd.DataFrame | None, slow: list[int]) -> list[dict]:
    """The hardware causes among `slow` ranks: [{"cause", "ranks", "detail"}], where cause is
    `clocks_held_back` (detail: the reasons in words), `memory_full` (the fullest GPU's share),
    `ecc_errors` (corrected and uncorrected errors that arose in the samples' span) or `xid`
    (the XID codes)."""
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
    return found


def describe(found: list[dict]) -> str:
    """One clause per cause: "GPU clocks held back (thermal slowdown) on rank 12"."""
    words = {
        "clocks_held_back": "GPU clocks held back ({})",
        "memory_full": "GPU memory {}",
        "ecc_errors": "{}",
        "xid": "{}",
    }
    return "; ".join(f"{words[c['cause']].format(c['detail'])} on {ranksets.phrase(c['ranks'])}" for c in found)
