"""The collector says which trace decoder it uses, and stores the same rows with either."""

from pathlib import Path

import pytest

from tests.support.otlp_payloads import post, query, step_spans, trace_body


@pytest.mark.parametrize(
    "forced, says",
    [(None, "C (collector/receive/_otlpwire.c)"), ("python", "the protobuf runtime's (collector/receive/otlpwire.py)")],
)
def test_the_collector_says_which_decoder_it_uses_and_stores_with_it(collector_factory, monkeypatch, forced, says):
    if forced:
        monkeypatch.setenv("RANKWATCH_DECODER", forced)
    c = collector_factory(None, "--workers", "2")  # the decode processes say which decoder they run
    assert post(c, "traces", trace_body(step_spans("decoders", 0, range(3), spans_per_step=2))).status_code == 200
    c.stop()
    assert f"OTLP trace decoder: {says}" in Path(c.log.name).read_text()
    assert query(c.db, "SELECT count(*) FROM steps WHERE run_id = 'decoders'") == [(3,)]
    assert query(c.db, "SELECT count(*) FROM ops WHERE run_id = 'decoders'") == [(6,)]
