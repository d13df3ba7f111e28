"""hetero.interrupts within this process: a signal raises Interrupted in the main thread, a second one (while the
first one's cleanup runs) is absorbed, a third raises again; the handlers before are back afterwards.
(tests/faults/test_signals.py sends the signals to whole hetero commands.)"""

import os
import signal
import time

import pytest

from hetero import interrupts
from hetero.errors import Interrupted


def deliver(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.5)  # a Python handler runs at the next bytecode boundary of the main thread: before this returns


def test_a_signal_raises_in_the_main_thread_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as e:
        with interrupts.handled():
            deliver(signal.SIGTERM)
    assert e.value.signum == signal.SIGTERM and interrupts.exit_code() == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_signal_lets_the_cleanup_finish_and_a_third_forces():
    cleaned = []
    with pytest.raises(Interrupted) as third:
        with interrupts.handled():
            try:
                deliver(signal.SIGHUP)
            except Interrupted:
                deliver(signal.SIGINT)  # absorbed: the cleanup goes on
                cleaned.append(True)
                deliver(signal.SIGINT)
    assert cleaned == [True]
    assert third.value.signum == signal.SIGINT
    assert interrupts.exit_code() == 129  # the first signal says how the run ended


def test_no_signal_no_exit_code_and_the_names_said():
    with interrupts.handled():
        pass
    assert interrupts.exit_code() is None
    assert (interrupts.name(signal.SIGINT), interrupts.name(signal.SIGTERM)) == ("interrupted",
                                                                                 "terminated by SIGTERM")
