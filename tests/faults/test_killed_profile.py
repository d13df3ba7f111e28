"""`hetero profile` killed during its "returned memory" phase (issue 33, item 4): the fresh process it measures in
dies with it, and its `hetero-returned-*` directory is swept by the next start, which says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.run.devices import workdir
from tests.faults.test_signals import REPO, gone
from tests.waits import until

# The profile's phase on its own, in a process we can kill: the fresh process runs a script that says its pid, then
# would train for a minute.
PROFILE = "import sys; from hetero.profile import returned; returned.measure(sys.argv[1], [], 1)"
SCRIPT = "import os, sys, time\nopen(sys.argv[0] + '.pid', 'w').write(str(os.getpid()))\ntime.sleep(60)\n"


@pytest.mark.timeout(120)
def test_the_returned_memory_child_dies_with_the_profile_and_its_directory_is_swept(tmp_path):
    temp = tmp_path / "temp"
    temp.mkdir(mode=0o700)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    profile = subprocess.Popen([sys.executable, "-c", PROFILE, str(script)],
                               env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(temp)})
    try:
        pid_file = Path(f"{script}.pid")
        until(lambda: pid_file.exists() and pid_file.read_text())
        child = int(pid_file.read_text())
        (left,) = temp.iterdir()
        assert left.name.startswith(f"hetero-returned-{profile.pid}-{workdir.host()}-")
    finally:
        profile.send_signal(signal.SIGKILL)  # as a memory cgroup kills: nothing runs after it
        profile.wait()
    until(lambda: gone(child))  # the parent-death signal ends it, not its minute of training
    line = workdir.sweep_earlier([str(temp)])
    assert line is not None and f"pid {profile.pid}" in line and str(temp) in line
    assert os.listdir(temp) == []
