"""A run the store does not have: the one error every reader of a run (`rankwatch analyze`,
`rankwatch power recommend`) gives, naming the runs it does have."""

import duckdb


class UnknownRun(LookupError):
    """The store has no steps for the run (nor, for `rankwatch analyze`, Flight Recorder dumps)."""


def unknown_run(con: duckdb.DuckDBPyConnection, run_id: str) -> UnknownRun:
    """The error for a run without steps, naming the store's recent runs."""
    known = [r for (r,) in con.execute("SELECT run_id FROM runs ORDER BY first_seen DESC LIMIT 5").fetchall()]
    return UnknownRun(f"no steps for run {run_id!r}" + (f" (recent runs: {', '.join(known)})" if known else ""))
