"""Training scripts in the shape of public ones go through profile, plan and run and train as plain PyTorch does,
or are refused by `hetero profile` with one line and exit code 5 (UNSUPPORTED_SCRIPT)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetero.cli.main import main
from hetero.errors import UNSUPPORTED_SCRIPT, HeteroError
from hetero.profile.profiler import ProfileOptions, measure_script
from hetero.schema import files
from hetero.schema.profile import Profile
from tests.conftest import REPO
from tests.figures import figures
from tests.scripts import harness
from tests.scripts.harness import assert_trains_as_plain


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_nanogpt_with_groups_accumulation_clipping_and_an_ema_deepcopy(workdir):
    profile = harness.profile("nanogpt", workdir)
    t = files.load(profile, expect=Profile).training
    assert (t.optimizer, t.grad_accumulation, t.edits_grads) == ("adamw", 2, True)
    reference = harness.plain("nanogpt", workdir / "plain.pt")
    harness.plan(profile, "--optimizer-device", "host")
    code, result = harness.run("nanogpt", workdir / "plan.yaml", workdir / "planned.pt")
    assert code == 0
    assert_trains_as_plain(result, reference)
    for device in ("host", "axdimm"):  # the mechanisms for real: offloaded AdamW, every activation through disk
        code, result = harness.run("nanogpt", harness.forced(profile, optimizer=device), workdir / f"{device}.pt")
        assert code == 0
        assert_trains_as_plain(result, reference)
        for key, value in reference["ema"].items():  # the EMA copy followed the model
            torch.testing.assert_close(result["ema"][key], value)
    assert not list(workdir.glob("hetero-*"))  # nothing left in the slow tier's directory


@pytest.mark.slow
def test_multihead_attention_parameters_used_functionally_belong_to_their_layer(workdir, capfd):
    profile = harness.profile("mha_save", workdir)
    layers = {x.name: x for x in files.load(profile, expect=Profile).layers}
    attention = layers["transformer_encoder.layers.0.self_attn"]
    assert attention.param_names() == ["transformer_encoder.layers.0.self_attn.in_proj_weight",
                                       "transformer_encoder.layers.0.self_attn.out_proj.weight"]
    assert not any(name.endswith("out_proj") for name in layers)
    reference = harness.plain("mha_save", workdir / "plain.pt")
    code, result = harness.run("mha_save", harness.forced(profile, optimizer="axdimm"), workdir / "forced.pt")
    assert code == 0, capfd.readouterr().err
    assert_trains_as_plain(result, reference)
    assert result["hooks"] == 0  # torch.save(model) under hetero: the loaded model carries none of hetero's hooks


def test_a_compiled_model_trains_with_the_offloaded_optimizer_and_its_plan_says_why_not_tiering(workdir, capfd,
                                                                                                  cuda_hidden):
    profile = harness.profile("compiled", workdir)
    prof = files.load(profile, expect=Profile)
    assert len(prof.layers) == 2 and prof.training.grad_accumulation == 1  # not "0 layers"
    assert "torch.compile" in prof.unmeasured["layers"]
    assert prof.training.output_bytes == 0  # no hook on a compiled model: it would be traced into its graph
    assert "torch.compile" in capfd.readouterr().err
    planned = harness.plan(profile, "--optimizer-device", "host")
    assert planned.activations is None and "torch.compile" in planned.omitted["activations"]
    reference = harness.plain("compiled", workdir / "plain.pt")
    code, result = harness.run("compiled", harness.forced(profile, optimizer="host", tiering=False),
                               workdir / "forced.pt")
    assert code == 0
    assert_trains_as_plain(result, reference)
    assert "global hooks" not in capfd.readouterr().err  # torch's warning about hetero's own capture hooks


def test_amsgrad_stays_the_scripts_optimizer_and_a_plan_that_offloads_it_is_refused(workdir, capfd):
    profile = harness.profile("amsgrad", workdir)
    assert "amsgrad" in capfd.readouterr().err
    assert files.load(profile, expect=Profile).training.optimizer == "other"
    planned = harness.plan(profile, "--optimizer-device", "host")
    assert planned.optimizer is None and "amsgrad" in planned.omitted["optimizer"]
    reference = harness.plain("amsgrad", workdir / "plain.pt")
    code, result = harness.run("amsgrad", workdir / "plan.yaml", workdir / "planned.pt")
    assert code == 0
    assert_trains_as_plain(result, reference)
    prof = files.load(profile, expect=Profile)
    prof.training.optimizer = "adam"  # a plan made by hand that offloads it anyway
    files.save(prof, profile)
    code, _ = harness.run("amsgrad", harness.forced(profile, tiering=False), workdir / "forced.pt")
    err = capfd.readouterr().err
    assert code == UNSUPPORTED_SCRIPT and "amsgrad" in err and "Traceback" not in err  # refused, naming why


def test_a_gan_profiles_under_a_budget_though_its_first_gradient_comes_before_its_generators_first_call(workdir):
    """Under a budget hetero's profile decides where Adam's states go at the first gradient, when only the
    discriminator was called: it leaves both optimizers to torch then, rather than deciding the models too early
    (which refused the generator's optimizer at its first step)."""
    run = measure_script(harness.script("gan"), [str(workdir / "profiled.pt"), harness.STEPS],
                         ProfileOptions(steps=2, warmup=1, dram_budget_bytes=64 << 20, nvme_dir=str(workdir)))
    assert [m.name for m in run.model.models] == ["netD", "netG"]
    assert run.moved_tensors == 0 and run.memory.dram_peak_estimated


@pytest.mark.slow
def test_a_dcgan_profiles_both_models_and_trains_as_plain_with_both_adams_placed(workdir, capfd):
    profile = harness.profile("gan", workdir)
    prof = files.load(profile, expect=Profile)
    assert [m.name for m in prof.model.models] == ["netD", "netG"]  # in the order the script first calls them
    assert [(x.name, x.model) for x in prof.layers] == [
        ("netD.0", "netD"), ("netD.2", "netD"), ("netD.3", "netD"), ("netD.5", "netD"),
        ("netG.0", "netG"), ("netG.1", "netG"), ("netG.3", "netG")]
    assert all(x.fp_s > 0 and x.saved_bytes > 0 for x in prof.layers)  # each model's layers measured
    assert [(o.name, o.kind, o.model, o.kept) for o in prof.training.optimizers] == [
        ("optimizerD", "adam", "netD", None), ("optimizerG", "adam", "netG", None)]
    assert (prof.training.optimizer, prof.training.grad_accumulation) == ("adam", 3)  # 3 backward calls a step
    reference = harness.plain("gan", workdir / "plain.pt")
    planned = harness.plan(profile)
    assert [m.name for m in planned.source.models] == ["netD", "netG"]
    code, result = harness.run("gan", workdir / "plan.yaml", workdir / "planned.pt")
    assert code == 0, capfd.readouterr().err
    assert_trains_as_plain(result, reference)
    code, result = harness.run("gan", harness.forced(profile, optimizer="host"), workdir / "forced.pt")
    err = capfd.readouterr().err
    assert code == 0, err
    assert_trains_as_plain(result, reference)
    states = next(x for x in err.splitlines() if "optimizer states: " in x)
    assert figures(states)[:2] == ["36KiB", "0B"]  # both Adams: m and v for each of the 4,608 parameters (updates
    # at step(): the parameters are the master copies)
    hosted = harness.plan(profile, "--optimizer-device", "host")  # what the planner writes for two optimizers
    assert not hosted.optimizer.overlap_backward and "steps 2 optimizers" in hosted.optimizer.why


@pytest.mark.slow
def test_a_gans_plain_plan_runs_as_python_would_with_both_models_checked_and_plains_iteration(workdir):
    """The default plan of a two-model script runs plain, in a process of its own (hetero.launch.plain), which finds
    both models and checks them against the plan's."""
    profile = harness.profile("gan", workdir)
    planned = harness.plan(profile)
    prof = files.load(profile, expect=Profile)
    assert planned.runs_plain() and planned.predicted.iteration_s == prof.training.iteration_s
    reference = harness.plain("gan", workdir / "plain.pt")
    done = subprocess.run([sys.executable, "-m", "hetero", "run", "--plan", str(workdir / "plan.yaml"),
                           harness.script("gan"), str(workdir / "planned.pt"), harness.STEPS], cwd=workdir,
                          capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert_trains_as_plain(torch.load(workdir / "planned.pt", weights_only=False), reference)


def test_a_gans_adam_with_amsgrad_stays_the_scripts_while_the_other_adams_states_are_placed(workdir, capfd):
    amsgrad = ("amsgrad",)
    profile = harness.profile("gan", workdir, args=amsgrad)
    prof = files.load(profile, expect=Profile)
    [d, g] = prof.training.optimizers
    assert (d.name, d.kept, g.name) == ("optimizerD", None, "optimizerG") and "amsgrad" in g.kept
    default = harness.plan(profile)
    assert "optimizerG" in default.omitted["optimizer"] and g.kept in default.omitted["optimizer"]  # and why
    planned = harness.plan(profile, "--optimizer-device", "host")
    assert {s.param.split(".")[0] for s in planned.optimizer.states} == {"netD"}
    assert "optimizerG" in planned.optimizer.why and g.kept in planned.optimizer.why
    reference = harness.plain("gan", workdir / "plain.pt", amsgrad)
    code, result = harness.run("gan", workdir / "plan.yaml", workdir / "planned.pt", args=amsgrad)
    err = capfd.readouterr().err
    assert code == 0, err
    assert_trains_as_plain(result, reference)
    states = next(x for x in err.splitlines() if "optimizer states: " in x)
    assert figures(states)[:2] == ["17.8KiB", "0B"]  # m and v of netD's 2,272 parameters only


def test_model_option_profiles_one_of_a_gans_models_and_the_other_optimizer_stays_torchs(workdir, capfd):
    profile = harness.profile("gan", workdir, model="netD")
    prof = files.load(profile, expect=Profile)
    assert prof.model.models == [] and [x.name for x in prof.layers] == ["0", "2", "3", "5"]
    assert [o.name for o in prof.training.optimizers] == ["optimizerD"]
    reference = harness.plain("gan", workdir / "plain.pt")
    code, result = harness.run("gan", harness.forced(profile, optimizer="host"), workdir / "forced.pt")
    assert code == 0, capfd.readouterr().err
    assert_trains_as_plain(result, reference)


def test_a_frozen_teacher_and_its_student(workdir, capfd):
    profile = harness.profile("distill", workdir)
    prof = files.load(profile, expect=Profile)
    assert prof.model.models == [] and [o.name for o in prof.training.optimizers] == ["optimizer"]
    assert prof.layers[0].params == {"weight": 16 * 32 * 4, "bias": 32 * 4}  # the student's, not the teacher's
    reference = harness.plain("distill", workdir / "plain.pt")
    harness.plan(profile)
    code, result = harness.run("distill", workdir / "plan.yaml", workdir / "planned.pt")
    assert code == 0, capfd.readouterr().err
    assert_trains_as_plain(result, reference)
    code, result = harness.run("distill", harness.forced(profile, optimizer="axdimm"), workdir / "forced.pt")
    assert code == 0, capfd.readouterr().err
    assert_trains_as_plain(result, reference)


def test_a_hand_written_sgd_loop_gets_activation_tiering_and_counts_steps_from_backward(workdir, capfd):
    profile = harness.profile("manual_sgd", workdir)
    t = files.load(profile, expect=Profile).training
    assert (t.optimizer, t.steps_from, t.steps_measured, t.optimizer_step_s, t.optimizers) == \
        ("none", "backward", 2, 0.0, [])
    planned = harness.plan(profile)
    assert planned.optimizer is None and "torch.optim" in planned.omitted["optimizer"]  # there is none to replace
    reference = harness.plain("manual_sgd", workdir / "plain.pt")
    code, result = harness.run("manual_sgd", workdir / "plan.yaml", workdir / "planned.pt")
    assert code == 0, capfd.readouterr().err
    assert_trains_as_plain(result, reference)
    code, result = harness.run("manual_sgd", harness.forced(profile, optimizer=None), workdir / "forced.pt")
    err = capfd.readouterr().err
    assert code == 0, err
    assert_trains_as_plain(result, reference)
    assert "evictions to nvme0" in err and "never applied" not in err


def test_a_script_that_never_trains_is_refused_at_profile_time_with_one_line(workdir, capfd):
    (workdir / "eval.py").write_text("import torch\nmodel = torch.nn.Linear(4, 2)\n"
                                     "with torch.no_grad():\n    model(torch.randn(3, 4))\n")
    assert main(["profile", str(workdir / "eval.py")]) == UNSUPPORTED_SCRIPT
    err = capfd.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: ") and err[1].startswith("hint: ")
    assert len(err) == 2 and not (workdir / "profile.yaml").exists()


def test_an_optimizer_stepping_after_a_hand_written_update_is_refused(workdir):
    (workdir / "late.py").write_text(
        "import torch\nmodel = torch.nn.Linear(4, 2)\n"
        "for step in range(6):\n"
        "    model(torch.randn(3, 4)).sum().backward()\n"
        "    if step == 1:\n        opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    if step >= 1:\n        opt.step()\n")
    with pytest.raises(HeteroError) as e:
        measure_script(str(workdir / "late.py"), [], ProfileOptions(steps=2, warmup=1))
    # the optimizer and how many values it steps, and what to do instead
    assert e.value.exit_code == UNSUPPORTED_SCRIPT and "SGD" in e.value.message and figures(e.value.message) == ["10"]
    assert e.value.hint is not None


def test_a_plan_for_another_model_is_not_called_stale(workdir, capfd, cuda_hidden):
    """The plan's relative profile path is the plan's directory's, not the current directory's."""
    (workdir / "a").mkdir()
    harness.profile("compiled", workdir / "a")
    plan = harness.plan(Path("a/profile.yaml"))  # relative to the current directory, as a user types it
    assert plan.source.profile == "profile.yaml"
    (workdir / "profile.yaml").write_text((harness.REPO / "plans/gpt-tiny-cpu.profile.yaml").read_text())
    code, _ = harness.run("mha_save", workdir / "a/plan.yaml", workdir / "out.pt")
    err = capfd.readouterr().err
    assert code == 4 and plan.source.model_fingerprint[:19] in err and "changed" not in err  # another model
