"""Quantities as people read them (collector/quantities.py): a unit that fits the size, three
significant digits (two for percentages), ranges that collapse when both ends read the same,
counts with their nouns; and, over any value, text that reads back to the value within its
precision."""

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collector import quantities as q

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (q.power(716_800), "717 kW"),
        (q.power(2520), "2.52 kW"),
        (q.power(648), "648 W"),
        (q.power(999.7), "1 kW"),  # rounded into the next prefix, not "1,000 W"
        (q.power(0), "0 W"),
        (q.energy(4.2), "4.2 J"),
        (q.energy(-0.0001), "-0.0001 J"),
        (q.energy(5400), "5.4 kJ"),
        (q.energy_wh(3.6e6), "1 kWh"),
        (q.energy_wh(25_200), "7 Wh"),
        (q.bandwidth(5e10), "50 GB/s"),
        (q.data_size(1_500_000), "1.5 MB"),
        (q.percent(0.036), "3.6%"),
        (q.percent(0.00071, signed=True), "+0.071%"),
        (q.percent(-0.0004), "-0.04%"),
        (q.percent(1.5), "150%"),
        (q.percent(-0.0, signed=True), "0%"),  # no "-0%"
        (q.duration(0.00035), "350 µs"),
        (q.duration(0.9996), "1 s"),
        (q.duration(2.414), "2.41 s"),
        (q.duration(59.97), "1 min"),
        (q.duration(200), "3 min 20 s"),
        (q.duration(3599.6), "1 h"),
        (q.duration(7500), "2 h 5 min"),
        (q.duration(3 * 86400 + 4 * 3600 + 100), "3 d 4 h"),
        (q.power.span(648, 648.2), "648 W"),
        (q.power.span(640, 660), "640–660 W"),
        (q.power.span(950, 1200), "0.95–1.2 kW"),
        (q.energy.span(-10, 12), "-10 to 12 J"),
        (q.energy.span(-0.004, 0.004), "-0.004 to 0.004 J"),
        (q.percent.margin(0.022, 8.3e-17), "±0.0%"),  # at the value's precision, not sixteen digits of noise
        (q.percent.margin(0.022, 0.0031), "±0.3%"),
        (q.percent.margin(0.25, 0.012), "±1%"),
        (q.power.margin(716_800, 2_600), "±3 kW"),
        (q.plural(1, "rank"), "1 rank"),
        (q.plural(1024, "rank"), "1,024 ranks"),
        (q.plural(0, "more such node"), "0 more such nodes"),
        (q.plural(2, "child", "children"), "2 children"),
    ],
)
def test_examples(text, expected):
    assert text == expected


def _read(text: str, unit: str) -> float:
    """A formatted quantity back as a number in the base unit."""
    number, prefix = re.fullmatch(rf"([-+]?[\d,]*\.?\d+) ?(\w?){re.escape(unit)}", text).groups()
    return float(number.replace(",", "")) * 1000.0 ** q.PREFIXES.index(prefix)


finite = st.floats(min_value=-1e17, max_value=1e17, allow_nan=False)


@given(finite)
def test_a_quantity_reads_back_within_three_significant_digits_in_a_fitting_unit(value):
    text = q.power(value)
    number = text.split(" ")[0].lstrip("-").replace(",", "")
    assert len(number.replace(".", "").lstrip("0")) <= 3 or "." not in number  # no spurious digits
    if abs(value) >= 1:
        assert 1 <= float(number) < 1000 or text.endswith(" PW")  # a prefix that fits
    assert "e" not in text and not text.startswith("-0 ")
    assert _read(text, "W") == pytest.approx(value, rel=5e-3, abs=1e-300)


@given(finite, finite)
def test_a_range_is_one_value_exactly_when_its_ends_read_the_same(a, b):
    low, high = min(a, b), max(a, b)
    text = q.energy.span(low, high)
    parts = re.split(r"–| to ", text.rsplit(" ", 1)[0])
    assert len(parts) in (1, 2)
    unit = text.rsplit(" ", 1)[1]
    assert unit.endswith("J") and (" to " in text) == (len(parts) == 2 and low < 0)
    ends = [_read(f"{p} {unit}", "J") for p in parts]
    scale = max(abs(low), abs(high))
    for end, value in zip(ends if len(ends) == 2 else ends * 2, (low, high), strict=True):
        assert end == pytest.approx(value, abs=scale * 6e-3 + 1e-300)


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False))
def test_a_duration_reads_back_within_its_precision(seconds):
    text = q.duration(seconds)
    units = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1, "min": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"([\d.]+) (ns|µs|ms|s|min|h|d)", text)
    assert parts and " ".join(f"{n} {u}" for n, u in parts) == text and len(parts) <= 2
    back = sum(float(n) * units[u] for n, u in parts)
    smallest = units[parts[-1][1]]
    tolerance = smallest / 2 + 1e-12 if seconds >= 59.95 else seconds * 5e-3 + 1e-300
    assert math.isclose(back, seconds, abs_tol=tolerance)
