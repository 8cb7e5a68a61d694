"""A query whose cells hold JSON, and the rows it gives."""

# A JSON column, a list of them, and text that only looks like JSON
JSON_SQL = """SELECT '{"phase": "data", "ms": [50.7, 0.4]}'::JSON AS evidence, ['{"a": 1}'::JSON, NULL] AS notes,
                     '{"not": "json"}' AS text, NULL::JSON AS missing"""

JSON_ROWS = [{"evidence": {"phase": "data", "ms": [50.7, 0.4]}, "notes": [{"a": 1}, None], "text": '{"not": "json"}',
              "missing": None}]  # fmt: skip
