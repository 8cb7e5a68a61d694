"""`rankwatch query` tables keep a row to a line or two: a long list in a cell is shortened (a
sorted list of whole numbers to ranges, any other to its first items and a count), while CSV and
JSON keep every item."""

import json

import duckdb
from conftest import rankwatch_in_process

SQL = "SELECT 'hang' AS kind, range(512) AS ranks, [r * 3 % 7 FOR r IN range(40)] AS values"


def test_a_table_abbreviates_long_lists_and_other_formats_keep_them(tmp_path):
    db = tmp_path / "rankwatch.duckdb"
    duckdb.connect(str(db)).close()
    table = rankwatch_in_process("query", SQL, "--db", str(db))
    assert table.returncode == 0, table.stderr
    assert len(table.stdout.splitlines()) <= 6  # header, one row, borders: not a 512-line column
    assert "[0–511] (512)" in table.stdout
    assert "[0, 3, 6, 2, 5, 1, 4, 0, … 32 more]" in table.stdout
    full = rankwatch_in_process("query", SQL, "--db", str(db), "--format", "json")
    assert json.loads(full.stdout)[0]["ranks"] == list(range(512))
