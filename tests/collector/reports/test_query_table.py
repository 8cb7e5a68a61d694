"""`rankwatch query` tables keep a row to a line or two: a long list in a cell is shortened (a
sorted list of whole numbers to ranges, any other to its first items and a count), while CSV and
JSON keep every item; JSON output writes JSON columns as nested JSON."""

import json

import duckdb
import pytest

from tests.support.commands import rankwatch_in_process
from tests.support.query_rows import JSON_ROWS, JSON_SQL

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these

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


def test_json_output_nests_json_columns_by_their_type_and_keeps_text_as_text(tmp_path):
    """DuckDB hands JSON values over as strings: JSON output writes them as the JSON they hold, told by the
    column's type, never by how a string looks."""
    db = tmp_path / "rankwatch.duckdb"
    duckdb.connect(str(db)).close()
    out = rankwatch_in_process("query", JSON_SQL, "--db", str(db), "--format", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == JSON_ROWS
