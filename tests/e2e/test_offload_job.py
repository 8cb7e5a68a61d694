"""Offloaded training end to end: real 2-rank torchrun jobs (`rankwatch train --offload optimizer=disk`,
gloo on CPU, the `tiny` GPT) exporting to a live collector.

A serial job whose rank 1's disk slows to 20 MB/s at step 6 (`slow-disk`): every rank-step reads and
writes its optimizer state between disk and host as transfer spans of the state's bytes, the disk's probe
is said, the slow rank's steps wait on their swaps, and the collector names rank 1's disk, not rank 0's;
the what-if of `rankwatch analyze` counts the swaps and the host optimizer as op types, not as idle.
An overlapped job of the same model (one rank) on a healthy disk hides most of what the serial one waits for.
"""

import json
import math
import re
import statistics

import pandas as pd
import pytest

from rankwatch.agent import semconv as sc
from tests.support.collectors import job_collector
from tests.support.commands import rankwatch_cli, rankwatch_in_process
from tests.support.otlp_payloads import query

pytestmark = pytest.mark.long

SLOW_FROM, STEPS = 6, 20
MBPS = 20  # the slow disk's: a quarter of what a loaded machine's shared disk was seen to give (~80 MB/s)


def _job(directory, run: str, *args: str, nproc: int = 2):
    with job_collector(directory, "--analyze-every", "0.5") as collector:
        result = rankwatch_cli(
            "train",
            *("--nproc", str(nproc), "--run", run, "--collector", collector.url, "--offload", "optimizer=disk"),
            *args,
            env={"RANKWATCH_TOKEN": collector.token, "RANKWATCH_DB": str(collector.db)},  # the swap files beside it
        )
    assert result.returncode == 0, result.stderr[-3000:]
    return collector.db


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    return _job(
        tmp_path_factory.mktemp("offload-serial"),
        "run-serial",
        *("--steps", str(STEPS), "--inject", f"slow-disk:rank=1,mbps={MBPS},from={SLOW_FROM}"),
    )


def state_bytes() -> int:
    """What AdamW keeps per parameter, both moments in fp32: what a step reads and writes."""
    from trainer.job import CONFIGS
    from trainer.model import GPT

    return 2 * 4 * GPT(CONFIGS["tiny"]).num_params()


def test_every_step_swaps_the_optimizer_state_through_the_disk(serial):
    rows = query(
        serial,
        f"""SELECT rank, step, name, sum(CAST(attrs->>{sc.json_path(sc.TRANSFER_BYTES)} AS BIGINT)), count(*)
            FROM ops WHERE run_id = 'run-serial' AND kind = 'transfer' GROUP BY ALL ORDER BY ALL""",
    )
    by = {(rank, step, name): nbytes for rank, step, name, nbytes, _ in rows}
    size = state_bytes()
    for rank in (0, 1):
        for step in range(1, STEPS):  # (step 0 also holds the state's first write, before training)
            assert by[(rank, step, "host->disk")] == size
            assert by[(rank, step, "disk->host")] == size, (rank, step)  # a snapshot reads nothing more from disk
    probes = query(serial, "SELECT rank, attrs FROM events WHERE run_id = 'run-serial' AND event = 'disk_probe'")
    assert sorted(rank for rank, _ in probes) == [0, 1]
    assert all(json.loads(a)[sc.DISK_PROBE_READ_BPS] > 0 for _, a in probes)


def test_the_slow_disks_rank_waits_on_its_swaps_and_its_disk_is_named(serial):
    # what each rank-step waited on its swaps (serial: all of them), in seconds: a share of the step would
    # shrink with the compute a loaded machine stretches
    waits = query(
        serial,
        f"""SELECT rank, step >= {SLOW_FROM} + 2, median(CAST(attrs->>{sc.json_path(sc.TRANSFER_EXPOSED_S)} AS DOUBLE))
            FROM steps WHERE run_id = 'run-serial' GROUP BY ALL ORDER BY ALL""",
    )
    waited = {(rank, slowed): s for rank, slowed, s in waits}
    assert waited[(1, True)] >= 0.95 * 2 * state_bytes() / (MBPS * 1e6), waited  # the state read and written at MBPS
    assert waited[(1, True)] > 2 * max(waited[(1, False)], waited[(0, True)]), waited
    found = query(
        serial,
        "SELECT kind, ranks, step_start, summary FROM findings WHERE run_id = 'run-serial' AND analyzer = 'tiers'",
    )
    slow = [f for f in found if f[0] == "slow_disk"]
    assert slow and all(ranks == [1] for _, ranks, *_ in slow), found
    onset = min(start for _, _, start, _ in slow)
    assert SLOW_FROM - 2 <= onset <= SLOW_FROM + 20, slow
    if onset < SLOW_FROM:  # the shared disk of a loaded machine slowed first: rank 1's own series says so
        rates = dict(
            query(
                serial,
                f"""SELECT step, sum(CAST(attrs->>{sc.json_path(sc.TRANSFER_BYTES)} AS BIGINT)) / sum(duration_s)
                    FROM ops WHERE run_id = 'run-serial' AND kind = 'transfer' AND rank = 1 GROUP BY step""",
            )
        )
        before = statistics.median(r for step, r in rates.items() if step < onset)
        after = statistics.median(r for step, r in rates.items() if step >= SLOW_FROM)
        assert abs(math.log(rates[onset] / after)) < abs(math.log(rates[onset] / before)), (onset, rates)
    paced = re.match(r"rank 1 swaps to disk at ([\d.]+) MB/s since step \d+, against", slow[0][3])
    # the fault's cap, less its sleeps' overshoot
    assert paced and 0.75 * MBPS <= float(paced.group(1)) <= MBPS, slow[0][3]


def test_the_what_if_counts_swaps_and_the_host_optimizer_as_op_types_not_idle(serial):
    """`rankwatch analyze`: the swaps each way and the host optimizer, outside the step's phases, are op types
    of the replayed step; what is left to launch delay and idle is the little nothing recorded (the
    gradients gathered into the host's buffers, the parameters copied back)."""
    result = rankwatch_in_process("analyze", "run-serial", "--db", str(serial), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"transfer:disk->host", "transfer:host->disk", "host:optimizer"} <= set(report["op_types"]), report
    assert report["idle_slowdown"] < 1.2, report


def test_overlap_hides_the_swaps_serial_waits_for(serial, tmp_path_factory):
    overlapped = _job(
        tmp_path_factory.mktemp("offload-overlap"),
        "run-overlap",
        "--steps",
        "8",
        "--offload-schedule",
        "overlap",
        nproc=1,
    )

    def exposed(db, run: str) -> float:
        return statistics.median(
            v
            for (v,) in query(
                db,
                f"""SELECT CAST(attrs->>{sc.json_path(sc.TRANSFER_EXPOSED_S)} AS DOUBLE) FROM steps
                    WHERE run_id = ? AND step BETWEEN 1 AND {SLOW_FROM - 1}""",
                [run],
            )
        )

    assert exposed(overlapped, "run-overlap") < 0.5 * exposed(serial, "run-serial")


def test_the_memory_page_shows_the_findings_the_what_if_and_each_directions_bandwidth(serial, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from tests.support.dashboard_pages import APP, drawn, reading

    reading(monkeypatch, serial)
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    at.selectbox(key="run").set_value("run-serial")
    at.switch_page("views/tiers.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("tiers / slow_disk** on rank 1" in w.value for w in [*at.warning, *at.info]), at.warning
    labels = [m.label for m in at.metric]
    assert labels == ["step now", "swaps back to back", "swaps overlapped"], labels
    lines = pd.concat(drawn(at, "line"))
    assert {"disk->host", "host->disk", "disk probe, read", "exposed (no compute hid it)"} <= set(lines["what"])
