"""Quantities with units: `38.6MiB`, `1.25ms`, `11.8GB/s`, `124.4M`, `410M params/s`.

Files store every quantity in its base unit (bytes, seconds, bytes/s, a count, params/s). Users may write
either a plain number in that base unit or a string with a unit. `format_exact` writes the shortest string that
parses back to exactly the same value, so `load(dump(x)) == x` holds without ugly 17-digit numbers wherever a
shorter one is exact; `format_short` rounds for tables.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from decimal import Context, Decimal, InvalidOperation

LIMIT = Decimal(2**63 - 1)  # the largest quantity a file may hold, in its base unit: an int64, finite as a float
MAX_DIGITS = 40  # longest number text, and largest exponent, parsed before LIMIT is checked


def quoted_cut(value: object, width: int = 80) -> str:
    """`value` as a message echoes it: repr, at most `width` characters."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


_NUMBER = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(.*?)\s*$")


@dataclass(frozen=True, slots=True)
class Unit:
    """A kind of quantity: the words it accepts and the ladder it is written with."""

    name: str  # what the quantity is, for messages: "size"
    base: str  # the base unit, for docs: "bytes"
    suffix: str  # the field-name suffix naming this unit, stripped from the YAML key: "_bytes"
    integral: bool  # stored as int (bytes, counts) rather than float
    words: dict[str, Decimal]  # every accepted unit word -> its scale in the base unit
    ladder: tuple[tuple[Decimal, str], ...]  # (scale, word) used for writing, ascending

    def parse(self, raw: int | float | str) -> int | float:
        """`raw` as a number in the base unit; ValueError with the accepted units if it is not one."""
        if isinstance(raw, bool):
            raise ValueError(f"expected a {self.name}, got {str(raw).lower()}")
        value = Decimal(raw) if isinstance(raw, (int, float)) else self._parse_text(raw)
        if not value.is_finite() or abs(value) > LIMIT:
            raise ValueError(f"{self.name} {quoted_cut(raw)} is out of range (at most {LIMIT:.3e} {self.base})")
        if value < 0:
            raise ValueError(f"negative {self.name} {quoted_cut(raw)} (a {self.name} is >= 0)")
        return int(value.to_integral_value()) if self.integral else float(value)

    def _parse_text(self, text: str) -> Decimal:
        if not (match := _NUMBER.match(text)):
            raise ValueError(f"bad {self.name} {quoted_cut(text)} (write a number with a unit, e.g. {self.example()})")
        number, word = match.groups()
        if len(number) > MAX_DIGITS:
            raise ValueError(f"{self.name} {quoted_cut(text)} has too many digits (at most {MAX_DIGITS})")
        try:
            huge = Decimal(number).adjusted() > MAX_DIGITS  # refused before any arithmetic on it
        except InvalidOperation:  # an exponent beyond what Decimal holds
            huge = True
        if huge:
            raise ValueError(f"{self.name} {quoted_cut(text)} is out of range (at most {LIMIT:.3e} {self.base})")
        if word not in self.words:
            close = difflib.get_close_matches(word, list(self.words), n=1, cutoff=0.5)
            guess = f"; did you mean '{number}{close[0]}'?" if close else ""
            raise ValueError(f"bad {self.name} {quoted_cut(text)}: unknown unit {quoted_cut(word)} "
                             f"(use {self.unit_list()}){guess}")
        return Decimal(number) * self.words[word]

    def format_exact(self, value: int | float) -> str:
        """The shortest text in the best unit that parses back to exactly `value`."""
        scale, word = self._rung(value)
        for digits in range(1, 40):
            text = _significant(value, scale, digits) + word
            if self.parse(text) == value:
                return text
        raise AssertionError(f"no exact text for {value!r}")  # unreachable: 40 digits are exact

    def format_short(self, value: int | float | None, digits: int = 3) -> str:
        """`value` rounded to `digits` significant digits, for tables."""
        if value is None:
            return "-"
        scale, word = self._rung(value)
        text = _significant(value, scale, digits)
        up = next((rung for rung in self.ladder if rung[0] > scale), None)
        if up is not None and Decimal(text) * scale >= up[0]:  # 999.9999us rounds to "1ms", not to "1000us"
            scale, word = up
            text = _significant(value, scale, digits)
        return text + word

    def _rung(self, value: int | float) -> tuple[Decimal, str]:
        if value == 0:  # "0s", not "0ns"
            return next(r for r in self.ladder if r[0] == 1)
        # the largest rung at most `value`; exact: Python compares a float with a Decimal by value
        return next((rung for rung in reversed(self.ladder) if abs(value) >= rung[0]), self.ladder[0])

    def example(self) -> str:
        return f"{12.5 if not self.integral else 12}{self.ladder[min(2, len(self.ladder) - 1)][1]}"

    def unit_list(self) -> str:
        return ", ".join(w for w in self.words if w) or "a plain number"


_EXACT = Context(prec=80)  # wide enough that dividing any float by a unit's scale is exact


def _significant(value: int | float, scale: Decimal, digits: int) -> str:
    """`value / scale` rounded to `digits` significant digits, in plain notation without trailing zeros."""
    q = _EXACT.divide(Decimal(value), scale)
    if q == 0:
        return "0"
    q = q.quantize(Decimal(1).scaleb(q.adjusted() - digits + 1), context=_EXACT)
    text = f"{q:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _ladder(*pairs: tuple[str, int | str]) -> tuple[tuple[Decimal, str], ...]:
    return tuple((Decimal(scale), word) for word, scale in pairs)


_BINARY = _ladder(("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40))
_DECIMAL = _ladder(("B", 1), ("kB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12))
_SIZE_WORDS = {w: s for s, w in _BINARY + _DECIMAL} | {"": Decimal(1), "KB": Decimal(1000)}
_TIMES = _ladder(("ns", "1e-9"), ("us", "1e-6"), ("ms", "1e-3"), ("s", 1))
_COUNTS = _ladder(("", 1), ("K", 10**3), ("M", 10**6), ("B", 10**9), ("T", 10**12))

SIZE = Unit(name="size", base="bytes", suffix="_bytes", integral=True, words=_SIZE_WORDS, ladder=_BINARY)
TIME = Unit(name="time", base="seconds", suffix="_s", integral=False,
            words={w: s for s, w in _TIMES} | {"µs": Decimal("1e-6"), "": Decimal(1)}, ladder=_TIMES)
RATE = Unit(name="rate", base="bytes/s", suffix="_bytes_per_s", integral=False,
            words={f"{w}/s": s for w, s in _SIZE_WORDS.items() if w} | {"": Decimal(1)},
            ladder=tuple((s, f"{w}/s") for s, w in _DECIMAL))
COUNT = Unit(name="count", base="items", suffix="", integral=True, words={w: s for s, w in _COUNTS}, ladder=_COUNTS)
PARAM_RATE = Unit(name="parameter rate", base="params/s", suffix="_params_per_s", integral=False,
                  words={f"{w} params/s".strip(): s for s, w in _COUNTS}
                  | {f"{w}params/s": s for s, w in _COUNTS if w} | {"": Decimal(1)},
                  ladder=tuple((s, f"{w} params/s" if w else " params/s") for s, w in _COUNTS))


def measured(value: float, digits: int = 4) -> float:
    """A measurement rounded to `digits` significant digits: timings vary far more than that between runs, and
    the files that hold them stay readable."""
    return float(f"{value:.{digits}g}")


def short_time(seconds: float) -> str:
    """A duration for a table or a `why`, to 3 significant digits: `1.25ms` (float noise below a picosecond
    dropped, so 0.000999999999 reads `1ms`)."""
    return TIME.format_short(round(seconds, 12))


def short_size(nbytes: float) -> str:
    """A byte count for a table or a `why`, to 3 significant digits: `38.6MiB`."""
    return SIZE.format_short(int(nbytes))


def size_change(before: float, after: float) -> str:
    """`489MiB -> 52.8MiB (-89%)`: a size and what it became."""
    cut = 1 - after / before if before else 0.0
    return f"{short_size(before)} -> {short_size(after)} (-{cut:.0%})"


def relative_change(new: float, old: float) -> str:
    """`+12%`: how far `new` is from `old`; `n/a` without an `old`."""
    return f"{(new - old) / old:+.0%}" if old else "n/a"
