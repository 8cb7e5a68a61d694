"""Every dashboard page, run with Streamlit's AppTest against a store filled through real
collectors (tests/support/dashboard_store.py): no exception on any page for any run, and the numbers
and ranks each page leads with are the ones the store holds. The Overview is also read through
a running collector's query API, and `rankwatch dashboard` refuses a store it cannot read."""

import json
import re
import shutil
import time
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import duckdb
import pandas as pd
import pyarrow as pa
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from collector import quantities, ranksets
from collector.alerts import rules
from collector.analysis import findings
from collector.analysis.analyzers import Finding, health
from collector.reports.query import run_remote
from dashboard import charts, evidence, ui
from dashboard.source import COLLECTOR_ENV
from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from tests.support import loopback
from tests.support.collectors import Collector, job_collector
from tests.support.commands import rankwatch_in_process
from tests.support.dashboard_pages import APP, PAGES, chart, drawn, open_page, reading, shown, texts
from tests.support.dashboard_store import BARE, ENDED, FLEET, FLIGHT, HANG, IMPORTED, LOADER, NAN, SOLO
from tests.support.otlp_payloads import step_spans, trace_body
from tests.support.waits import wait_until

pytestmark = pytest.mark.long

RUNS = tuple(run["run"] for run in (FLEET, HANG, NAN, BARE, ENDED, LOADER, SOLO, IMPORTED, FLIGHT))


@pytest.fixture
def from_store(dashboard_store, monkeypatch):
    """The dashboard reads the fixture store's file (as `rankwatch dashboard --db`), a day after it was
    built: its runs stopped sending then, and whether the silence threshold has passed since must not
    depend on the order the tests run in (the simulator's clock may also run ahead of the wall's)."""
    monkeypatch.setattr(ui, "now", lambda: pd.Timestamp.now(tz="UTC") + pd.Timedelta(days=1))
    reading(monkeypatch, dashboard_store)
    return open_page


@pytest.mark.parametrize("run", RUNS)
def test_every_page_renders(from_store, run):
    """Each page of each run, in one session as a person goes from page to page (the run chosen once)."""
    at = from_store(PAGES[0], run)
    for page in PAGES:
        at.switch_page(f"views/{page}.py").run()
        assert not at.exception, (page, [e.value for e in at.exception])
        assert len(at.title) == 1, page
        assert not [e for e in texts(at.error) if e.startswith("Query ")], page  # every query it runs answers


def test_overview_of_a_straggling_run(from_store):
    at = from_store("overview", FLEET["run"])
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Last step"] == str(FLEET["steps"] - 1)
    assert metrics["MFU · simulated"] == "—"  # the simulator reports none; its GPUs are simulated
    assert metrics["Last power · simulated"].endswith(" kW")  # a stopped store: no "now"
    assert float(metrics["Step time"].removesuffix(" s")) > 0.6  # 0.6 s of compute at full speed
    # under load the store's last pass can precede the simulator's last spans, which are then shown lost
    # (no pass came after them to take them off): that warning is not this test's
    (verdict,) = texts(at.main.error)  # the worst finding in words, once: no box under it says it again
    said, todo = verdict.split("\n\n")
    assert said.startswith(f"**Ranks {FLEET['straggler']}, {FLEET['thermal']} compute ") and "ms per step" in said
    assert f"GPU clocks held back (thermal slowdown, hardware thermal slowdown) on rank {FLEET['thermal']}" in said
    assert todo == f"**What to do:** {evidence.NEXT_STEPS['stragglers / rank']}"
    assert "stragglers /" not in verdict and at.main.expander[0].label == "its evidence"


def test_overview_of_an_imported_trace_tells_its_what_if_not_healthy(from_store):
    """Two profiled ranks, imported: the Overview says how much the slow rank cost (the import's
    what-if finding), never that the run is healthy."""
    at = from_store("overview", IMPORTED["run"])
    shown = " ".join(texts(at.main.markdown) + texts(at.main.warning) + texts(at.main.success))
    assert "Healthy" not in shown and "No analyzer finds anything wrong" not in shown
    assert "slowdown 1.06x, pattern worker (rank 1)" in shown
    # a trace recorded elsewhere, not a run gone silent; as long as its two profiled steps, not its import
    status, length = texts(at.main.markdown)[0].split(" · ")
    assert status.startswith("**Imported trace, recorded until ") and "silent" not in shown.lower()
    assert length.endswith(" s long") and 0 < float(length.removesuffix(" s long")) < 10
    assert any(t.startswith("An imported trace: the figures are its last steps'") for t in texts(at.caption))
    assert not any(t.startswith("Stale") for t in texts(at.caption))


def test_an_imported_flight_recorder_dump_shows_where_each_rank_stands_in_its_collectives(from_store):
    """Dumps hold collectives, no steps: the Overview says so and what went wrong (the hang the dumps
    show); the Hangs page names the culprit and groups the ranks by the newest collective each
    entered, since no heartbeat says where they were."""
    at = from_store("overview", FLIGHT["run"])
    assert texts(at.main.markdown)[0].startswith("**Imported trace, recorded until ")
    (verdict,) = texts(at.main.warning)
    assert verdict.startswith("**What went wrong (held to the trace's end):** Ranks 0, 1, 3 are blocked in all_reduce")
    assert verdict.endswith(f"**What to do:** {evidence.NEXT_STEPS['hangs']}")
    (story,) = [t for t in texts(at.main.markdown) if t.startswith("- **hangs / hang**")]
    assert story.startswith("- **hangs / hang** (critical, held to the trace's end):")
    assert any(t.startswith("This trace records no training steps") for t in texts(at.main.info))
    at = from_store("hangs", FLIGHT["run"])
    (verdict,) = texts(at.main.error)
    assert verdict == f"**Hung when the trace was taken.** Culprits: **rank {FLIGHT['culprit']}**."
    (progress,) = at.dataframe
    world = progress.value[progress.value["group"] == "0"].set_index("which")
    waiting = ", ".join(str(r) for r in range(FLIGHT["ranks"]) if r != FLIGHT["culprit"])
    assert world.loc[waiting, ["op", "seq", "state"]].tolist() == ["all_reduce", FLIGHT["seq"], "started"]
    assert world.loc[str(FLIGHT["culprit"]), ["seq", "completed"]].tolist() == [FLIGHT["seq"] - 1] * 2


def test_overview_of_a_rolled_back_run_says_what_went_wrong_with_throughput_mfu_and_power(from_store):
    """Nothing fires at the run's end, yet its loss turned NaN and it was rolled back: that is its story, not
    "healthy"; its figures are its last ones (the run is silent), and say so."""
    at = from_store("overview", NAN["run"])
    metrics = {m.label: m.value for m in at.metric}
    ranks = NAN["ranks"]
    assert metrics == {
        "Last step": str(NAN["steps"] - 1),
        "Step time": "0.100 s",
        "Tokens/s": f"{ranks * 1024 / 0.1:,.0f}",
        "MFU": "40.0%",  # measured GPUs: no "simulated"
        "Last power": quantities.power(sum(NAN["watts"] + 10 * r for r in range(ranks))),
    }
    assert not [t for t in texts(at.main.success) if "Healthy" in t]
    assert texts(at.main.markdown)[0].startswith("**Silent since ")
    assert any(
        t.startswith("Stale (silent since ") and "the figures are as of its last step" in t for t in texts(at.caption)
    )
    (verdict,) = [t for t in texts(at.main.warning) if t.startswith("**What went wrong")]
    assert verdict.startswith("**What went wrong (rolled back):** Loss or gradient norm is not finite since step 30")
    story = texts(at.main.markdown)
    assert any(t.startswith("- **anomalies / nan** (critical, rolled back):") for t in story), story
    (rollback,) = [t for t in story if t.startswith("- **Rollback ")]
    assert rollback.endswith(f"applied at step {NAN['steps'] + 1}: the job went back to step {NAN['restored']}.")
    commands = at.dataframe[0]
    assert commands.value[["kind", "state", "apply_step"]].values.tolist() == [
        ["rollback", "applied", NAN["steps"] + 1]
    ]


def test_overview_of_an_ended_run_tells_what_went_wrong(from_store):
    """A straggler held to the run's end is what went wrong with it, with its onset and cost, not a resolved
    finding in a collapsed box; the run reads as ended, and its figures as of its last step."""
    at = from_store("overview", ENDED["run"])
    status, length = texts(at.main.markdown)[0].split(" · ")
    assert status.startswith("**Ended ") and length.endswith(" s long")  # its steps span about 20 s
    assert 10 <= float(length.removesuffix(" s long")) < 60
    assert not [t for t in texts(at.main.success) if "Healthy" in t]
    (verdict,) = texts(at.main.warning)
    said, todo = verdict.split("\n\n")
    assert said.startswith(f"**What went wrong (held to the run's end):** Rank {ENDED['slow']} computes 100% slower")
    assert todo == f"**What to do:** {evidence.NEXT_STEPS['stragglers / rank']}"
    (item,) = [t for t in texts(at.main.markdown) if t.startswith("- **stragglers / rank**")]
    assert item.startswith(f"- **stragglers / rank** (critical, held to the run's end): rank {ENDED['slow']} computes")
    onset = int(re.search(r"since step (\d+)", item)[1])
    assert abs(onset - ENDED["from"]) <= 6 and f"Steps {onset}–{ENDED['steps'] - 1}." in item
    assert item.count(" ms per step") == item.count("GPU-hours so far") == 1  # its cost, said once
    assert any(t.startswith("Stale (ended ") for t in texts(at.caption))
    headline = texts(from_store("stragglers", ENDED["run"]).markdown)[0]
    assert headline == f"### Suspects until the run's end: rank {ENDED['slow']}, pattern *rank*"


def test_overview_of_a_run_where_nothing_was_ever_found_is_healthy(from_store):
    at = from_store("overview", BARE["run"])
    assert texts(at.main.success)[0].startswith("**Healthy.**")


def test_overview_of_a_hung_run(from_store):
    at = from_store("overview", HANG["run"])
    (verdict,) = texts(at.main.error)  # the hang finding once, in the verdict
    assert verdict.startswith("**Hung.**") and f"which rank {HANG['rank']} never entered" in verdict
    assert verdict.endswith(f"**What to do:** {evidence.NEXT_STEPS['hangs']}")  # beside it, not a page away
    assert f"ranks 0–{HANG['rank'] - 1}, {HANG['rank'] + 1}–{HANG['ranks'] - 1} are blocked" in verdict
    assert not any("Power recommendations" in t for t in texts(at.main.info))  # no cap reaches a hung job
    assert "No power recommendation: the run is hung, so no cap would reach the job." in texts(at.main.caption)
    assert texts(at.main.markdown)[0].startswith("**Hung, silent since ")  # its heartbeats stopped: still hung


def test_the_run_list_gives_each_runs_status_duration_ranks_and_worst_finding(from_store):
    at = from_store("overview", BARE["run"])
    listed = at.dataframe[-1].value.set_index("run")
    assert listed.loc[ENDED["run"], "status"].startswith("ended ")
    assert listed.loc[HANG["run"], "status"].startswith("hung, silent since ")
    assert listed.loc[BARE["run"], "status"].startswith("silent since ")
    assert listed.loc[IMPORTED["run"], "status"].startswith("imported trace, recorded until ")
    assert listed.loc[ENDED["run"], "ranks"] == ENDED["ranks"] and listed.loc[HANG["run"], "ranks"] == HANG["ranks"]
    assert listed.loc[ENDED["run"], "worst finding"].startswith(f"stragglers / rank: rank {ENDED['slow']} computes")
    assert listed.loc[BARE["run"], "worst finding"] == "none"
    assert all(listed["duration"].str.fullmatch(r"\d+\.\d\d s|\d+ s|\d+ min \d\d s|\d+ h \d\d min")), listed["duration"]


def test_stragglers_names_the_suspects_with_cost_heatmap_and_timeline(from_store):
    at = from_store("stragglers", FLEET["run"])
    suspects = sorted([FLEET["straggler"], FLEET["thermal"]])
    markdown = texts(at.markdown)
    assert f"### Suspects: ranks {suspects[0]}, {suspects[1]}, pattern *rank*" in markdown
    assert any(re.match(r"Costs \*\*\d+(\.\d+)? ms per step\*\*", m) and "GPU-hours so far" in m for m in markdown)
    assert f"Ranks {suspects[0]}, {suspects[1]} lose the time in **compute**: " in "".join(markdown)
    (slowest,) = at.dataframe
    assert sorted(slowest.value["rank"].head(2)) == suspects
    assert slowest.value["time_ratio"].iloc[1] > 1.15 > slowest.value["time_ratio"].iloc[2]
    # the finding's top ranks and its ranks against their peers, the heatmap and the timeline
    assert len(at.get("vega_lite_chart")) == 4
    (heatmap,) = [
        spec for spec, _ in map(chart, at.get("vega_lite_chart")) if spec.get("mark", {}).get("type") == "rect"
    ]
    assert heatmap["encoding"]["x"]["scale"]["zero"] is False  # a run's steps, not 0 to them (two steps at 551)
    assert at.number_input(key="timeline_step").value == FLEET["steps"] - 1
    at.number_input(key="timeline_step").set_value(20).run()
    assert not at.exception
    assert at.query_params["step"] == "20"  # the page's URL shows what it shows


def test_ranks_and_nodes_lead_with_the_slow_nodes_and_filter_by_host(from_store):
    """Every rank where it runs and how it does; per node, the slowest first (the straggler's and the
    throttled rank's nodes), with a link to their heatmap rows; a host filter keeps that node's ranks."""
    at = from_store("ranks", FLEET["run"])
    nodes, ranks = (frame.value for frame in at.dataframe)
    assert sorted(ranks["rank"]) == list(range(FLEET["ranks"]))
    host_of = dict(zip(ranks["rank"], ranks["host"], strict=True))
    slow = {host_of[FLEET["straggler"]], host_of[FLEET["thermal"]]}
    assert set(nodes["host"].head(len(slow))) == slow
    assert nodes["worst_ratio"].iloc[0] > 1.15 and (nodes["worst_ratio"].iloc[len(slow) :] < 1.15).all()
    assert nodes["ranks"].map(lambda text: len(ranksets.parse(text))).sum() == FLEET["ranks"]
    (link,) = [p for p in at.page_link if p.proto.page == "stragglers"]
    params = dict(parse_qsl(link.proto.query_string))
    assert set(ranksets.parse(params["ranks"])) == {r for r, h in host_of.items() if h == nodes["host"].iloc[0]}
    at.text_input(key="host_filter").set_value(host_of[FLEET["straggler"]]).run()
    assert not at.exception
    nodes, ranks = (frame.value for frame in at.dataframe)
    assert list(nodes["host"]) == [host_of[FLEET["straggler"]]]
    assert FLEET["straggler"] in set(ranks["rank"]) and set(ranks["host"]) == {host_of[FLEET["straggler"]]}
    assert at.query_params["host"] == host_of[FLEET["straggler"]]


def test_straggler_evidence_reads_as_figures_top_ranks_and_what_to_do_not_raw_json(from_store):
    """A finding's evidence is its figures in units, its per-rank values as the top ranks (the slowest
    first) with the rest in words, and what to do; the raw JSON is a download, never shown."""
    at = from_store("stragglers", FLEET["run"])
    assert not at.json
    (ranked,) = [data for data in drawn(at, "bar") if list(data.columns) == ["rank", "value"]]
    assert set(ranked["rank"].head(2)) == {FLEET["straggler"], FLEET["thermal"]}  # the slowest first
    assert ranked["value"].is_monotonic_decreasing and len(ranked) == evidence.TOP_RANKS
    assert ranked["value"].iloc[1] > 1.15 > ranked["value"].iloc[2]
    more = f"and {FLEET['ranks'] - evidence.TOP_RANKS} more ranks, "
    assert any(t.startswith(more) for t in texts(at.caption))
    assert f"**What to do:** {evidence.NEXT_STEPS['stragglers / rank']}" in texts(at.markdown)
    figures = at.table[0].value.map(shown)
    assert re.fullmatch(r"\d+(\.\d+)? ms", figures.loc["lost per step", "value"])  # not 0.19405014187434...
    assert figures.loc["lost", "value"].endswith("%")
    (download,) = at.get("download_button")
    assert download.proto.label == "raw evidence (JSON)"
    # its ranks against their peers, step by step, from before its onset: slower from there on, alike before
    (against,) = [
        data for data in drawn(at, "line") if set(data["what"]) == {"their compute", "peers' compute", "step time"}
    ]
    onset = int(re.search(r"since step (\d+)", at.main.error[0].value)[1])
    wide = against.pivot(index="step", columns="what", values="seconds")
    assert wide.index.min() < onset <= 10 + 6 and wide.index.max() == FLEET["steps"] - 1
    ratio = wide["their compute"] / wide["peers' compute"]
    assert (ratio[wide.index >= 12] > 1.1).all() and (ratio[wide.index < 9] < 1.05).all()


def test_evidence_is_read_by_shape_whatever_the_job_size():
    """A 1,024-rank map is a per-rank series, a step map a series, records tables, figures in units."""
    read = evidence.read(
        {
            "compute_ratio_by_rank": {str(r): 1.0 + (r == 700) for r in range(1024)},
            "values": {"150": 102.5, "151": 3.1},
            "hardware": [{"cause": "clocks_held_back", "ranks": [700], "detail": "thermal slowdown"}],
            "devices": {sc.GPU_TEMP_C: {"suspects": 85.04, "peers": 61.9}},
            "lost_s_per_step": 0.19405014187434,
            "cap_w": 650.0,
            "saving_j_per_step_range": [4541.3, 4595.1],
            "slowdown": 1.0049575582507,
            "collective": {"op": "all_reduce", "waiting_ranks": [0, 1, 2, 4]},
        }
    )
    ((key, per_rank),) = read.by_rank
    assert key == "compute_ratio_by_rank" and len(per_rank) == 1024 and per_rank.idxmax() == 700
    assert [k for k, _ in read.by_step] == ["values"]
    tables = dict(read.tables)
    assert tables["hardware"].to_dict("records") == [
        {"cause": "clocks_held_back", "ranks": "700", "detail": "thermal slowdown"}
    ]
    assert tables["devices"].to_dict("records") == [
        {"devices": "GPU temperature", "suspects": "85 °C", "peers": "61.9 °C"}
    ]
    assert dict(read.figures.values.tolist()) == {
        "lost per step": "194 ms",
        "cap": "650 W",
        "saving per step range": "4.54 kJ to 4.6 kJ",
        "slowdown": "+0.5%",
        "collective: op": "all_reduce",
        "collective: waiting ranks": "0–2, 4",
    }
    assert evidence.rest_of_ranks(key, per_rank) == f"{1024 - evidence.TOP_RANKS:,} more ranks, all 1x"


def test_a_finding_links_to_its_ranks_and_steps_on_the_stragglers_page_which_shows_only_those(from_store):
    """The evidence links to the Stragglers page with the finding's ranks and first step; that page
    takes them as its rank filter and timeline step, and its heatmap, table and timeline hold those ranks."""
    at = from_store("overview", FLEET["run"])
    suspects = sorted([FLEET["straggler"], FLEET["thermal"]])
    (link,) = [p for p in at.page_link if p.proto.page == "stragglers"]
    params = dict(parse_qsl(link.proto.query_string))
    assert params["run"] == FLEET["run"] and ranksets.parse(params["ranks"]) == suspects
    assert link.value.startswith(f"See the heatmap rows of ranks {suspects[0]}, {suspects[1]}")

    at = AppTest.from_file(str(APP), default_timeout=60)
    for name, value in params.items():
        at.query_params[name] = value
    at.switch_page("views/stragglers.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.text_input(key="rank_filter").value == params["ranks"]
    assert at.number_input(key="timeline_step").value == int(params["step"])
    (cells,) = drawn(at, "rect")
    assert sorted(cells["rank_lo"].unique()) == suspects and set(cells["worst_rank"]) == set(suspects)
    assert sorted(at.dataframe[0].value["rank"]) == suspects
    (spans,) = [data for data in drawn(at, "bar") if "start_s" in data]
    assert set(suspects) <= set(spans["rank"])  # the chosen ranks, against typical ones

    at.text_input(key="rank_filter").set_value("3-4").run()
    assert at.query_params["ranks"] == "3-4"
    (cells,) = drawn(at, "rect")
    assert sorted(cells["rank_lo"].unique()) == [3, 4]
    at.text_input(key="rank_filter").set_value("3-x").run()
    assert any("'3-x' is not a rank or a range" in e for e in texts(at.error))
    (cells,) = drawn(at, "rect")
    assert cells["rank_hi"].max() >= FLEET["ranks"] - 1  # every rank again


def test_a_window_of_steps_narrows_every_steps_chart_and_table_and_is_kept_across_pages(from_store):
    """The sidebar's Steps slider (or a link's `?steps=A-B`) keeps the step charts, the heatmap, the
    slowest ranks and the rank table to those steps; the window holds as the user moves between pages,
    and its wall-clock span is written under it. Out-of-range bounds are clamped to the run's steps."""
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update(run=FLEET["run"], steps="20-29")
    at.switch_page("views/stragglers.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.sidebar.slider(key="steps").value == (20, 29)
    assert any(re.fullmatch(r"\d{4}-.* UTC to \d{4}-.* UTC", c) for c in texts(at.sidebar.caption))
    (cells,) = drawn(at, "rect")
    assert cells["step_lo"].min() == 20 and cells["step_hi"].max() <= 30
    assert "Slowest ranks in the chosen steps" in [h.value for h in at.subheader]

    at.switch_page("views/overview.py").run()  # a link's parameters go; the window stays
    assert at.sidebar.slider(key="steps").value == (20, 29)
    (series,) = [data for data in drawn(at, "line") if "exposed comm" in set(data["what"])]  # the step times
    assert series["step"].between(20, 29).all() and series["step"].nunique() == 10

    at.sidebar.slider(key="steps").set_value((0, FLEET["steps"] - 1)).run()  # the whole run again
    assert "steps" not in at.query_params
    at.switch_page("views/ranks.py").run()
    assert at.sidebar.slider(key="steps").value == (0, FLEET["steps"] - 1)

    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update(run=FLEET["run"], steps=f"50-{10 * FLEET['steps']}")
    at.switch_page("views/ranks.py").run()
    assert at.sidebar.slider(key="steps").value == (50, FLEET["steps"] - 1)
    _, ranks = (frame.value for frame in at.dataframe)
    assert (ranks["steps"] == FLEET["steps"] - 50).all()  # each rank's figures over those steps


def test_an_alert_link_opens_its_page_with_the_finding_first(from_store, dashboard_store):
    with duckdb.connect(str(dashboard_store), read_only=True) as con:
        (finding_id,) = con.execute(
            "SELECT id FROM findings WHERE run_id = ? AND analyzer = 'stragglers'", [FLEET["run"]]
        ).fetchone()
    link = urlsplit(rules.dashboard_link("http://127.0.0.1:8501", FLEET["run"], "stragglers", finding_id))
    at = AppTest.from_file(str(APP), default_timeout=60)
    for name, value in parse_qsl(link.query):
        at.query_params[name] = value
    at.switch_page(f"views{link.path}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="run").value == FLEET["run"]
    assert at.main.caption[0].value == "The finding the link is about:"
    assert at.main.error[0].value.startswith(f"**stragglers / rank** on ranks {FLEET['straggler']}")
    assert at.main.expander[0].label == f"evidence of finding {finding_id}" and at.main.expander[0].proto.expanded
    assert at.title[0].value == "Stragglers"
    assert [e.label for e in at.main.expander].count(f"evidence of finding {finding_id}") == 1  # not shown twice

    at.query_params["finding"] = "999999"
    at.run()
    assert f"The link names finding 999999, which run {FLEET['run']} does not have." in texts(at.main.warning)


def test_a_link_to_an_unknown_run_says_so_instead_of_showing_another(from_store):
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params["run"] = "no-such-run"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert texts(at.main.error) == [
        (
            f"Run **no-such-run** is unknown: {texts(at.sidebar.caption)[0].removeprefix('reading ')} has no such "
            "run. Pick one in the sidebar."
        )
    ]
    assert not at.title  # no page of another run
    assert at.query_params["run"] == "no-such-run"
    at.run()  # an autorefresh keeps saying so
    assert len(at.main.error) == 1 and not at.title
    at.selectbox(key="run").select(FLEET["run"]).run()  # picking a run shows it
    assert not any("is unknown" in e.value for e in at.main.error)
    assert at.title and at.query_params["run"] == FLEET["run"]


def test_the_sidebar_shows_the_collectors_own_findings(dashboard_store, tmp_path, monkeypatch):
    db = tmp_path / "rankwatch.duckdb"
    shutil.copy(dashboard_store, db)
    with duckdb.connect(str(db)) as con:
        findings.record(
            con,
            health.RUN_ID,
            health.ANALYZER,
            [
                Finding(
                    health.RUN_ID,
                    "refused_exports",
                    [],
                    None,
                    None,
                    "critical",
                    0.5,
                    "50% of 40 OTLP exports refused",
                    analyzer=health.ANALYZER,
                )
            ],
        )
    reading(monkeypatch, db)
    at = open_page("stragglers", FLEET["run"])
    assert "Collector: 50% of 40 OTLP exports refused" in texts(at.sidebar.warning)


def test_stragglers_of_a_clean_run(from_store):
    at = from_store("stragglers", NAN["run"])
    assert "### No straggler now" in texts(at.markdown)


def test_collectives_shows_busbw_per_op_and_size(from_store):
    at = from_store("collectives", FLEET["run"])
    busbw, groups = at.dataframe
    # the simulator's tensor-parallel (32 MiB, 2 ranks) and data-parallel (512 MiB, 16 ranks) all-reduces
    assert busbw.value[["op", "bytes", "group_size"]].values.tolist() == [
        ["all_reduce", 32 * 2**20, 2],
        ["all_reduce", 512 * 2**20, 16],
    ]
    assert (busbw.value["busbw_gbps"] > 0).all()
    assert len(groups.value) == 8
    assert texts(at.main.success) == ["No slow link: every process group moves at its peers' pace."]


def test_collectives_empty_state(from_store):
    at = from_store("collectives", BARE["run"])
    assert any("No collectives with a size" in c for c in texts(at.caption))


def test_checkpoints_marks_anomaly_rollback_and_checkpoints(from_store):
    at = from_store("checkpoints", NAN["run"])
    (verdict,) = texts(at.main.warning)
    assert verdict == f"**1 rollback.** The latest (nan) is applied: the job restored step {NAN['restored']}."
    markers, rollbacks = at.dataframe
    marks = {(row.step, row.marker) for row in markers.value.itertuples()}
    assert {
        (NAN["nan_from"], "anomaly: nan"),
        (NAN["restored"], "rollback restored"),
        (NAN["nan_from"] - 5, "rollback target"),
        (NAN["restored"], "checkpoint_restored"),
        (0, "checkpoint_saved"),
        (10, "checkpoint_saved"),
        (20, "checkpoint_saved"),
    } <= marks
    assert (5, "checkpoint_saved") not in marks and (15, "checkpoint_saved") not in marks  # memory only: unmarked
    assert len(rollbacks.value) == 1
    loss, _ = at.get("vega_lite_chart")  # and the gradient norm's
    drawn = [pa.ipc.open_stream(d.data.data).read_pandas() for d in loss.proto.datasets]
    (abandoned,) = [d for d in drawn if "what" in d]
    (kept,) = [d for d in drawn if "loss" in d and "what" not in d]
    restored, spiked = NAN["restored"], NAN["nan_from"]
    assert list(abandoned["step"]) == list(range(restored, spiked))  # their finite losses: NaN is not drawn
    replayed = set(range(restored + 1, NAN["steps"]))  # as this store's job replays them
    assert set(kept["step"]) == set(range(restored)) | replayed  # the trajectory kept
    caption = f"Red points: the {NAN['steps'] - restored} steps rollbacks abandoned"
    assert any(c.startswith(caption) for c in texts(at.caption))


def test_checkpoints_empty_state(from_store):
    at = from_store("checkpoints", BARE["run"])
    assert texts(at.main.success) == ["No rollback: no anomaly has sent this run back to a checkpoint."]
    assert "The job reports no loss (`agent.record(loss=...)`)." in texts(at.caption)


def test_hangs_names_the_culprit_and_the_collective(from_store):
    at = from_store("hangs", HANG["run"])
    assert texts(at.main.markdown)[0].startswith("Run status: **hung, silent since ")
    (verdict,) = texts(at.main.error)  # the headline; the hang finding is not repeated under it
    assert verdict.startswith(f"**Hung in step {HANG['at']} for ") and f"Culprits: **rank {HANG['rank']}**" in verdict
    waiting = HANG["ranks"] - 1
    assert (
        f"{waiting} ranks (0–2, 4–7) are blocked in **all_reduce #{HANG['at']}** of group **world**, which "
        f"rank {HANG['rank']} never entered."
    ) in texts(at.markdown)
    (beats,) = at.dataframe
    by_size = {row.ranks: row for row in beats.value.itertuples()}
    assert by_size[waiting].which == "0–2, 4–7"
    assert (by_size[waiting].seq, by_size[waiting].done) == (HANG["at"], False)
    assert (by_size[1].which, by_size[1].phase) == (str(HANG["rank"]), "compute")


def test_hangs_of_a_run_that_never_stalled(from_store):
    said = texts(from_store("hangs", FLEET["run"]).success)[0]  # it no longer sends: no "steps keep finishing"
    assert said.startswith("Never hung while it sent telemetry; the run is silent since ")


def test_power_names_the_throttled_rank(from_store):
    at = from_store("power", FLEET["run"])
    (throttled,) = texts(at.main.warning)
    assert throttled == f"**Clocks held back on rank {FLEET['thermal']}**: thermal slowdown, hardware thermal slowdown."
    assert {m.label: m.value for m in at.metric}["Ranks sampled"] == str(FLEET["ranks"])


def power_advice(db: Path, run: str) -> dict[str, tuple[str, dict]]:
    """The run's firing power findings, by kind: summary and evidence."""
    with duckdb.connect(str(db), read_only=True) as con:
        return {
            kind: (summary, json.loads(evidence))
            for kind, summary, evidence in con.execute(
                """SELECT kind, summary, evidence FROM findings
               WHERE run_id = ? AND analyzer = 'power' AND state = 'firing'""",
                [run],
            ).fetchall()
        }


def test_power_of_a_stored_run_says_why_no_cap_applies_and_keeps_the_findings(from_store, dashboard_store):
    at = from_store("power", FLEET["run"])
    advice = power_advice(dashboard_store, FLEET["run"])
    assert {"job_cap", "per_rank_caps"} <= set(advice) and "headroom" not in set(advice)  # no budget, no headroom
    first = at.main.children[1]  # right under the title
    assert first.type == "info" and first.value == (
        "**No power cap to apply:** no collector is writing this store. What the power analyzer last found, for a "
        "re-run:"
    )
    assert not at.code and not at.main.success  # no command that could not reach the job
    body = "\n".join(texts(at.main.info))
    for summary, _ in advice.values():  # each finding once
        assert body.count(summary) == 1
    assert "more such node" not in body and "--facility-watts W" in "".join(texts(at.main.caption))
    assert any(h.startswith("Time/energy trade-off, one limit for every GPU") for h in texts(at.subheader))
    assert any("slowdown_pct" in chart.proto.spec for chart in at.get("vega_lite_chart"))
    assert any(t.startswith("**Simulated GPUs.**") for t in texts(at.main.info))
    metrics = {m.label for m in at.metric}
    assert {"Last power · simulated", "Energy per step · simulated"} <= metrics and "Power now" not in metrics
    assert {"Power (instantaneous) · simulated", "SM clock · simulated"} <= set(texts(at.subheader))


def test_power_and_energy_per_step(from_store):
    at = from_store("power", NAN["run"])
    watts = sum(NAN["watts"] + 10 * r for r in range(NAN["ranks"]))
    metrics = {m.label: m.value for m in at.metric}
    assert metrics == {
        "Last power": quantities.power(watts),  # a stopped store's run: its last power, not "now"
        "Energy per step": quantities.energy(watts * 0.1),
        "Ranks sampled": str(NAN["ranks"]),
    }
    assert any(c.startswith("Last power as of ") for c in texts(at.main.caption))
    assert "No GPU's clocks were held back (NVML's clock-event reasons)." in texts(at.main.caption)
    assert not any("Simulated" in t for t in texts(at.main.info))  # NVML's samples


def test_power_shows_gpu_errors_memory_and_links_per_rank(from_store):
    at = from_store("power", NAN["run"])
    (errors_text,) = texts(at.main.error)
    assert errors_text.startswith(f"**GPU errors on rank {NAN['bad_gpu']}**")
    (errors,) = [d.value for d in at.dataframe if "xids" in d.value]
    columns = ["rank", "ecc_corrected", "ecc_uncorrected", "xids"]
    assert errors[columns].values.tolist() == [[NAN["bad_gpu"], 3, 1, "48"]]
    assert {"GPU memory used", "NVLink sent", "Power"} <= set(texts(at.subheader))
    spec, links = chart(next(c for c in at.get("vega_lite_chart") if "NVLink sent" in c.proto.spec))
    assert spec["encoding"]["y"]["title"] == "NVLink sent, GB/s"  # in a unit that fits, not 2e+11 bytes/s
    assert links.set_index("rank_lo")["mean"].to_dict() == pytest.approx({r: 200 + 10 * r for r in range(NAN["ranks"])})
    spec, bars = chart(next(c for c in at.get("vega_lite_chart") if "GPU memory used" in c.proto.spec))
    assert spec["mark"]["type"] == "bar"  # 4 ranks: a bar each, no line between rank 0.00 and 1.00
    assert spec["encoding"]["x"]["type"] == "ordinal" and spec["encoding"]["x"]["field"] == "rank_lo"
    assert spec["encoding"]["y"]["axis"]["format"] == charts.NUMBER
    assert bars.set_index("rank_lo")["mean"].round(1).to_dict() == {
        r: round(100 * (81_000 if r == NAN["bad_gpu"] else 60_000) / 81_559, 1) for r in range(NAN["ranks"])
    }


def test_overview_step_time_by_wall_clock_with_zoom(from_store):
    at = from_store("overview", FLEET["run"])
    (spec, data), *_ = [
        drawn for drawn in map(chart, at.get("vega_lite_chart")) if "exposed comm" in set(drawn[1].get("what", ()))
    ]
    assert spec["encoding"]["x"]["field"] == "step" and spec["params"][0]["bind"] == "scales"  # drag to zoom
    assert {"step time", "compute", "exposed comm"} <= set(data["what"]) <= set(charts.STEP_SERIES_NAMES.values())
    at.radio(key="overview_axis").set_value("wall clock").run()
    (spec, _), *_ = [
        drawn for drawn in map(chart, at.get("vega_lite_chart")) if "exposed comm" in set(drawn[1].get("what", ()))
    ]
    assert (spec["encoding"]["x"]["field"], spec["encoding"]["x"]["type"]) == ("end_ts", "temporal")


def test_compare_overlays_the_runs_chosen(from_store):
    at = from_store("compare", NAN["run"])
    at.multiselect(key="compare_with").set_value([FLEET["run"], ENDED["run"]]).run()
    assert not at.exception
    assert texts(at.subheader) == ["Step time", "Loss", "Tokens/s", "Power"]
    drawn = [chart(c) for c in at.get("vega_lite_chart")]
    assert len(drawn) == 4  # step time, loss, tokens/s, power
    for spec, _data in drawn:
        assert spec["params"][0]["bind"] == "scales"
    runs = {NAN["run"], FLEET["run"], ENDED["run"]}
    assert [set(data["run"]) for _, data in drawn[:3]] == [runs] * 3  # every run reports step times and loss
    assert set(drawn[3][1]["run"]) == {NAN["run"], FLEET["run"]}  # the ended run has no power samples


def test_compare_lines_runs_up_on_normalised_axes(from_store):
    """Runs of different lengths and sizes: steps as a share of each run (0 to 1), values over the
    chosen run's median (1 is the same), power per GPU whatever the run's size."""
    at = from_store("compare", NAN["run"])
    at.multiselect(key="compare_with").set_value([FLEET["run"]]).run()
    (_, watts), *_ = [chart(c) for c in at.get("vega_lite_chart") if "w_per_gpu" in chart(c)[1]]
    assert watts.loc[watts["run"] == NAN["run"], "w_per_gpu"].median() == pytest.approx(NAN["watts"], rel=0.2)
    at.radio(key="compare_steps").set_value("share of the run").run()
    at.radio(key="compare_values").set_value(f"relative to {ui.literal(NAN['run'])}").run()
    assert not at.exception
    (spec, steps), *_ = [chart(c) for c in at.get("vega_lite_chart")]
    assert spec["encoding"]["y"]["title"] == f"step time, x {NAN['run']}'s median"
    for _, rows in steps.groupby("run"):
        assert (rows["step"].min(), rows["step"].max()) == (0, 1)
    assert steps.loc[steps["run"] == NAN["run"], "step_s"].median() == pytest.approx(1)
    assert steps.loc[steps["run"] == FLEET["run"], "step_s"].notna().all()


@pytest.mark.parametrize(
    ("values", "flat"),
    [
        ([1.15, 1.15 + 1e-7, 1.15 - 1e-7, 1.15], True),  # float noise on a constant
        ([-3e-9, 3e-9, 0.0], False),  # all near zero: nothing to widen by
        ([2.0, 2.5, 2.2], False),
        ([1e6, 1e6 + 3], True),
    ],
)
def test_a_value_axis_spans_at_least_a_share_of_its_values(values, flat):
    """A flat series is drawn flat: its axis spans at least charts.MIN_SPAN of its values' size,
    centred on them, instead of zooming into the noise between two ticks with the same label."""
    scale = charts.value_scale(pd.Series(values), pd.Series([float("nan")])).to_dict()
    assert scale["zero"] is False
    if not flat:
        assert "domain" not in scale
        return
    low, high = scale["domain"]
    assert high - low == pytest.approx(charts.MIN_SPAN * max(map(abs, values)))
    assert low < min(values) and max(values) < high


def test_power_empty_state(from_store):
    at = from_store("power", BARE["run"])
    assert texts(at.main.info)[0].startswith("No GPU samples for this run")


def test_sql_runs_read_only_queries_and_refuses_others(from_store):
    at = from_store("sql", FLEET["run"])
    (result,) = at.dataframe
    assert dict(result.value.values.tolist())[FLEET["run"]] == FLEET["ranks"] * FLEET["steps"]
    at.text_area(key="sql").set_value("DELETE FROM steps").run()
    assert texts(at.main.error) == ["only SELECT is allowed, not DELETE"]
    at.text_area(key="sql").set_value("SELECT * FROM read_csv('/etc/passwd')").run()
    assert texts(at.main.error)[0].startswith("Permission Error")
    at.text_area(key="sql").set_value("SELECT 6 * 7 AS answer").run()
    assert at.dataframe[0].value.values.tolist() == [[42]]
    assert not at.error


@pytest.fixture(scope="module")
def served(dashboard_store, tmp_path_factory) -> Collector:
    """A collector holding a copy of the fixture store, for the module's tests that read through its query API,
    send it exports, or need a store a collector holds (one collector's start for them all)."""
    directory = tmp_path_factory.mktemp("served")
    shutil.copy(dashboard_store, directory / "rankwatch.duckdb")
    with job_collector(directory) as collector:
        yield collector


def reading_through(monkeypatch, collector: Collector) -> None:
    """This process's dashboard reads through `collector`'s query API (as `rankwatch dashboard --collector`),
    nothing cached from another source."""
    monkeypatch.setenv(COLLECTOR_ENV, collector.url)
    monkeypatch.setenv("RANKWATCH_TOKEN", collector.token)
    st.cache_resource.clear()
    st.cache_data.clear()


def test_pages_through_a_collector_and_a_live_run_leads_with_power_now_and_the_command_that_applies_the_caps(
    served, monkeypatch
):
    """The dashboard reads through a collector's query API. Then the simulated fleet made live again (a fresh
    power sample through the collector): the Overview says its power recommendations and power now, the Power
    page the exact commands that apply them."""
    reading_through(monkeypatch, served)
    at = open_page("overview", NAN["run"])
    metrics = {m.label: m.value for m in at.metric}
    assert (metrics["Last step"], metrics["MFU"]) == (str(NAN["steps"] - 1), "40.0%")
    assert f"reading collector {served.url}" in texts(at.sidebar.caption)
    at = open_page("stragglers", FLEET["run"])
    assert f"### Suspects: ranks {FLEET['straggler']}, {FLEET['thermal']}, pattern *rank*" in texts(at.markdown)
    at = open_page("overview", HANG["run"])  # the collector's hung run: no cap reaches it
    assert "No power recommendation: the run is hung, so no cap would reach the job." in texts(at.main.caption)

    exporter = Exporter(served.url, served.token, {sc.RUN_ID: FLEET["run"], sc.RANK: 0})
    exporter.samples([(sc.POWER_W, time.time_ns(), 650.0, {sc.GPU: 0, sc.SOURCE: sc.SOURCE_SIMULATED})])
    wait_until(exporter.flush, "telemetry not delivered", 60)
    exporter.shutdown()
    st.cache_data.clear()  # a fresh visit: nothing the pages above read is kept
    at = open_page("overview", FLEET["run"])
    metrics = {m.label: m.value for m in at.metric}
    assert re.fullmatch(r"[\d.]+ k?W", metrics["Power now · simulated"])
    assert "MFU · simulated" in metrics
    (recommendations,) = [t for t in texts(at.main.info) if t.startswith("**Power recommendations**")]
    assert "cap every GPU at " in recommendations and " ranks wait for slower ones" in recommendations
    at = open_page("power", FLEET["run"])
    first = at.main.children[1]  # right under the title
    assert first.type == "success" and first.value.startswith("**Recommendation: cap every GPU at ")
    cap = first.value.removeprefix("**Recommendation: cap every GPU at ").split(" W.**")[0]
    commands = [c.value for c in at.code]
    assert commands[0] == f"rankwatch power apply {FLEET['run']} --watts {cap}"
    assert commands[1].endswith(f"rankwatch power apply {FLEET['run']} --caps caps.json")
    body = "\n".join(texts(at.main.success) + texts(at.main.caption))
    assert body.count("ranks wait for slower ones") == 1 and body.count("cap every GPU at ") == 2  # headline, finding
    assert "Power now · simulated" in {m.label for m in at.metric}


def test_cli_refuses_a_store_it_cannot_read(tmp_path, served):
    missing = rankwatch_in_process("dashboard", "--db", str(tmp_path / "none.duckdb"))
    assert (missing.returncode, missing.stderr.strip()) == (2, f"rankwatch: error: no store at {tmp_path}/none.duckdb")
    held = rankwatch_in_process("dashboard", "--db", str(served.db))
    assert held.returncode == 2
    assert "is held open by a running collector" in held.stderr and "--collector URL" in held.stderr


def test_the_overview_of_a_slow_data_loader_says_who_waits_for_input_since_when_what_it_costs_and_what_to_do(
    from_store,
):
    """A 2-rank CPU job whose rank 1 waits 50 ms for each batch from step 10: the first thing the Overview
    says is that, in words (its rank, its phase, its onset, the others' wait), then data-loader advice; no
    analyzer or finding names; the step-time chart draws the input wait; no power figure without a GPU."""
    at = from_store("overview", LOADER["run"])
    (verdict,) = texts(at.main.error)
    said, todo = verdict.split("\n\n")
    excess, onset, cost = re.fullmatch(
        r"\*\*Rank 1 waits ([\d.]+) ms per step longer than its peers for input \(data loading\) since step (\d+); "
        r"the others wait for it: ([\d.]+) ms per step \(.*% of step time.*\)\.\*\*",
        said,
    ).groups()
    assert float(excess) == pytest.approx(1e3 * (LOADER["data_s"] - LOADER["peer_data_s"]), rel=0.05)
    assert int(onset) == LOADER["from"] and float(cost) == pytest.approx(float(excess), rel=0.1)
    assert todo == f"**What to do:** {evidence.NEXT_STEPS['stragglers / data']}" and "DataLoader" in todo
    first_screen = " ".join(texts(at.main.markdown) + texts(at.main.error) + [e.label for e in at.main.expander[:1]])
    assert "stragglers /" not in first_screen and "finding " not in first_screen and "{" not in first_screen
    assert {m.label for m in at.metric} == {"Last step", "Step time", "Tokens/s", "MFU"}  # no GPU: no power
    (steps,) = [data for data in drawn(at, "line") if "data (input wait)" in set(data["what"])]
    input_wait = steps[steps["what"] == "data (input wait)"].set_index("step")["seconds"]
    assert (
        input_wait.loc[LOADER["from"] :].min()
        > LOADER["data_s"] / 2 - 0.001
        > input_wait.loc[: LOADER["from"] - 1].max()
    )


def test_the_stragglers_page_of_a_slow_data_loader_names_the_phase_and_the_others_wait(from_store):
    """The Stragglers page of the slow data loader: the phase (input wait) and its excess, the cost the other
    rank waits out (not "0.000 s"), rank 1 first by its own time with its input wait in the table, its input
    wait against its peer's in the evidence, and the heatmap's row of rank 1 glowing from step 10."""
    at = from_store("stragglers", LOADER["run"])
    markdown = texts(at.markdown)
    assert "### Suspects: rank 1, pattern *rank*" in markdown
    (phase,) = [m for m in markdown if " the time in " in m]
    assert re.fullmatch(
        r"Rank 1 loses the time in \*\*input wait \(data loading\)\*\*: 4\d\.\d ms per step more than its peers\.",
        phase,
    )
    (cost,) = [m for m in markdown if m.startswith("Costs ")]
    assert re.match(r"Costs \*\*4\d\.\d ms per step\*\* \(4\d\.\d% of the step time\)", cost), cost
    (slowest,) = at.dataframe
    top = slowest.value.iloc[0]
    assert top["rank"] == LOADER["slow"] and top["time_ratio"] > 1.2 and top["data_ms"] > 30
    assert top["compute_ms"] == pytest.approx(1e3 * LOADER["compute_s"])
    (against,) = [data for data in drawn(at, "line") if "their input wait" in set(data["what"])]
    wide = against.pivot(index="step", columns="what", values="seconds")
    assert wide.loc[LOADER["from"] :, "their input wait"].tolist() == pytest.approx([LOADER["data_s"]] * 30)
    (cells,) = drawn(at, "rect")
    glowing = cells[cells["ratio"] > 1.2]
    assert set(glowing["rank_lo"]) == {LOADER["slow"]} and glowing["step_lo"].min() == LOADER["from"]
    assert f"**What to do:** {evidence.NEXT_STEPS['stragglers / data']}" in texts(at.markdown)


def test_the_heatmap_has_a_row_per_rank_and_a_column_per_step_and_no_more(from_store):
    """A cell spans its ranks (steps) from the first to the last, each a unit centred on its number: a 4-rank
    run's rows are ranks 0 to 3 (the axis ends at 3.5, no row 4), its columns steps 0 to the last."""
    at = from_store("stragglers", ENDED["run"])
    ((spec, cells),) = [found for found in map(chart, at.get("vega_lite_chart")) if "rank_from" in found[1]]
    assert (cells["rank_lo"] == cells["rank_hi"]).all() and sorted(cells["rank_lo"].unique()) == list(range(4))
    assert (cells["rank_from"].min(), cells["rank_to"].max()) == (-0.5, ENDED["ranks"] - 0.5)
    assert (cells["step_from"].min(), cells["step_to"].max()) == (-0.5, ENDED["steps"] - 0.5)
    assert spec["encoding"]["y"]["axis"]["tickMinStep"] == 1 and spec["encoding"]["x"]["axis"]["format"] == "d"


def test_ranks_and_nodes_show_the_input_wait_and_no_power_column_without_a_gpu(from_store):
    at = from_store("ranks", LOADER["run"])
    nodes, ranks = (frame.value for frame in at.dataframe)
    assert "watts" not in ranks and "watts" not in nodes  # no GPU: no column of blanks (or 0 W)
    by_rank = ranks.set_index("rank")
    assert by_rank.loc[LOADER["slow"], "data_ms"] == pytest.approx(1e3 * LOADER["data_s"], rel=0.1)
    assert by_rank.loc[0, "data_ms"] == pytest.approx(1e3 * LOADER["peer_data_s"])


def test_simulated_gpus_are_labelled_wherever_their_samples_are_shown(from_store):
    """The fleet simulator's GPUs: the Ranks & nodes power columns, the straggler's GPU readings and the
    compared power say they are simulated (the Overview's figures too: test_overview_of_a_straggling_run);
    a run of measured GPUs says nothing of the kind."""
    at = from_store("ranks", FLEET["run"])
    labels = [json.loads(frame.proto.columns)["watts"]["label"] for frame in at.dataframe]
    assert labels == ["power, W (all GPUs) · simulated", "power, W · simulated"]
    at = from_store("stragglers", FLEET["run"])
    assert any(t.startswith("Its GPU readings come from **simulated GPUs**") for t in texts(at.main.info))
    at = from_store("ranks", NAN["run"])
    assert json.loads(at.dataframe[1].proto.columns)["watts"]["label"] == "power, W"
    at = from_store("compare", NAN["run"])
    at.multiselect(key="compare_with").set_value([FLEET["run"]]).run()
    assert f"Simulated GPUs (rankwatch's GPU model), not measured hardware: {FLEET['run']}." in texts(at.caption)


def test_a_one_process_run_says_once_that_cross_rank_analyses_do_not_apply_and_shows_what_does(from_store):
    """One process: no "not judged" box on any page, one line where a page would compare ranks, and the pages
    show what applies: its phases in time, its loss, its rank, its host work."""
    at = from_store("overview", SOLO["run"])
    assert ui.ONE_PROCESS in texts(at.main.caption)
    for page in PAGES:
        at.switch_page(f"views/{page}.py").run()
        assert not at.exception, page
        shown_text = " ".join(texts(at.main.markdown) + texts(at.main.info) + texts(at.main.success))
        assert "judged" not in shown_text.lower(), page
        if page in ("stragglers", "ranks", "collectives"):
            assert texts(at.main.info).count(ui.ONE_PROCESS) == 1, page
    at = from_store("stragglers", SOLO["run"])
    (spans,) = [data for data in drawn(at, "bar") if "start_s" in data]
    assert {"data", "compute"} <= set(spans["name"])
    (rank,) = at.dataframe if (at := from_store("ranks", SOLO["run"])) else ()
    assert rank.value["rank"].tolist() == [0] and "time_ratio" not in rank.value


def test_memory_and_io_of_a_host_optimizer_says_what_it_waited_on_and_draws_no_empty_chart(from_store):
    """Steps whose optimizer runs on the host and whose copies report no size: the page gives the host
    optimizer's share of the step (never "nan%") and says why no bandwidth is drawn instead of an empty chart."""
    at = from_store("tiers", SOLO["run"])
    captions = texts(at.main.caption)
    assert not [c for c in captions if "nan" in c.lower()]
    (share,) = [c for c in captions if c.startswith("Steps waited on ")]
    assert (
        share == "Steps waited on the optimizer on the host's CPUs for 40% of their time (median over the steps shown)."
    )
    assert any(c.startswith("No bandwidth to draw") for c in captions)
    for element in at.get("vega_lite_chart"):
        assert len(chart(element)[1]) > 0


def test_busbw_of_a_slow_link_keeps_its_significant_digits(from_store):
    """gloo's all-reduce of 1 MiB in 50 ms: 0.021 GB/s, not 0.0."""
    at = from_store("collectives", LOADER["run"])
    _, groups = at.dataframe
    assert groups.value["busbw_gbps"].tolist() == ["21 MB/s"]
    ((spec, _),) = [drawn for drawn in map(chart, at.get("vega_lite_chart")) if "busbw" in json.dumps(drawn[0])]
    (bars,) = [layer for layer in spec["layer"] if layer["mark"]["type"] == "bar"]
    assert {t.get("format") for t in bars["encoding"]["tooltip"] if "busbw" in t["field"]} == {charts.SIGNIFICANT}


def test_a_loss_spike_is_marked_at_the_axis_edge_rather_than_flattening_the_curve():
    """A loss of 100 at one step, and 80 at a step a rollback abandoned, among 3 to 11: the axis spans the
    others (a falling curve's first steps included) and the spikes are triangles at its top, each with its
    value; a curve with no spike keeps its whole range, and a bump on a flat one stays on its axis."""
    steps = pd.DataFrame({"step": range(60), "loss": [3 + 8 * 0.9**s for s in range(60)]})
    spiked = steps.assign(loss=steps["loss"].where(steps["step"] != 40, 100.0))
    abandoned = pd.DataFrame({"step": [41, 42], "loss": [80.0, 3.2]})
    none = pd.DataFrame(columns=["step", "marker", "detail"])
    spec = charts.with_markers(spiked, "loss", none, abandoned).to_dict()
    line, _, _, edges = spec["layer"]
    low, high = line["encoding"]["y"]["scale"]["domain"]
    assert 2 < low < 3 and 11 < high < 12 and line["mark"]["clip"]
    (beyond,) = [rows for name, rows in spec["datasets"].items() if name == edges["data"]["name"]]
    assert [(row["step"], row["loss"], row["shape"], row["what"]) for row in beyond] == [
        (40, 100.0, "triangle-up", "beyond the axis"),
        (41, 80.0, "triangle-up", "rolled back, beyond the axis"),
    ]
    assert charts.robust_range(steps["loss"]) is None
    assert charts.robust_range(pd.Series([1.15] * 50 + [1.2])) is None


def test_compare_charts_are_full_height_with_whole_step_ticks(from_store):
    at = from_store("compare", NAN["run"])
    at.multiselect(key="compare_with").set_value([IMPORTED["run"]]).run()
    for spec, _ in map(chart, at.get("vega_lite_chart")):
        assert spec["height"] >= 200 and spec["autosize"]["type"] == "fit-x"  # the plot's height, legend apart
    spec, _ = chart(at.get("vega_lite_chart")[0])
    assert spec["encoding"]["x"]["axis"] == {"format": "d", "tickMinStep": 1}


def test_evidence_tables_name_every_device_and_host_metric_in_its_unit():
    read = evidence.read(
        {
            "devices": {
                sc.FB_TOTAL_MIB: {"suspects": 81_600.0, "peers": 81_600.0},
                sc.PROCESS_CPU_UTIL: {"suspects": 0.97, "peers": 0.41},
                sc.PRESSURE_IO: {"suspects": 0.2, "peers": 0.0},
            }
        }
    )
    ((_, table),) = read.tables
    assert table.to_dict("records") == [
        {"devices": "GPU memory", "suspects": "85.6 GB", "peers": "85.6 GB"},
        {"devices": "Process CPU use, per CPU", "suspects": "97%", "peers": "41%"},
        {"devices": "Host I/O pressure", "suspects": "20%", "peers": "0%"},
    ]


def test_a_refused_token_check_is_not_said_to_lose_a_jobs_telemetry(served, monkeypatch):
    """A launcher's token check (agent.export.check_token: one empty export) refused with 401 stops its job
    before it starts and loses nothing: the collector's health counts only the refused exports that carried
    telemetry, and the sidebar says what those lost."""
    from rankwatch.agent.config import TokenRefused
    from rankwatch.agent.senders import check_token

    wrong = {"Authorization": "Bearer not-the-token-0123456", "Content-Type": "application/x-protobuf"}
    for _ in range(21):  # jobs' exports the collector takes
        assert check_token(served.url, served.token)
    for _ in range(3):  # three launches with a wrong token, each refused before its job started
        with pytest.raises(TokenRefused):
            check_token(served.url, "not-the-token-0123456")
    spans = trace_body(step_spans("run-wrong-token", 0, [0]))
    for _ in range(6):  # a job's spans, sent with the wrong token: lost
        assert loopback.post(f"{served.url}/v1/traces", content=spans, headers=wrong).status_code == 401
    fired = f"""SELECT evidence->>'refused' FROM findings
                WHERE run_id = '{health.RUN_ID}' AND kind = 'refused_exports'"""

    def refused() -> dict | None:
        rows = run_remote(served.url, served.token, fired)[1]
        return json.loads(rows[0][0]) if rows else None

    # the finding may fire on a health pass that counted five of the six (it is drawn afresh at each pass)
    wait_until(lambda: refused() == {"401": 6}, f"the health finding did not count the six: {refused()}", 60)
    assert refused() == {"401": 6}  # the checks are not among them
    reading_through(monkeypatch, served)
    at = open_page("overview", BARE["run"])
    (said,) = [w for w in texts(at.sidebar.warning) if w.startswith("Collector: ")]
    assert "(6 x 401): a job sends the wrong token and loses its telemetry" in said
