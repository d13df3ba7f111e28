"""`hetero run`: exit codes, tracebacks, Ctrl-C, stale plans, and arguments that belong to the script."""

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hetero.cli.main import main
from hetero.launch import launcher
from hetero.launch.launcher import PLAN_ENV, build
from hetero.plan import fit
from hetero.run import huge_pages
from hetero.schema import files
from tests.conftest import REPO
from tests.profile import scripts
from tests.run.plans import optimizer_plan

TRAIN = """
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    F.cross_entropy(model(torch.randn(8, 16)), torch.randint(4, (8,))).backward()
    opt.step(); opt.zero_grad()
print("done", type(opt).__module__)
"""


def net():
    namespace: dict = {}
    exec(compile(scripts.HEADER, "net", "exec"), namespace)
    return namespace["Net"]()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files.save(optimizer_plan(net(), nvme=("head.weight",), nvme_path=str(tmp_path / "nvme")), "plan.yaml")
    return tmp_path


def test_build_is_pure_and_passes_arguments_untouched(tmp_path):
    launch = build("train.py", ["--plan", "x.yaml", "--help"], tmp_path / "plan.yaml")
    assert launch.argv == ["train.py", "--plan", "x.yaml", "--help"]
    assert launch.env == {PLAN_ENV: str((tmp_path / "plan.yaml").resolve())}


def test_runs_the_script_with_the_offloaded_optimizer(workdir, capfd):
    script = scripts.write(workdir, TRAIN)
    assert main(["run", "--skip-profile-check", script, "3"]) == 0
    out, err = capfd.readouterr()
    assert "done hetero.run.offloaded_adam" in out  # the Adam the script built is hetero's
    # 16 B per parameter on the channels (master, m, v, gradient) and head.weight's 12 on NVMe (master, m, v)
    states = next(x for x in err.splitlines() if "optimizer states: " in x)
    assert re.findall(r"[0-9.]+[KMG]?i?B\b", states) == ["26.1KiB", "1.5KiB"] and "AXDIMM" in states, states
    assert "hetero: dram peak " in err  # no profile beside the plan: no plain figure to compare with
    assert not (workdir / "nvme").exists() or os.listdir(workdir / "nvme") == []


def test_arguments_after_the_script_reach_it(workdir, capfd):
    script = scripts.write(workdir, "print('ARGV', sys.argv[1:])\n")
    assert main(["run", "--skip-profile-check", script, "--plan", "other.yaml", "--help"]) == 0
    assert "ARGV ['--plan', 'other.yaml', '--help']" in capfd.readouterr().out


@pytest.mark.parametrize("code", [0, 3])
def test_exit_code_passes_through(workdir, code):
    assert main(["run", "--skip-profile-check", scripts.write(workdir, f"sys.exit({code})\n")]) == code


def test_an_exception_exits_1_with_the_scripts_traceback(workdir, capfd):
    script = scripts.write(workdir, "def step():\n    raise KeyError('labels')\nstep()\n")
    assert main(["run", "--skip-profile-check", script]) == 1
    err = capfd.readouterr().err
    assert f'File "{script}"' in err and err.rstrip().endswith("KeyError: 'labels'")
    assert "hetero/run" not in err


def test_a_stale_profile_is_refused_with_exit_4(workdir, capfd, repo):
    (workdir / "profile.yaml").write_text((repo / "plans/gpt-tiny-cpu.profile.yaml").read_text())
    script = scripts.write(workdir, TRAIN)
    assert main(["run", "--skip-profile-check", script]) == 4
    error, hint = capfd.readouterr().err.splitlines()[-2:]
    assert error.startswith("error: plan.yaml") and "profile.yaml" in error and "--allow-stale" in hint
    assert main(["run", "--skip-profile-check", "--allow-stale", script, "2"]) == 0


def test_another_model_is_refused_with_exit_4(workdir, capfd):
    script = scripts.write(workdir, TRAIN.replace("model = Net()", "model = Net(width=48)"))
    assert main(["run", "--skip-profile-check", script]) == 4
    planned = files.load("plan.yaml").source.model_fingerprint
    assert planned[:19] in capfd.readouterr().err  # names the model the plan was made for


def test_without_a_plan_says_what_to_do(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--skip-profile-check", scripts.write(tmp_path, TRAIN)]) == 2
    error, hint = capfd.readouterr().err.splitlines()
    assert error.startswith("error: ") and "plan.yaml" in error
    assert hint.startswith("hint: ") and "hetero profile" in hint and "hetero plan" in hint  # the commands to run


def test_ctrl_c_exits_130_and_leaves_no_files(workdir):
    script = scripts.write(workdir, "import os, signal, time\n" + TRAIN.replace(
        "    opt.step(); opt.zero_grad()",
        "    opt.step(); opt.zero_grad()\n    if step == 2: os.kill(os.getpid(), signal.SIGINT); time.sleep(30)"))
    result = subprocess.run([sys.executable, "-m", "hetero", "run", "--skip-profile-check", script, "50"], cwd=workdir,
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 130, result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("error: ")
    assert not (workdir / "nvme").exists() or os.listdir(workdir / "nvme") == []


def test_the_default_plan_without_a_gpu_runs_plain_and_reports_the_peak_beside_plains(tmp_path, monkeypatch, capfd,
                                                                                     bundled_machine):
    monkeypatch.chdir(tmp_path)
    script = scripts.write(tmp_path, TRAIN)
    assert main(["profile", "--steps", "2", "--warmup", "1", "--nvme", str(tmp_path / "disk"), script, "12"]) == 0
    assert main(["plan"]) == 0
    plan = files.load("plan.yaml")
    assert (plan.optimizer, plan.activations) == (None, None)
    capfd.readouterr()
    assert main(["run", "--skip-profile-check", script, "3"]) == 0
    out, err = capfd.readouterr()
    assert "done torch.optim" in out  # the script's own optimizer
    line = next(x for x in err.splitlines() if x.startswith("hetero: dram peak "))
    assert "x plain's" in line and "(profiled); predicted" in line


@pytest.mark.slow
@pytest.mark.parametrize("theirs", [None, "glibc.malloc.hugetlb=0"])
def test_a_plan_returning_freed_memory_runs_with_malloc_asked_for_huge_pages_unless_the_user_said_otherwise(
        workdir, theirs):
    files.save(replace(files.load("plan.yaml"), allocator=fit.allocator_plan("test")), "plan.yaml")
    script = scripts.write(workdir, "import os\nprint('TUNABLES', os.environ.get('GLIBC_TUNABLES'))\n" + TRAIN)
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | {"PYTHONPATH": str(REPO)} | \
        ({"GLIBC_TUNABLES": theirs} if theirs else {})
    result = subprocess.run([sys.executable, "-m", "hetero", "run", "--skip-profile-check", script, "3"], cwd=workdir,
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert f"TUNABLES {theirs or 'glibc.malloc.hugetlb=1'}" in result.stdout  # started again with it, or theirs
    used = theirs is None and huge_pages.mode() in ("always", "madvise")
    assert ("huge pages)" if used else "without huge pages)") in result.stderr


@pytest.mark.parametrize("restarted", [False, True])
def test_hetero_run_starts_itself_again_once_and_goes_on_where_it_cannot(workdir, capfd, monkeypatch, restarted):
    files.save(replace(files.load("plan.yaml"), allocator=fit.allocator_plan("test")), "plan.yaml")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    if restarted:  # the started process itself, whose tunable a loader dropped: it must not start again
        monkeypatch.setenv(launcher.RESTARTED_ENV, "1")
    execs = []

    def execve(path, argv, env):
        execs.append(env)
        raise OSError("exec refused")

    monkeypatch.setattr(os, "execve", execve)
    script = scripts.write(workdir, TRAIN)
    assert launcher.run(script, ["3"], replace_process=True, skip_profile_check=True) == 0  # ran here all the same
    assert "done hetero.run.offloaded_adam" in capfd.readouterr().out
    if restarted:
        assert execs == [] and launcher.RESTARTED_ENV not in os.environ
    else:
        [env] = execs
        assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and env[launcher.RESTARTED_ENV] == "1"


def test_a_separator_after_the_script_reaches_it_as_python_would_pass_it(workdir, capfd):
    script = scripts.write(workdir, "print('ARGV', sys.argv[1:])\n")
    assert main(["run", "--skip-profile-check", script, "--", "--lr", "3"]) == 0
    out, err = capfd.readouterr()
    assert "ARGV ['--', '--lr', '3']" in out


def test_a_script_that_never_steps_says_the_plan_was_never_applied(workdir, capfd):
    script = scripts.write(workdir, "print('no training')\n")
    assert main(["run", "--skip-profile-check", script]) == 0
    warned = [x for x in capfd.readouterr().err.splitlines() if x.startswith("hetero: warning: ") and script in x]
    assert len(warned) == 1 and "never applied" in warned[0], warned  # the warning names the script


def test_an_unreadable_script_is_one_line_with_exit_2(workdir, capfd, monkeypatch):
    script = scripts.write(workdir, TRAIN)
    real_open = Path.open

    def denied(self, *args, **kwargs):
        if self.name == "train.py":
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)  # root reads any file: a chmod cannot make one unreadable here
    assert main(["run", "--skip-profile-check", script]) == 2
    err = capfd.readouterr().err
    error = err.splitlines()[0]
    assert error.startswith("error: ") and script in error and error.endswith("Permission denied")
    assert "Traceback" not in err
