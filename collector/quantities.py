"""Quantities as people read them: "717 kW", "4.2 kJ", "50 GB/s", "3 min 20 s", "3.6%",
"640–660 W", "1 rank", "2025-03-01 14:05:09 UTC".

One helper for findings' summaries, reports and the dashboard, so that a figure is shown with
a unit that fits its size and as many significant digits as it carries (three; two for
percentages), never as "0.00 kJ", "5e+10 bytes/s" or "648-648 W", wherever it appears.
"""

import itertools
import math
from dataclasses import dataclass
from datetime import datetime

PREFIXES = ("", "k", "M", "G", "T", "P")  # decimal (SI), as GPU power, NVLink and NCCL figures are given


def _round(value: float, digits: int) -> float:
    """`value` to `digits` significant digits."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def _decimals(value: float, digits: int) -> int:
    """Decimals that show `value` (already rounded) to `digits` significant digits, none past the point
    for a value of `digits` digits or more."""
    if value == 0 or not math.isfinite(value):
        return 0
    return max(digits - 1 - math.floor(math.log10(abs(value))), 0)


def _number(value: float, decimals: int, signed: bool = False) -> str:
    """`value` with `decimals` decimals, trailing zeros dropped, thousands separated; no "-0"."""
    if not math.isfinite(value):
        return "—"
    text = f"{value:{'+' if signed else ''},.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    if text.lstrip("+-") == "0":
        return "0"
    return text


@dataclass(frozen=True)
class Scale:
    """A unit with decimal prefixes: `power(716_800)` is "717 kW". `factor` turns the value given
    (in the base unit: W, J, B) into the unit's (J into Wh: 1 / 3600)."""

    unit: str
    factor: float = 1.0
    prefixed: bool = True
    digits: int = 3
    space: str = " "

    def prefix(self, value: float) -> tuple[float, str]:
        """The divisor and the unit for a value of this size (in the base unit): (1e9, "GB/s")."""
        value = abs(_round(value * self.factor, self.digits))
        power = 0
        if self.prefixed and math.isfinite(value) and value >= 1000:
            power = min(int(math.log10(value) // 3), len(PREFIXES) - 1)
        return 1000.0**power / self.factor, PREFIXES[power] + self.unit

    def __call__(self, value: float, signed: bool = False) -> str:
        divisor, unit = self.prefix(value)
        scaled = _round(value / divisor, self.digits)
        return f"{_number(scaled, _decimals(scaled, self.digits), signed)}{self.space}{unit}"

    def margin(self, value: float, margin: float) -> str:
        """ "±0.3%": an uncertainty at the precision of the value it qualifies, never at its own
        (a margin of 8e-15% beside "2.2%" is "±0.0%", not sixteen digits of noise)."""
        divisor, unit = self.prefix(value)
        decimals = _decimals(_round(value / divisor, self.digits), self.digits)
        return f"±{round(abs(margin) / divisor, decimals):.{decimals}f}{self.space}{unit}"

    def span(self, low: float, high: float) -> str:
        """A range in one unit and precision, the larger end's: "640–660 W", "-10 to 30 J"; one value
        where both ends read the same ("648 W")."""
        divisor, unit = self.prefix(max(abs(low), abs(high)))
        decimals = _decimals(_round(max(abs(low), abs(high)) / divisor, self.digits), self.digits)
        a, b = (_number(round(v / divisor, decimals), decimals) for v in (low, high))
        if a == b:
            return f"{a}{self.space}{unit}"
        return f"{a}{'–' if min(low, high) >= 0 else ' to '}{b}{self.space}{unit}"


power = Scale("W")
energy = Scale("J")
energy_wh = Scale("Wh", factor=1 / 3600)  # joules given, watt-hours shown: a facility's reckoning
data_size = Scale("B")
bandwidth = Scale("B/s")
percent = Scale("%", factor=100, prefixed=False, digits=2, space="")  # a fraction given: 0.036 is "3.6%"

_UNITS = ((86400, "d"), (3600, "h"), (60, "min"), (1, "s"))
_SMALL = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))


def duration(seconds: float) -> str:
    """ "350 ms", "2.41 s", "3 min 20 s", "2 h 5 min", "3 d 4 h": three significant digits under a
    minute, the two largest whole units from a minute on."""
    if not math.isfinite(seconds):
        return "—"
    sign, seconds = ("-" if seconds < 0 else ""), abs(seconds)
    if seconds == 0:
        return "0 s"
    if _round(seconds, 3) < 60:
        for size, unit in _SMALL:
            scaled = _round(seconds / size, 3)
            if scaled >= 1 or size == _SMALL[-1][0]:
                return f"{sign}{_number(scaled, _decimals(scaled, 3))} {unit}"
    whole = round(seconds)
    for (size, unit), (small, name) in itertools.pairwise(_UNITS):
        if whole >= size or size == 60:
            first, rest = divmod(whole, size)
            rest = round(rest / small)
            if rest * small == size:  # 59.6 min is 1 h, not "0 h 60 min"
                first, rest = first + 1, 0
            return f"{sign}{first} {unit}" + (f" {rest} {name}" if rest else "")
    raise AssertionError("unreachable: the loop ends at minutes")


def clock(at: datetime) -> str:
    """ "2025-03-01 14:05:09 UTC": a moment of the store's clock (UTC), to the second."""
    return f"{at:%Y-%m-%d %H:%M:%S} UTC"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """ "1 rank", "1,024 ranks": a count with its noun (`nouns`: the plural, where not noun + "s")."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"
