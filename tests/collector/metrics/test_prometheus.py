"""The collector's /metrics for Prometheus and Grafana: per-run fleet aggregates of a run fed by
`rankwatch simulate` (plus power samples and checkpoint events), bounded labels, a page that
prometheus_client's parser and promtool accept, a real Prometheus server scraping it, and the
shipped examples (scrape config, alerting rules, Grafana dashboard) in agreement with it."""

import contextlib
import json
import re
import shutil
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor

import duckdb
import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collector.metrics import runs
from collector.store.schema import DDL
from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from tests.support import loopback
from tests.support.collectors import Collector, free_port
from tests.support.commands import rankwatch_cli
from tests.support.paths import ROOT
from tests.support.waits import wait_until

RUN, RANKS, STEPS = "sim-prom", 8, 40
EXAMPLES = ROOT / "examples"
NO_PROMETHEUS = "needs Debian's prometheus package (promtool, prometheus): apt-get install -y prometheus"


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    """A collector fed a simulated run with a straggler, device samples and two checkpoints."""
    db = tmp_path_factory.mktemp("prom") / "rankwatch.duckdb"
    log = open(db.parent / "collector.log", "w")  # noqa: SIM115 - the collector's output; closed at teardown
    collector = Collector(db, free_port(), "test-token-0123456", extra_args=("--analyze-every", "1"), log=log).start()
    try:
        result = rankwatch_cli(
            "simulate",
            "--ranks",
            str(RANKS),
            "--steps",
            str(STEPS),
            "--run",
            RUN,
            "--inject",
            "straggler:rank=3,slowdown=1.3,from=5",
            "--collector",
            collector.url,
            env={"RANKWATCH_TOKEN": collector.token},
        )
        assert result.returncode == 0, result.stderr
        exporter = Exporter(collector.url, collector.token, {sc.RUN_ID: RUN})
        now = time.time_ns()
        assert exporter.samples(
            (metric, now - age, value + rank, {sc.RANK: rank, sc.GPU: 0})
            for rank in range(RANKS)
            for age, scale in ((10**9, 0.5), (0, 1.0))
            for metric, value in ((sc.POWER_W, 300 * scale), (sc.ENERGY_J, 1e6 * scale))
        )
        for step, blocked in ((10, (2.0, 2.0)), (20, (0.5, 0.8))):  # only the newest checkpoint counts
            for rank, blocked_s in enumerate(blocked):
                exporter.event(
                    "checkpoint_saved", now, {sc.RANK: rank, sc.STEP: step, "rankwatch.checkpoint.blocked_s": blocked_s}
                )
        wait_until(exporter.flush, "telemetry not delivered", 120)
        exporter.shutdown()

        def straggler_live() -> bool:  # an analysis pass went over the last steps
            page = loopback.get(f"{collector.url}/metrics", timeout=30).text
            return any(
                s.name == "rankwatch_run_suspect_rank_findings_firing" and s.labels == {"run": RUN, "rank": "3"}
                for family in text_string_to_metric_families(page)
                for s in family.samples
            )

        wait_until(straggler_live, "the straggler's finding is not in /metrics", 60)
        yield collector
    finally:
        collector.stop()
        log.close()


@pytest.fixture(scope="module")
def page(collector) -> str:
    response = loopback.get(f"{collector.url}/metrics", timeout=30)
    assert response.status_code == 200
    return response.text


@pytest.fixture(scope="module")
def samples(page) -> dict:
    """(sample name, frozenset of labels other than run) -> value, for the simulated run's series."""
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k != "run")): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.labels.get("run") == RUN
    }


def test_run_aggregates(samples):
    def value(name: str, **labels) -> float:
        return samples[name, frozenset(labels.items())]

    q50, q90, q99 = (value("rankwatch_run_step_duration_seconds", quantile=q) for q in ("0.5", "0.9", "0.99"))
    assert 0 < q50 <= q90 <= q99
    # the simulator sends 4096 tokens per rank-step
    assert value("rankwatch_run_tokens_per_second") * q50 / (RANKS * 4096) == pytest.approx(1, rel=0.1)
    assert 0 < value("rankwatch_run_exposed_communication_ratio") < 1
    assert (value("rankwatch_run_last_step"), value("rankwatch_run_ranks")) == (STEPS - 1, RANKS)
    assert value("rankwatch_run_last_step_timestamp_seconds") > time.time() - 3600
    assert value("rankwatch_run_findings_firing", kind="rank") == 1
    assert value("rankwatch_run_suspect_rank_findings_firing", rank="3") == 1
    assert value("rankwatch_run_rollbacks_total") == 0
    assert value("rankwatch_run_checkpoint_stall_seconds") == 0.8
    assert value("rankwatch_run_power_watts") == sum(300 + r for r in range(RANKS))
    assert value("rankwatch_run_energy_joules_total") == sum(1e6 + r for r in range(RANKS))
    assert ("rankwatch_run_mfu_ratio", frozenset()) not in samples  # the simulator reports no MFU


def test_labels_are_bounded(page):
    allowed = {
        "rankwatch_run_step_duration_seconds": {"run", "quantile"},
        "rankwatch_run_findings_firing": {"run", "kind"},
        "rankwatch_run_suspect_rank_findings_firing": {"run", "rank"},
    }
    families = [f for f in text_string_to_metric_families(page) if f.name.startswith("rankwatch_run_")]
    assert len(families) >= 10
    for family in families:
        for s in family.samples:
            assert set(s.labels) <= allowed.get(family.name, {"run"}), s


def test_promtool_accepts_the_page(page):
    if not shutil.which("promtool"):
        pytest.skip(NO_PROMETHEUS)
    result = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_the_collector(collector, tmp_path):
    if not shutil.which("prometheus"):
        pytest.skip(NO_PROMETHEUS)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: rankwatch\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{collector.port}']}}]\n"
    )
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline, result = time.monotonic() + 60, []
        while not result and time.monotonic() < deadline:
            time.sleep(0.5)
            with contextlib.suppress(httpx.TransportError, ValueError, KeyError):
                result = loopback.get(
                    f"http://127.0.0.1:{port}/api/v1/query",
                    params={"query": f'rankwatch_run_last_step{{run="{RUN}"}}'},
                    timeout=5,
                ).json()["data"]["result"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert result and float(result[0]["value"][1]) == STEPS - 1
    assert result[0]["metric"]["job"] == "rankwatch"


def test_examples_use_only_served_metrics(page):
    served = {s.name for f in text_string_to_metric_families(page) for s in f.samples}
    served |= {f.name for f in text_string_to_metric_families(page)}
    dashboard = json.loads((EXAMPLES / "grafana" / "rankwatch-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    rules = (EXAMPLES / "prometheus" / "rankwatch-rules.yml").read_text()
    used = set(re.findall(r"\brankwatch_[a-z_]+", " ".join(exprs) + rules))
    assert exprs and used and used <= served, used - served


def test_promtool_accepts_the_example_config_and_rules():
    if not shutil.which("promtool"):
        pytest.skip(NO_PROMETHEUS)
    result = subprocess.run(
        ["promtool", "check", "config", str(EXAMPLES / "prometheus" / "prometheus.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rankwatch-rules.yml" in result.stdout and "SUCCESS" in result.stdout


def test_many_runs_get_bounded_series_and_the_rest_are_counted(tmp_path):
    """Past the bound, active runs have no series of their own (60,000 runs made 420,000 series and a
    4.6 s scrape) but are still counted: how many, and their findings and rollbacks under run="_other"."""
    n_runs, shown = 20_000, 50
    con = duckdb.connect(str(tmp_path / "rankwatch.duckdb"))
    con.execute(DDL)
    now = time.time_ns()
    con.execute(  # run-i's one rank-step ended i ms after run-0's: the newest runs are the last
        "INSERT INTO steps (run_id, rank, step, start_ts, end_ts, duration_s, tokens) "
        "SELECT 'run-' || i, 0, 1, make_timestamp_ns(($t + i * 1000000 - 1000000000)::BIGINT), "
        "make_timestamp_ns(($t + i * 1000000)::BIGINT), "
        "1.0, 10 FROM range($n) r(i)",
        {"t": now - 60 * 10**9, "n": n_runs},
    )
    con.execute(
        "INSERT INTO findings (run_id, analyzer, kind, ranks, severity) "
        "SELECT 'run-' || i, 'stragglers', 'rank', [0], 'warning' FROM range($n) r(i)",
        {"n": n_runs},
    )
    con.execute(
        "INSERT INTO commands (run_id, kind, created_by) "
        "SELECT 'run-' || i, 'rollback', 'test' FROM range(0, $n, 10) r(i)",
        {"n": n_runs},
    )

    def call(request: runs.SnapshotRequest) -> Future:  # as the writer answers it, on a cursor of its own
        answer: Future = Future()
        answer.set_result(runs.snapshot(con.cursor(), request.max_runs))
        return answer

    registry = CollectorRegistry()
    registry.register(runs.RunMetrics(call, shown))
    started = time.monotonic()
    page = generate_latest(registry).decode()
    elapsed = time.monotonic() - started
    samples = [s for family in text_string_to_metric_families(page) for s in family.samples]
    by_run: dict[str, dict[str, float]] = {}
    for s in samples:
        if "run" in s.labels:
            by_run.setdefault(s.labels["run"], {})[s.name] = s.value
    newest = {f"run-{i}" for i in range(n_runs - shown, n_runs)}
    assert set(by_run) == newest | {runs.OTHER}
    assert len(samples) < 40 * (shown + 1)
    assert elapsed < 3.0, f"{elapsed:.1f} s for a scrape"
    left_out = n_runs - shown
    assert {s.name: s.value for s in samples if not s.labels}["rankwatch_runs_left_out"] == left_out
    assert by_run[runs.OTHER]["rankwatch_run_findings_firing"] == left_out
    assert by_run[runs.OTHER]["rankwatch_run_rollbacks_total"] == len(range(0, n_runs - shown, 10))
    assert by_run[f"run-{n_runs - 1}"]["rankwatch_run_last_step"] == 1


def test_long_run_ids_in_a_store_make_bounded_labels_and_a_bounded_page(tmp_path):
    """Run ids stored before ingest bounded them: 200 runs with 120 KB ids made a 229 MB page, and 8
    scrapers took the collector past 4 GB. A label is cut to MAX_LABEL_BYTES, a digest of the id added:
    ids alike for their first 120 KB stay apart, and an id within the bound is its own label."""
    long_ids = [f"{'x' * 120_000}-{i}" for i in range(20)]
    con = duckdb.connect(str(tmp_path / "rankwatch.duckdb"))
    con.execute(DDL)
    now = time.time_ns()
    for run in [*long_ids, "short"]:
        con.execute(
            "INSERT INTO steps (run_id, rank, step, start_ts, end_ts, duration_s, tokens) "
            "VALUES (?, 0, 1, make_timestamp_ns(?), make_timestamp_ns(?), 1.0, 10)",
            [run, now - 2 * 10**9, now - 10**9],
        )
        con.execute(
            "INSERT INTO findings (run_id, analyzer, kind, ranks, severity) "
            "VALUES (?, 'stragglers', 'rank', [0], 'warning')",
            [run],
        )

    def call(request: runs.SnapshotRequest) -> Future:
        answer: Future = Future()
        answer.set_result(runs.snapshot(con.cursor(), request.max_runs))
        return answer

    registry = CollectorRegistry()
    registry.register(runs.RunMetrics(call))
    page = generate_latest(registry)
    labels = {
        s.labels["run"]
        for family in text_string_to_metric_families(page.decode())
        for s in family.samples
        if "run" in s.labels
    }
    assert len(labels) == len(long_ids) + 1 and "short" in labels
    assert max(len(label.encode()) for label in labels) <= runs.MAX_LABEL_BYTES
    assert len(page) < 40 * runs.MAX_LABEL_BYTES * len(labels), f"{len(page):,} bytes"


def test_scrapes_of_a_store_slow_to_answer_make_one_call_at_a_time(monkeypatch):
    """A scrape waits CALL_TIMEOUT_S for the run metrics, then serves the previous ones; it asked again each
    time, so scrapers of a store slow to answer (long run ids: 9 s a snapshot) piled calls up in the writer.
    One call is in flight at a time, and its answer serves the scrapes that follow."""
    monkeypatch.setattr(runs, "CALL_TIMEOUT_S", 0.05)
    calls: list[Future] = []

    def call(request: runs.SnapshotRequest) -> Future:  # a writer that has not answered yet
        calls.append(Future())
        return calls[-1]

    registry = CollectorRegistry()
    registry.register(runs.RunMetrics(call))
    with ThreadPoolExecutor(8) as scrapers:
        pages = list(scrapers.map(lambda _: generate_latest(registry), range(16)))
    assert len(calls) == 1 and not any(b"rankwatch_run" in page for page in pages)
    calls[0].set_result(runs.Snapshot([("r", [1.0] * 3, 10.0, None, 0.1, 3, 1.0, 1)], [], [], {}, [], [], [], []))
    assert b'rankwatch_run_last_step{run="r"} 3.0' in generate_latest(registry)
    assert len(calls) == 1
