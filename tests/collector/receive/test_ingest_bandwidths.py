"""Each collective's algbw and busbw as decoded from an export, by the nccl-tests formulas, whatever mix of
collectives, group sizes and ops without bytes a batch holds: the bus factor is drawn once per distinct
(name, group size) of the batch and must land on every op of that pair, with either trace decoder."""

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collector.receive import decode, otlpwire
from rankwatch.agent import semconv as sc
from tests.support.otlp_payloads import T0, trace_body

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these

MiB = 2**20
# (name, group size, bytes, duration in ns) of each op, in the order sent; None: the attribute is not sent
OPS = [
    ("all_reduce", 8, 64 * MiB, 4_000_000),
    ("nccl:all_gather", 8, 32 * MiB, 2_000_000),
    ("all_reduce", 1024, 64 * MiB, 8_000_000),
    ("reduce_scatter", 8, 32 * MiB, 1_000_000),
    ("send", 2, 16 * MiB, 1_000_000),
    ("all_reduce", 8, 8 * MiB, 1_000_000),
    ("all_reduce", None, 8 * MiB, 1_000_000),  # no group size: algbw alone
    ("all_reduce", 8, None, 1_000_000),  # no bytes: neither
    ("forward", 8, 1 * MiB, 1_000_000),  # no collective: algbw alone
    ("all_gather", 1024, 32 * MiB, 2_000_000),
]
FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "nccl:all_gather": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
}


def export() -> bytes:
    """One rank's step with the ops above as its comm children, as the SDK's exporter encodes them."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({sc.RUN_ID: "bandwidths", sc.RANK: 0}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("rankwatch.tests")
    for seq, (name, group_size, nbytes, ns) in enumerate(OPS):
        attributes = {sc.KIND: sc.KIND_COMM, sc.STEP: 0, sc.COMM_SEQ: seq}
        if group_size is not None:
            attributes[sc.COMM_GROUP_SIZE] = group_size
        if nbytes is not None:
            attributes[sc.COMM_BYTES] = nbytes
        start = T0 + seq * 10_000_000
        tracer.start_span(name, start_time=start, attributes=attributes).end(end_time=start + ns)
    provider.shutdown()
    return trace_body(memory.get_finished_spans())


@pytest.mark.parametrize("wire", ["C", "protobuf runtime"])
def test_each_op_gets_the_bus_factor_of_its_collective_and_group(monkeypatch, wire):
    if wire == "protobuf runtime":
        monkeypatch.setattr(decode, "WIRE", otlpwire)
    elif decode.WIRE is otlpwire:
        pytest.skip("the C decoder is not built")
    body = export()
    ops = decode.decode("traces", [body, body]).tables["ops"]  # two requests: one batch, each pair twice
    assert ops.num_rows == 2 * len(OPS)
    rows = ops.select(["name", "group_size", "bytes", "algbw_gbps", "busbw_gbps"]).to_pylist()
    for row, (name, group_size, nbytes, ns) in zip(rows, OPS + OPS):
        assert (row["name"], row["group_size"], row["bytes"]) == (name, group_size, nbytes)
        if nbytes is None:
            assert row["algbw_gbps"] is None and row["busbw_gbps"] is None
            continue
        algbw = nbytes / (ns / 1e9) / 1e9
        assert row["algbw_gbps"] == pytest.approx(algbw)
        if name in FACTOR and group_size is not None:
            assert row["busbw_gbps"] == pytest.approx(algbw * FACTOR[name](group_size))
        else:
            assert row["busbw_gbps"] is None
