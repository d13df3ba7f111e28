"""hetero.cli.usage: help text in hetero's words, quantities with units in options, and the console's width."""

import pytest

from hetero.cli.usage import console, quantity, readable
from hetero.errors import USAGE, HeteroError
from hetero.units import SIZE, TIME


def test_help_text_drops_python_types_and_keeps_its_columns():
    usage = "Usage: hetero run [OPTIONS] {SCRIPT} [ARGS]..."
    assert readable(usage) == usage.replace("{SCRIPT}", "SCRIPT")
    line = "  --steps <int>      Steps to record."
    assert readable(line) == line.replace("<int>", "N    ")  # the description stays in its column
    args = "  SCRIPT <str>        The training script."
    assert readable(args) == args.replace("<str>", "     ")


def test_a_quantity_is_read_in_its_units_base():
    assert quantity(SIZE, "8GiB", "--dram-budget") == 8 * 2**30
    assert quantity(TIME, "1ms", "--stay-time") == pytest.approx(1e-3)
    assert quantity(SIZE, None, "--dram-budget") is None


def test_a_bad_quantity_is_a_usage_error_with_an_example():
    with pytest.raises(HeteroError) as e:
        quantity(SIZE, "eight gigs", "--dram-budget")
    assert e.value.exit_code == USAGE
    assert e.value.message.startswith("--dram-budget: ")
    assert "--dram-budget" in e.value.hint
    assert SIZE.parse(e.value.hint.split()[-1]) > 0  # the example itself parses


def test_the_console_is_as_wide_as_columns_says_else_the_widest_allowed_when_piped(monkeypatch):
    monkeypatch.setenv("COLUMNS", "77")
    assert console(200).width == 77
    monkeypatch.setenv("COLUMNS", "")
    assert console(130).width == 130  # pytest captures the output: not a terminal
