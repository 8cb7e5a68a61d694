"""Fleet-simulator scenarios through a real collector: each fault is found with the right ranks and
pattern by the live analyzers (a loss spike and a NaN in the simulated training curve by the anomaly
analyzer); a clean run produces no finding."""

import pytest

from tests.support.collectors import simulated_store
from tests.support.otlp_payloads import query

pytestmark = pytest.mark.long

# 64 ranks: 4 pipeline stages of 8 data-parallel replicas of 2 tensor-parallel ranks; 8 ranks per host
# (2 hosts per stage). Rank 21 is in data-parallel group dp3 (stage 1, tp rank 1) and tensor-parallel
# group tp10 (with rank 20).
SCENARIOS = {
    "clean": ([], []),
    "rank": (["straggler:rank=37,slowdown=1.10,from=5"], [("stragglers", "rank", [37])]),
    "node": (["slow-node:node=3,slowdown=1.2,from=5"], [("stragglers", "node", list(range(24, 32)))]),
    "stage": (["slow-stage:stage=2,slowdown=1.2,from=5"], [("stragglers", "stage", list(range(32, 48)))]),
    "thermal": (["thermal:rank=5,from=5"], [("stragglers", "rank", [5])]),
    "skew": (["data-skew:cv=0.3"], [("stragglers", "widespread", None)]),
    "link": (["slow-link:rank=21,factor=3,from=5"], [("links", "link", [21])]),
    # the trainer's spike scales the loss it back-propagates, so its gradient norm spikes too
    "spike": (["spike:at=25,scale=5"], [("anomalies", "loss_spike", []), ("anomalies", "grad_spike", [])]),
    "nan": (["nan:at=25"], [("anomalies", "nan", [])]),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    # the collector's own analysis cadence: each commit of steps wakes a pass over its runs, and the timer, which
    # judges every active run again (for stalls, which none of these has), at its default
    return simulated_store(
        tmp_path_factory.mktemp("sim"),
        {f"sim-{name}": faults for name, (faults, _) in SCENARIOS.items()},
        ["--ranks", "64", "--pp", "4", "--tp", "2", "--steps", "30"],
    )


@pytest.fixture(scope="module")
def findings(store):
    # the problems found: power recommendations (severity info) are advice, drawn for every fleet
    return {
        name: query(
            store,
            """SELECT analyzer, kind, ranks, state FROM findings
                                  WHERE run_id = ? AND severity != 'info' ORDER BY id""",
            [f"sim-{name}"],
        )
        for name in SCENARIOS
    }


@pytest.fixture(scope="module")
def findings_evidence(store):
    import json

    (evidence,) = query(
        store,
        """SELECT evidence FROM findings WHERE run_id = 'sim-thermal'
                                  AND analyzer = 'stragglers' AND state = 'firing'""",
    )[0]
    return json.loads(evidence)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(findings, name):
    expected = SCENARIOS[name][1]
    firing = [(analyzer, kind, list(ranks)) for analyzer, kind, ranks, state in findings[name] if state == "firing"]
    # expected ranks None: whichever ranks (a widespread slowdown names none in particular)
    assert len(firing) == len(expected) and all(
        (a, k) == (ea, ek) and er in (None, r) for (a, k, r), (ea, ek, er) in zip(firing, expected)
    ), firing


def test_thermal_finding_carries_clock_and_temperature_evidence(findings_evidence):
    devices = findings_evidence["devices"]
    assert devices["DCGM_FI_DEV_SM_CLOCK"]["suspects"] < devices["DCGM_FI_DEV_SM_CLOCK"]["peers"]
    assert devices["DCGM_FI_DEV_GPU_TEMP"]["suspects"] > devices["DCGM_FI_DEV_GPU_TEMP"]["peers"] + 15
    assert devices["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"] == {
        "suspects": ["sw_thermal_slowdown", "hw_thermal_slowdown"],
        "peers": [],
    }


def test_slow_link_finding_names_both_groups_of_the_rank(store):
    import json

    ((evidence,),) = query(store, "SELECT evidence FROM findings WHERE run_id = 'sim-link' AND analyzer = 'links'")
    groups = json.loads(evidence)["groups"]
    assert set(groups) == {"dp3", "tp10"}
    assert groups["dp3"]["busbw_gbps"] < groups["dp3"]["peer_busbw_gbps"] / 2
    assert 21 in groups["dp3"]["members"] and groups["tp10"]["members"] == [20, 21]
