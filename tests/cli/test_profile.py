"""`hetero profile` end to end: the example script into a profile `hetero check` accepts."""

import dataclasses
import json
import math
import os
import re

import pytest
import torch
from torch.nn.utils import clip_grad

from hetero.cli.main import main
from hetero.plan import axdimm
from hetero.profile import conservative, machine, phases
from hetero.run import process_memory
from hetero.run.devices import workdir
from hetero.schema import files
from hetero.schema.profile import Profile
from hetero.units import COUNT, SIZE
from tests.conftest import SMALL_GPT
from tests.profile import scripts

ADAMW, CLIP = torch.optim.AdamW, clip_grad.clip_grad_norm_


def positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_profile_of_the_example_is_valid(profiled, capsys):
    code, out, nvme = profiled
    assert code == 0
    assert main(["check", str(out / "profile.yaml")]) == 0
    profile = files.load(out / "profile.yaml", expect=Profile)
    assert [layer.name for layer in profile.layers][:4] == ["wte", "wpe", "h.0.ln_1", "h.0.attn.c_attn"]
    assert profile.machine.gpu is None and profile.unmeasured["machine.gpu"] == "no CUDA device in use"
    assert [t.kind for t in profile.machine.tiers] == ["dram", "nvme"]
    nvme_tier = profile.machine.tiers[1]
    assert nvme_tier.path == str(nvme) and all(p.time_s > 0 for p in nvme_tier.read + nvme_tier.write)
    # measured, not judged: how fast this machine is belongs in bench/ (docs/benchmarks.md)
    assert positive(profile.machine.cpu.dram_bandwidth_bytes_per_s)
    axdimm = profile.machine.axdimm
    assert axdimm.backend == "emulated" and axdimm.channels == 2 and positive(axdimm.adam_params_per_s)
    assert math.isfinite(axdimm.launch_s) and axdimm.launch_s >= 0  # a line's intercept through two sizes, clamped
    assert 100 * 2**20 < profile.memory.dram_peak_bytes <= process_memory.dram_peak_bytes()  # torch alone is more
    assert profile.memory.gpu_allocated_peak_bytes is None
    assert math.isfinite(profile.training.overhead) and profile.training.overhead >= 0
    # the steps after the others, freed memory returned: what the plan's `allocator` would cost and save
    assert not profile.memory.dram_peak_estimated and profile.memory.profiled_under is None
    assert 100 * 2**20 < profile.memory.dram_peak_returned_bytes and profile.memory.returned_step_s > 0
    assert profile.memory.default_step_s > 0
    assert profile.machine.memory_limit_bytes == process_memory.memory_limit_bytes()
    summary = (out / "summary.txt").read_text()  # plain's peak: the number a user needs to choose --dram-budget
    row = next(x for x in summary.splitlines() if "plain peak" in x)
    assert SIZE.format_short(profile.memory.dram_peak_bytes) in row


def test_a_budget_is_profiled_under_with_freed_memory_returned_and_says_so(tmp_path, cuda_reported, bundled_machine):
    out = tmp_path / "profile.yaml"
    assert main(["profile", "--steps", "1", "--warmup", "1", "--nvme", str(tmp_path / "disk"), "--dram-budget",
                 "20GiB", "-o", str(out), *SMALL_GPT]) == 0
    memory = files.load(out, expect=Profile).memory
    assert memory.dram_peak_estimated and memory.dram_peak_returned_bytes == memory.dram_peak_bytes
    assert memory.profiled_under.endswith("--dram-budget 20GiB") and "NVMe" not in memory.profiled_under
    assert memory.returned_step_s is None and memory.default_step_s is None  # not run a second time: no room


def test_the_disk_probe_leaves_nothing_behind(profiled):
    _, _, nvme = profiled
    assert not nvme.exists() or os.listdir(nvme) == []


def test_json_goes_to_stdout_and_the_scripts_output_to_stderr(tmp_path, capfd, bundled_machine, monkeypatch):
    path = scripts.write(tmp_path, scripts.LOOP)
    assert main(["profile", "--json", "--steps", "1", "--warmup", "1", "-o", str(tmp_path / "p.yaml"), path]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["layers"][0]["name"] == "body.0"
    assert "finished" not in out
    # no terminal: each phase said as it starts and ends
    assert f"{phases.WARMUP} 1/1" in err and f"{phases.MEASURED} 0/1" not in err and f"{phases.MEASURED} 1/1" in err


def test_a_crashing_script_exits_1_with_its_own_traceback(tmp_path, capfd):
    path = scripts.write(tmp_path, """
        model = Net(); opt = torch.optim.AdamW(model.parameters())
        def train_step():
            raise RuntimeError("CUDA out of patience")
        train_step()
    """)
    assert main(["profile", "-o", str(tmp_path / "p.yaml"), path]) == 1
    out, err = capfd.readouterr()
    assert f'File "{path}", line' in err and "in train_step" in err
    assert "hetero/" not in err.split("RuntimeError")[0]
    last = err.splitlines()[-1]
    assert last.startswith("error: ") and re.findall(r"\d+", last) == ["1", "0"]  # its exit code, after 0 steps
    assert not (tmp_path / "p.yaml").exists()


def test_arguments_after_the_script_reach_it_untouched(tmp_path, capfd):
    path = scripts.write(tmp_path, "print('ARGV', sys.argv[1:]); raise SystemExit(5)\n")
    assert main(["profile", path, "--steps", "9", "--help", "-o", "x"]) == 5
    assert "ARGV ['--steps', '9', '--help', '-o', 'x']" in capfd.readouterr().out


@pytest.mark.parametrize("nvme", ["", "file/sub"])
def test_a_disk_directory_that_cannot_be_used_is_refused_before_the_script_runs(tmp_path, capfd, nvme):
    (tmp_path / "file").write_text("")
    script = scripts.write(tmp_path, "print('the script ran')\n")
    path = str(tmp_path / nvme) if nvme else nvme
    assert main(["profile", "--nvme", path, script]) == 2
    out, err = capfd.readouterr()
    assert "the script ran" not in out and err.startswith("error: --nvme: ") and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["file", "train.py"]


def test_a_budget_plain_training_would_exceed_is_profiled_with_the_optimizer_on_nvme(tmp_path, cuda_reported,
                                                                                   bundled_machine):
    out = tmp_path / "profile.yaml"
    assert main(["profile", "--steps", "1", "--warmup", "1", "--nvme", str(tmp_path / "disk"), "--dram-budget",
                 "64MiB", "-o", str(out), *SMALL_GPT]) == 0
    profile = files.load(out, expect=Profile)
    memory, n = profile.memory, profile.model.num_params
    assert profile.training.optimizer == "adamw"  # the script's, though hetero's stood in for it while profiling
    assert memory.dram_peak_estimated and memory.dram_peak_returned_bytes == memory.dram_peak_bytes
    assert f"{COUNT.format_short(n)} parameters on NVMe" in memory.profiled_under  # all of them moved
    measured = SIZE.parse(memory.profiled_under.rsplit("the peak measured that way: ", 1)[1].split(";")[0])
    # plain's estimate: the measured peak, less the staging the moved optimizer held, plus plain's 12 B/param
    held = memory.dram_peak_bytes - measured - conservative.PLAIN_BYTES_PER_PARAM * n
    rounded = measured * 0.005  # the text's three digits: a whole suite's process peaks past 1 GiB (3 MiB steps)
    assert -20 * 2**20 - rounded < held < rounded
    assert not (tmp_path / "disk").exists() or not list((tmp_path / "disk").rglob("*.bin"))
    # its steps updated states on NVMe: plain's step is timed at the host Adam rate the machine phase measured (at
    # the model's size: beyond the last-level cache where its states exceed it), one launch per parameter tensor
    # (recovering the count from the file's 4-digit figures fails where the launch measures near 0, as on a loaded
    # machine: the formula is checked forward instead)
    cpu, step = profile.machine.cpu, profile.training.optimizer_step_s
    tensors = sum(len(layer.params) for layer in profile.layers)
    assert tensors == 28  # 2 blocks of 12, wte, wpe, ln_f's 2; lm_head's weight is wte's
    assert math.isclose(step, tensors * cpu.adam_launch_s + n / axdimm.host_rate(cpu, n), rel_tol=1e-3)
    assert profile.training.iteration_s >= step
    # restored
    assert torch.nn.utils.clip_grad_norm_ is CLIP and clip_grad.clip_grad_norm_ is CLIP and torch.optim.AdamW is ADAMW


def test_an_earlier_profiles_machine_is_taken_instead_of_measured(profiled, tmp_path, monkeypatch):
    _, out, _ = profiled
    earlier = files.load(out / "profile.yaml", expect=Profile)
    assert earlier.machine.host == workdir.host()  # recorded by every profile that measures the machine
    monkeypatch.setattr(machine, "measure", lambda *a, **kw: pytest.fail("the machine was measured again"))
    profile = tmp_path / "profile.yaml"  # under a budget: no fresh processes time plain training (seconds here)
    assert main(["profile", "--steps", "1", "--warmup", "1", "--dram-budget", "20GiB", "--machine",
                 str(out / "profile.yaml"), "--nvme", str(tmp_path / "disk"), "-o", str(profile), *SMALL_GPT]) == 0
    again = files.load(profile, expect=Profile)
    assert again.machine.cpu == earlier.machine.cpu and again.machine.axdimm.adam_params_per_s == \
        earlier.machine.axdimm.adam_params_per_s and again.machine.host == earlier.machine.host
    assert again.machine.tiers[1].path == str(tmp_path / "disk")
    assert again.model.fingerprint == earlier.model.fingerprint and main(["check", str(profile)]) == 0


def test_a_memory_limit_that_binds_nothing_is_profiled_as_without_one_and_in_process_never_forks(
        profiled, tmp_path, monkeypatch):
    """A container's limit near the machine's memory (a GPU machine's 123 GiB) leaves plain training's peak measured,
    not estimated; `main()` called from Python (here, pytest) is not hetero's own process, so
    the memory guard must not turn the caller into its waiter."""
    from hetero.launch import guard

    _, out, _ = profiled
    monkeypatch.setattr(process_memory, "memory_limit_bytes", lambda *a, **kw: 20 << 30)
    monkeypatch.setattr(guard, "fork", lambda *a, **kw: pytest.fail("hetero profile forked its caller"))
    profile = tmp_path / "profile.yaml"
    assert main(["profile", "--steps", "1", "--warmup", "1", "--machine", str(out / "profile.yaml"), "--nvme",
                 str(tmp_path / "disk"), "-o", str(profile), *SMALL_GPT]) == 0
    memory = files.load(profile, expect=Profile).memory
    assert not memory.dram_peak_estimated and memory.profiled_under is None
    assert memory.dram_peak_returned_bytes is not None  # the steps with freed memory returned ran too
    assert process_memory.memory_limit_bytes() == 20 << 30  # the plan still keeps the limit (hetero.plan.context)


def test_a_machine_of_another_host_is_refused_before_the_script_runs(profiled, tmp_path, capfd):
    _, out, _ = profiled
    earlier = files.load(out / "profile.yaml", expect=Profile)
    other = tmp_path / "other.yaml"
    files.save(dataclasses.replace(earlier, machine=dataclasses.replace(earlier.machine, host="0badcafe")), other)
    script = scripts.write(tmp_path, "print('the script ran')\n")
    assert main(["profile", "--machine", str(other), script]) == 2
    out_, err = capfd.readouterr()
    assert "the script ran" not in out_ and "Traceback" not in err
    assert err.startswith(f"error: --machine {other}") and "0badcafe" in err and workdir.host() in err
