"""A hung rank in a simulated fleet, through `rankwatch simulate` and a real collector: the live hang
analyzer names that rank, and the all-reduce the others are blocked in, in one finding (no false stall
while the steps arrived); a clean run of the same fleet draws none. Also: a Parquet trace ends before
the hung step, and the hangs the simulator cannot run are refused in one line."""

import json

import pandas as pd
import pytest

from rankwatch.cli import main
from tests.support.collectors import simulated_store
from tests.support.otlp_payloads import query

pytestmark = pytest.mark.long

RANKS, HUNG, AT = 64, 37, 6  # 4 pipeline stages of 16 data-parallel replicas; rank 37 is in stage 2
RUNS = {"sim-clean": [], "sim-hang": [f"hang:rank={HUNG},at={AT}"]}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Both runs into one store, each through a collector of its own with a stall floor of 3 s, so
    that a hang is five ~1 s steps without progress; the stuck ranks' heartbeats go on for 10 s, past
    that. (A collector judges a run only while it runs: the clean run, ended, is not judged again,
    however long the hung one takes on a loaded machine.)"""
    directory = tmp_path_factory.mktemp("sim-hang")
    for run, faults in RUNS.items():
        db = simulated_store(
            directory,
            {run: faults},
            ["--ranks", str(RANKS), "--pp", "4", "--steps", "40", "--hang-for", "10"],
            ("--analyze-every", "1", "--hang-after", "3"),
        )
    return db


def hang_findings(store, run: str) -> list[tuple]:
    return query(
        store,
        """SELECT kind, ranks, state, step_start, evidence FROM findings
                           WHERE run_id = ? AND analyzer = 'hangs' ORDER BY id""",
        [run],
    )


def test_hung_rank_is_named_with_the_collective_the_others_wait_in(store):
    (finding,) = hang_findings(store, "sim-hang")
    kind, ranks, state, step_start, evidence = finding
    assert (kind, list(ranks), state, step_start) == ("hang", [HUNG], "firing", AT)
    evidence = json.loads(evidence)
    assert evidence["collective"] == {
        "op": "all_reduce",
        "group": "world",
        "seq": AT,
        "waiting_ranks": [r for r in range(RANKS) if r != HUNG],
    }
    assert evidence["culprit_last_seen"] == {str(HUNG): {"step": AT, "phase": "compute"}}
    assert evidence["silent_ranks"] == []


def test_hang_run_stops_before_the_hung_step_and_logs_the_fault(store):
    assert query(store, "SELECT max(step), count(DISTINCT rank) FROM steps WHERE run_id = 'sim-hang'") == [
        (AT - 1, RANKS)
    ]
    assert query(
        store,
        """SELECT step, rank, attrs->>'$."rankwatch.fault"' FROM events
                           WHERE run_id = 'sim-hang' AND event = 'fault_injected'""",
    ) == [(AT, HUNG, f"hang:rank={HUNG},at={AT}")]


def test_clean_run_has_no_hang_and_heartbeats_from_every_rank(store):
    assert hang_findings(store, "sim-clean") == []
    assert query(
        store, "SELECT count(DISTINCT rank) FROM events WHERE run_id = 'sim-clean' AND event = 'heartbeat'"
    ) == [(RANKS,)]


def test_parquet_trace_ends_before_the_hung_step(tmp_path):
    out = tmp_path / "hang.parquet"
    main(["simulate", "--ranks", "8", "--pp", "2", "--steps", "10", "--inject", "hang:rank=3,at=4", "--out", str(out)])
    ops = pd.read_parquet(out)
    assert sorted(ops["step"].unique()) == [0, 1, 2, 3] and ops["rank"].nunique() == 8
    truth = json.loads((tmp_path / "hang.parquet.truth.json").read_text())
    assert truth["faults"] == [{"spec": "hang:rank=3,at=4", "kind": "hang", "at": 4, "rank": 3}]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("hang:rank=3,at=0", ["at must be within 1..9"]),
        ("hang:rank=3,at=10", ["at=10 is not in the job", "0..9"]),
        ("hang:rank=3,at=4,seconds=5", ["--hang-for", "`rankwatch train`"]),
    ],
)
def test_hangs_the_simulator_cannot_run_are_refused(tmp_path, capsys, spec, words):
    out = tmp_path / "refused.parquet"
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--ranks", "8", "--steps", "10", "--inject", spec, "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("rankwatch: error: "), err
    assert all(word in err for word in words), err
    assert not out.exists()
