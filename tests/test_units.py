import random

import pytest

from hetero.units import COUNT, PARAM_RATE, RATE, SIZE, TIME


@pytest.mark.parametrize(
    "unit, text, value",
    [
        (SIZE, "38.6MiB", round(38.6 * 2**20)),
        (SIZE, "4096", 4096),
        (SIZE, "1.5 GB", 1_500_000_000),
        (SIZE, "2KB", 2000),
        (TIME, "1.25ms", 0.00125),
        (TIME, "3µs", 3e-6),
        (TIME, "0.5", 0.5),
        (RATE, "11.8GB/s", 11.8e9),
        (RATE, "1GiB/s", float(2**30)),
        (COUNT, "124.4M", 124_400_000),
        (COUNT, "7B", 7_000_000_000),
        (PARAM_RATE, "410M params/s", 410e6),
        (PARAM_RATE, "1.38Bparams/s", 1.38e9),
    ],
)
def test_parse(unit, text, value):
    assert unit.parse(text) == value


@pytest.mark.parametrize(
    "unit, raw, named",  # what the error names: the value as written, a unit it does not know, the likely one
    [
        (SIZE, "12Mb", ("'12Mb'", "'Mb'", "'12MB'")),
        (SIZE, "-4MiB", ("'-4MiB'",)),
        (SIZE, -1, ("-1",)),
        (TIME, "fast", ("'fast'",)),
        (TIME, True, ("true",)),
    ],
)
def test_parse_errors(unit, raw, named):
    with pytest.raises(ValueError) as e:
        unit.parse(raw)
    said = str(e.value)
    assert "\n" not in said and [x for x in named if x not in said] == [], said
    assert unit.name in said  # what was expected: a size, a time


@pytest.mark.parametrize(
    "unit, value, text",
    [
        (SIZE, 0, "0B"),
        (SIZE, 512, "512B"),
        (SIZE, 1536, "1.5KiB"),
        (SIZE, 24 * 2**20, "24MiB"),
        (TIME, 0.00125, "1.25ms"),
        (TIME, 0.0, "0s"),
        (RATE, 11.8e9, "11.8GB/s"),
        (COUNT, 124_400_000, "124.4M"),
        (PARAM_RATE, 410e6, "410M params/s"),
    ],
)
def test_format_exact_is_short(unit, value, text):
    assert unit.format_exact(value) == text


def test_format_exact_round_trips_any_value():
    rng = random.Random(0)
    for _ in range(2000):
        size = rng.randint(0, 2**53)
        assert SIZE.parse(SIZE.format_exact(size)) == size
        for unit in (TIME, RATE, PARAM_RATE):
            x = 10 ** rng.uniform(-12, 13)
            assert unit.parse(unit.format_exact(x)) == x


def test_format_short_rounds_for_tables():
    assert SIZE.format_short(40474214) == "38.6MiB"
    assert TIME.format_short(1 / 3) == "333ms"
    assert TIME.format_short(None) == "-"
    assert TIME.format_short(0.000999999999) == "1ms"
    assert SIZE.format_short(2**30) == "1GiB"
