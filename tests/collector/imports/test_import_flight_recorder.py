"""`rankwatch import flight-recorder`: PyTorch NCCL Flight Recorder dumps into a store, and the
ranks the others wait for named by `rankwatch analyze`.

Covered, on dumps written as PyTorch writes them (a pickle of plain data per
rank, named <prefix><rank>; or JSON): a 4-rank job whose rank 2 never entered
all_reduce #7 of the default group while the others are inside it imports
one op per entry (group, group size, sequence number, nccl-tests bytes,
state, times, no step), and `rankwatch analyze --json` names rank 2 with the
collective's evidence and no what-if part; the same job as JSON dumps imports
the same rows; a rank that entered #7 as all_gather is named as mismatched; a
clean set of dumps has no finding. A file that is not a dump, or a pickle that
refers to any global (os.system or a harmless class alike), fails the import
in one line, runs nothing and leaves nothing in the store.
"""

import datetime
import json
import os
import pickle
import random

import pytest

from collector.receive.imports import TraceError
from collector.receive.imports.flight_recorder import load
from tests.support.commands import rankwatch_in_process
from tests.support.flight_dumps import HUNG, MB4, T0, job, write
from tests.support.otlp_payloads import query


def import_run(directory, db, run: str):
    result = rankwatch_in_process("import", "flight-recorder", str(directory), "--run", run, "--db", str(db))
    assert result.returncode == 0, result.stderr
    return result


def analyze(db, run: str) -> dict:
    result = rankwatch_in_process("analyze", run, "--db", str(db), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    """The hung job imported from pickles: (store, the import's stdout)."""
    root = tmp_path_factory.mktemp("fr")
    result = import_run(write(root / "dumps", job(HUNG)), root / "s.duckdb", "hung")
    return root / "s.duckdb", result.stdout


def test_entries_become_ops(hung):
    db, stdout = hung
    assert "run hung: 33 ops, 0 rank-steps of 4 ranks" in stdout
    assert query(db, "SELECT world_size FROM runs") == [(4,)]
    assert query(db, "SELECT count(*) FROM steps") == [(0,)]
    assert query(db, "SELECT rank, max(seq) FROM ops WHERE comm_group = '0' GROUP BY rank ORDER BY rank") == [
        (0, 7),
        (1, 7),
        (2, 6),
        (3, 7),
    ]
    # all_reduce #7: inside it on ranks 0, 1 and 3; 4 MiB in the 4-rank default group; not finished
    assert query(
        db,
        "SELECT rank, name, group_size, bytes, attrs->>'$.state', attrs->>'$.group_desc', "
        "step, duration_s FROM ops WHERE comm_group = '0' AND seq = 7 ORDER BY rank",
    ) == [(r, "all_reduce", 4, 4 << 20, "started", "default_pg", None, 0.0) for r in (0, 1, 3)]
    # a completed one lasts from when it was seen starting to when it was seen completed
    ((start, end, duration),) = query(
        db,
        "SELECT epoch_ns(start_ts), epoch_ns(end_ts), duration_s FROM ops "
        "WHERE rank = 2 AND comm_group = '0' AND seq = 6",
    )
    assert (start, end, duration) == (T0 + 60_000_000 + 1_000_000, T0 + 60_000_000 + 4_000_000, 0.003)
    # all_gather in a 2-rank tp group: nccl-tests bytes are the gathered output, 512 BFloat16
    assert query(
        db,
        "SELECT DISTINCT comm_group, name, group_size, bytes FROM ops WHERE seq = 1 AND "
        "(attrs->>'$.group_desc') = 'tp' AND NOT (attrs->>'$.is_p2p')::BOOLEAN ORDER BY 1",
    ) == [("1", "all_gather", 2, 1024), ("2", "all_gather", 2, 1024)]
    # point-to-point: numbered by the pair's transfers, named without the peers (kept in attrs)
    assert query(
        db,
        "SELECT rank, name, seq, bytes, attrs->>'$.profiling_name' FROM ops "
        "WHERE (attrs->>'$.is_p2p')::BOOLEAN ORDER BY rank",
    ) == [(0, "send", 1, 512, "nccl:send 0->1"), (1, "recv", 1, 512, "nccl:recv 1<-0")]
    # each dump's header, with the members of the groups it knows
    ((config,),) = query(
        db, "SELECT attrs->'$.pg_config' FROM events WHERE event = 'flight_recorder_dump' AND rank = 3"
    )
    assert json.loads(config) == {
        "0": {"desc": "default_pg", "ranks": [0, 1, 2, 3]},
        "2": {"desc": "tp", "ranks": [2, 3]},
    }


def test_analyze_names_the_rank_that_never_entered(hung):
    db, _ = hung
    report = analyze(db, "hung")
    assert set(report) == {"run", "findings"}  # no steps: no what-if part
    (finding,) = report["findings"]
    assert (finding["analyzer"], finding["kind"], finding["ranks"]) == ("hangs", "hang", [2])
    assert (finding["step_start"], finding["step_end"]) == (None, None)
    evidence = finding["evidence"]
    assert evidence["collective"] == {"op": "all_reduce", "group": "0", "seq": 7, "waiting_ranks": [0, 1, 3]}
    assert (evidence["missing_ranks"], evidence["mismatched"], evidence["no_dump_ranks"]) == ([2], [], [])
    assert "rank 2 never entered it" in finding["summary"]

    text = rankwatch_in_process("analyze", "hung", "--db", str(db), env={"COLUMNS": "250"})
    assert text.returncode == 0, text.stderr
    assert "no what-if analysis" in text.stdout and "never entered it" in text.stdout
    heatmap = rankwatch_in_process("analyze", "hung", "--db", str(db), "--heatmap", str(db.parent / "h.png"))
    assert heatmap.returncode == 2 and heatmap.stderr.count("\n") == 1 and "no steps" in heatmap.stderr


def test_json_dumps_import_the_same_rows(hung, tmp_path):
    db, _ = hung
    json_db = tmp_path / "j.duckdb"
    import_run(write(tmp_path / "dumps", job(HUNG), as_json=True), json_db, "hung")
    rows = (
        "SELECT rank, step, kind, name, start_ts, end_ts, duration_s, comm_group, group_size, seq, bytes, "
        "attrs FROM ops ORDER BY ALL"
    )
    assert query(json_db, rows) == query(db, rows)
    (finding,) = analyze(json_db, "hung")["findings"]
    assert finding["ranks"] == [2]


def test_rank_that_entered_another_collective_is_mismatched(tmp_path):
    db = tmp_path / "s.duckdb"
    last = HUNG | {2: {"state": "started"}, 3: {"op": "all_gather", "state": "started", "output_sizes": [[4096, 1024]]}}
    import_run(write(tmp_path / "dumps", job(last)), db, "mm")
    (finding,) = analyze(db, "mm")["findings"]
    assert finding["ranks"] == [3]
    evidence = finding["evidence"]
    assert evidence["collective"] == {"op": "all_reduce", "group": "0", "seq": 7, "waiting_ranks": [0, 1, 2]}
    assert evidence["missing_ranks"] == []
    assert evidence["mismatched"] == [
        {
            "rank": 3,
            "op": "all_gather",
            "input_sizes": MB4,
            "output_sizes": [[4096, 1024]],
            "input_dtypes": ["Float"],
            "output_dtypes": ["Float"],
        }
    ]
    assert "rank 3 entered it as all_gather" in finding["summary"]


def test_clean_dumps_have_no_finding(tmp_path):
    db = tmp_path / "s.duckdb"
    import_run(write(tmp_path / "dumps", job({rank: {} for rank in range(4)})), db, "clean")
    assert query(db, "SELECT DISTINCT attrs->>'$.state' FROM ops") == [("completed",)]
    assert analyze(db, "clean")["findings"] == []


def test_dumps_of_point_to_point_entries_alone_import_with_no_finding(tmp_path):
    """Sends and receives carry no collective number to match by: the run is imported and analysed, with
    nothing to say, not refused as unknown."""
    dumps = job(dict.fromkeys(range(4)))
    for dump in dumps.values():
        dump["entries"] = [e for e in dump["entries"] if e["is_p2p"]]
    db = tmp_path / "s.duckdb"
    import_run(write(tmp_path / "dumps", dumps), db, "p2p")
    assert query(db, "SELECT count(*) FROM ops WHERE run_id = 'p2p'") == [(2,)]
    assert analyze(db, "p2p")["findings"] == []


class Exploit:
    """A pickle that runs a shell command when plain pickle.load reads it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("bad", ["random bytes", "os.system", "not a dict"])
def test_bad_dump_fails_the_whole_import_in_one_line(tmp_path, bad):
    marker = tmp_path / "pwned"
    directory = write(tmp_path / "dumps", job(HUNG))
    content = {
        "random bytes": random.Random(0).randbytes(4096),
        "os.system": pickle.dumps({"entries": [Exploit(marker)]}),
        "not a dict": pickle.dumps([1, 2, 3]),
    }[bad]
    (directory / "nccl_trace_rank_3").write_bytes(content)  # read last, after ranks 0-2 were inserted
    db = tmp_path / "s.duckdb"
    result = rankwatch_in_process("import", "flight-recorder", str(directory), "--run", "bad", "--db", str(db))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "nccl_trace_rank_3: not a Flight Recorder dump" in result.stderr
    assert not marker.exists()
    assert query(
        db, "SELECT (SELECT count(*) FROM runs) + (SELECT count(*) FROM ops) + (SELECT count(*) FROM events)"
    ) == [(0,)]


@pytest.mark.parametrize("global_", [os.system, datetime.date(2024, 1, 1)])
def test_any_global_in_a_pickle_is_refused(tmp_path, global_):
    path = tmp_path / "nccl_trace_rank_0"
    path.write_bytes(pickle.dumps({"entries": [], "x": global_}))
    with pytest.raises(TraceError, match=r"refers to (posix\.system|datetime\.date)"):
        load(path)
