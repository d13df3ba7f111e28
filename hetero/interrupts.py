"""Ctrl-C, SIGTERM and SIGHUP (what terminals and schedulers send) end a run alike: cleaned up, exit 128 + signal.

Within `handled()`, each of these signals raises `Interrupted` in the main thread, so `finally` blocks and
`with` exits remove what the run made, and the command exits 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP).

An exception raised inside a finalizer (`__del__`, a weakref callback) is printed and ignored by Python, and the
interrupted code carries on as if nothing happened: a Ctrl-C landing there used to let the run finish with exit 0.
The handler therefore never raises inside one: it has the signal delivered again a moment later, outside. And
whatever a script does with the exception, `exit_code()` still says the run was interrupted. A second signal, which
comes while the first one's cleanup runs (an impatient Ctrl-C), is absorbed so the cleanup finishes; a third one
raises again, for a cleanup that hangs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

from hetero.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_received: list[int] = []  # signals that reached handled() since it was entered, first first
_raised = [0]  # Interrupted raised so far within handled()
_REDELIVER_S = 0.01  # how soon a signal that landed in a finalizer is delivered again


@contextlib.contextmanager
def handled():
    """Within: SIGINT, SIGTERM and SIGHUP raise Interrupted(signum) in the main thread; the handlers that were there
    before are back afterwards. Only from the main thread (Python delivers signals only there)."""
    _received.clear()
    _raised[0] = 0
    previous = {s: signal.signal(s, _handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_code() -> int | None:
    """128 + the first signal received within the last `handled()`; None when there was none."""
    return 128 + _received[0] if _received else None


def name(signum: int) -> str:
    return "interrupted" if signum == signal.SIGINT else f"terminated by {signal.Signals(signum).name}"


def _handler(signum: int, frame) -> None:
    if signum not in _received:
        _received.append(signum)
    if _in_finalizer(frame):
        timer = threading.Timer(_REDELIVER_S, signal.pthread_kill, (threading.main_thread().ident, signum))
        timer.daemon = True
        timer.start()
        return
    _raised[0] += 1
    if _raised[0] != 2:  # the second one comes while the first one's cleanup runs: let it finish; a third forces
        raise Interrupted(signum)


def _in_finalizer(frame) -> bool:
    """Whether Python would swallow an exception raised at `frame`: a `__del__` or weakref callback below it."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (code.co_name == "__call__" and code.co_filename.endswith("weakref.py")):
            return True
        frame = frame.f_back
    return False


PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None, signum: int = signal.SIGTERM) -> None:
    """Linux: this process gets `signum` when its parent ends, however it ends (SIGKILL included); a no-op elsewhere.
    Exits at once (128 + signum) when the parent (`parent`: the pid it must be; default: the current one) is gone."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid() if parent is None else parent
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request: nobody will send it
        os._exit(128 + signum)
