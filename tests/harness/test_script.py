"""Running a script we did not write as `python script.py args` would."""

import re
import sys

import pytest

from hetero.errors import HeteroError
from hetero.harness.script import run_script, script_argv


def test_argv_is_passed_unchanged_a_separator_too():
    assert script_argv("t.py", ["--", "--lr", "3"]) == ["t.py", "--", "--lr", "3"]
    assert script_argv("t.py", ["--lr", "--", "x"]) == ["t.py", "--lr", "--", "x"]
    assert script_argv("t.py", ["--plan", "p.yaml", "--help"]) == ["t.py", "--plan", "p.yaml", "--help"]


def test_script_sees_its_argv_path_and_main(tmp_path, capsys):
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    script = tmp_path / "s.py"
    script.write_text("import sys, helper_mod\nprint(__name__, sys.argv, helper_mod.VALUE)\n")
    before = list(sys.argv)
    assert run_script(str(script), ["--help", "x"]).exit_code == 0
    assert capsys.readouterr().out == f"__main__ ['{script}', '--help', 'x'] 7\n"
    assert sys.argv == before


@pytest.mark.parametrize("code, expected", [("sys.exit(3)", 3), ("sys.exit()", 0), ("sys.exit('bye')", 1)])
def test_exit_codes_pass_through(tmp_path, code, expected):
    script = tmp_path / "s.py"
    script.write_text(f"import sys\n{code}\n")
    assert run_script(str(script), []).exit_code == expected


def test_a_crash_shows_the_scripts_traceback_not_ours(tmp_path, capsys):
    script = tmp_path / "crash.py"
    script.write_text("def train():\n    raise ValueError('bad batch')\n\ntrain()\n")
    assert run_script(str(script), []).exit_code == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and re.findall(r'File "([^"]+)"', err)[0] == str(script)  # its frame first
    assert "harness/script.py" not in err and "runpy" not in err
    assert err.rstrip().endswith("ValueError: bad batch")


def test_missing_script_is_a_usage_error(tmp_path):
    with pytest.raises(HeteroError) as e:
        run_script(str(tmp_path / "nope.py"), [])
    assert e.value.exit_code == 2


def test_an_exception_the_run_explains_ends_with_its_one_line_error(tmp_path, capsys):
    """What a GPU budget's overrun does: the runtime's explanation replaces the script's traceback."""
    script = tmp_path / "oom.py"
    script.write_text("import torch\nraise torch.cuda.OutOfMemoryError('CUDA out of memory')\n")

    def explain(error):
        return HeteroError("over budget", exit_code=4) if "out of memory" in str(error) else None

    with pytest.raises(HeteroError) as e:
        run_script(str(script), [], explain=explain)
    assert e.value.exit_code == 4 and capsys.readouterr().err == ""
    assert run_script(str(script), [], explain=lambda error: None).exit_code == 1  # not explained: the traceback
