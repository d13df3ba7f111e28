"""hetero.errors: where a problem is shown, how many a file's error counts, and the exit code each error ends with."""

import signal

import pytest

from hetero import errors
from hetero.errors import Damaged, FileProblems, HeteroError, Interrupted, Problem
from tests.figures import figures


def test_a_problem_is_located_as_far_as_it_is_known():
    assert str(Problem("plan.yaml", "bad", line=3, column=7)) == "plan.yaml:3:7: bad"
    assert str(Problem("plan.yaml", "bad", line=3)) == "plan.yaml:3: bad"
    assert str(Problem("plan.yaml", "unreadable")) == "plan.yaml: unreadable"


def test_file_problems_name_the_first_and_count_the_rest():
    many = FileProblems([Problem("p.yaml", "one", line=1), Problem("p.yaml", "two", line=2),
                         Problem("p.yaml", "three", line=9)], hint="fix them")
    first = str(many.problems[0])
    assert str(many).startswith(first) and figures(str(many).removeprefix(first)) == ["2"]  # the first, 2 more
    assert (many.exit_code, many.hint, len(many.problems)) == (errors.INVALID_FILE, "fix them", 3)
    assert str(FileProblems([Problem("p.yaml", "one")])) == "p.yaml: one"
    with pytest.raises(AssertionError):
        FileProblems([])


def test_each_error_ends_with_its_documented_exit_code():
    assert HeteroError("x").exit_code == errors.FAILURE
    assert HeteroError("x", exit_code=errors.STALE_PLAN).exit_code == 4
    assert Damaged("a state file shrank", hint="run again").exit_code == errors.DAMAGED == 6
    assert [Interrupted(s).exit_code for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)] == [130, 143, 129]
    assert Interrupted().exit_code == errors.INTERRUPTED


def test_an_interruption_is_not_an_exception_a_script_could_swallow():
    with pytest.raises(Interrupted):
        try:
            raise Interrupted(signal.SIGTERM)
        except Exception:  # what a training script's broad handler catches
            pytest.fail("caught as an Exception")
