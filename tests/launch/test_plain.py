"""A plan that moves nothing runs the script in hetero's place (hetero.launch.plain): nothing of hetero's command
line stays in the process, the planned model is still checked, and exit codes pass through."""

import dataclasses
import os
import subprocess
import sys

import pytest

from hetero.schema import files
from hetero.schema.plan import Budget, LayerPlan, OptimizerPlan
from tests.cli.test_run import TRAIN, net
from tests.conftest import REPO
from tests.profile import scripts
from tests.run.plans import optimizer_plan

# what the script sees of its process: hetero's command line and runtime must be gone
SEEN = "print('LOADED', sorted(m for m in ('typer', 'rich', 'yaml', 'hetero.cli.main', 'hetero.run.runtime') " \
       "if m in sys.modules)); print('PID', os.getpid())\n"


def plain_plan(model=None):
    p = optimizer_plan(model or net())
    return dataclasses.replace(p, optimizer=None, omitted=p.omitted | {"optimizer": "test"})


def hetero(workdir, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetero", *args], cwd=workdir, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture
def workdir(tmp_path):
    files.save(plain_plan(), tmp_path / "plan.yaml")
    return tmp_path


def test_a_plain_plan_runs_the_script_in_heteros_place(workdir):
    script = scripts.write(workdir, "import os\n" + TRAIN + SEEN)
    done = hetero(workdir, "run", "--skip-profile-check", script, "2")
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout and "done torch.optim.adamw" in done.stdout
    said = [x for x in done.stderr.splitlines() if x.startswith("hetero: plain training")]  # said as plain
    assert len(said) == 1 and "dram peak" in said[0], done.stderr


@pytest.mark.slow
def test_the_planned_model_is_still_checked_and_exit_codes_pass_through(workdir):
    other = scripts.write(workdir, TRAIN.replace("model = Net()", "model = Net(width=48)"))
    refused = hetero(workdir, "run", "--skip-profile-check", other)
    planned = files.load(workdir / "plan.yaml").source.model_fingerprint
    assert refused.returncode == 4 and planned[:19] in refused.stderr  # names the model the plan was made for
    assert hetero(workdir, "run", "--skip-profile-check", "--allow-stale", other, "1").returncode == 0
    exits = scripts.write(workdir, "sys.exit(3)\n", "exits.py")
    assert hetero(workdir, "run", "--skip-profile-check", exits).returncode == 3


@pytest.mark.parametrize("change", [
    {"optimizer": OptimizerPlan(kind="adamw", device="host", overlap_backward=False)},
    {"layers": [LayerPlan(name="head", mode="dha", grad="gpu")]},
    {"budget": Budget(gpu_memory_bytes=None, dram_budget_bytes=2**30, reserve=1.0)},
])
def test_a_plan_that_moves_something_is_not_plain(change):
    assert plain_plan().runs_plain()
    assert not dataclasses.replace(plain_plan(), **change).runs_plain()


def test_gfgb_layers_with_gpu_gradients_and_an_optimizer_on_the_gpu_move_nothing():
    gpu = OptimizerPlan(kind="adamw", device="gpu", overlap_backward=False)
    kept = dataclasses.replace(plain_plan(), optimizer=gpu, layers=[LayerPlan(name="head", mode="gfgb", grad="gpu")])
    assert kept.runs_plain()
    from hetero.run.runtime import mechanisms

    assert mechanisms(kept) == []  # the runtime agrees: nothing to carry out
