"""The entry point: version, help with examples, exit codes, tracebacks only with --debug, Ctrl-C."""

import os
import signal
import subprocess
import sys
import time

import pytest

from hetero import __version__
from hetero.cli import main as cli
from hetero.schema import files


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"hetero {__version__}\n"


def test_python_dash_m_works():
    result = subprocess.run([sys.executable, "-m", "hetero", "--version"], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, f"hetero {__version__}\n"), result.stderr


def test_check_and_show_do_not_import_torch():
    code = "import sys, hetero.cli.main, hetero.docs; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("args", [["--help"], ["check", "--help"], ["show", "--help"]])
def test_help_shows_an_example(args, capsys):
    assert cli.main(args) == 0
    assert "Example: hetero " in capsys.readouterr().out


def test_usage_errors_exit_2(capsys):
    assert cli.main(["check"]) == 2
    assert cli.main(["frobnicate"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_debug_shows_the_traceback(tmp_path, capsys):
    (tmp_path / "p.yaml").write_text("")
    assert cli.main(["show", str(tmp_path / "p.yaml")]) == 3
    assert "Traceback" not in capsys.readouterr().err
    assert cli.main(["--debug", "show", str(tmp_path / "p.yaml")]) == 3
    err = capsys.readouterr().err
    last = err.rstrip().splitlines()[-1]  # the traceback, then the error as without --debug
    assert "Traceback" in err and last.startswith(f"error: {tmp_path / 'p.yaml'}:"), err


def test_ctrl_c_exits_130(monkeypatch, capsys):
    def interrupted_load(path, expect=None):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)  # the handler raises Interrupted before this returns

    monkeypatch.setattr(files, "load", interrupted_load)
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under a shell's `&` (nohup, CI)
    assert cli.main(["show", "plan.yaml"]) == 130
    assert capsys.readouterr().err == "error: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_usage_lines_read_as_users_type_them(capsys):
    for command in ("run", "profile", "report", "show", "check"):
        assert cli.main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert "{" not in out.splitlines()[0] and "<str>" not in out and "<list[str]>" not in out, command
    assert cli.main(["run", "--help"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["Usage:", "hetero", "run", "[OPTIONS]", "SCRIPT",
                                                               "[ARGS]..."]
