"""Training scripts in the shape of public ones go through profile, plan and run and train as plain PyTorch does,
or are refused by `hetero profile` with one line and exit code 5 (UNSUPPORTED_SCRIPT)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hetero.cli.main import main
from hetero.errors import UNSUPPORTED_SCRIPT, HeteroError
from hetero.profile.profiler import ProfileOptions, measure_script
from hetero.schema import files
from hetero.schema.profile import Profile
from tests.run.plans import optimizer_plan
from tests.scripts import harness
from tests.scripts.harness import assert_trains_as_plain

pytestmark = pytest.mark.usefixtures("without_malloc_runs")  # no budget here: plans never use what those runs measure


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_nanogpt_with_groups_accumulation_clipping_and_an_ema_deepcopy(workdir):
    profile = harness.profile("nanogpt", workdir)
    t = files.load(profile, expect=Profile).training
    assert (t.optimizer, t.grad_accumulation, t.clips_grad) == ("adamw", 2, True)
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
    assert code == UNSUPPORTED_SCRIPT and "amsgrad=True is not supported" in err and "Traceback" not in err


@pytest.mark.parametrize("name, message", [
    ("manual_sgd", "the script ended without calling step() of a torch.optim optimizer"),
    ("gan", "the script steps a second optimizer (Adam over 816 values) besides the Adam of its model Sequential "
            "(577 values)"),
])
def test_scripts_hetero_cannot_carry_out_are_refused_at_profile_time(workdir, name, message):
    with pytest.raises(HeteroError) as e:
        measure_script(harness.script(name), [str(workdir / "out.pt"), harness.STEPS],
                       ProfileOptions(steps=2, warmup=1))
    assert e.value.exit_code == UNSUPPORTED_SCRIPT and e.value.message.startswith(message)
    assert "\n" not in e.value.message and e.value.hint


def test_cli_profile_exits_5_with_one_error_line(workdir, capfd):
    assert main(["profile", harness.script("manual_sgd"), str(workdir / "out.pt")]) == UNSUPPORTED_SCRIPT
    err = capfd.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: the script ended without calling step()") and err[1].startswith("hint: ")
    assert len(err) == 2 and not (workdir / "profile.yaml").exists()


def test_a_second_models_optimizer_stays_torchs_own_under_a_plan_for_the_first(workdir):
    """The GAN under a hand-made plan for its discriminator: D's Adam is offloaded, G's stays torch's."""
    netD = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    files.save(optimizer_plan(netD, device="host", overlap=False), workdir / "plan.yaml")
    (workdir / "profile.yaml").write_text("")  # the hand-made plan names no real profile
    reference = harness.plain("gan", workdir / "plain.pt")
    code, result = harness.run("gan", workdir / "plan.yaml", workdir / "hetero.pt", "--allow-stale",
                               "--skip-profile-check")
    assert code == 0
    assert_trains_as_plain(result, reference)


def test_a_plan_for_another_model_is_not_called_stale(workdir, capfd, cuda_hidden):
    """The plan's relative profile path is the plan's directory's, not the current directory's."""
    (workdir / "a").mkdir()
    harness.profile("compiled", workdir / "a")
    plan = harness.plan(Path("a/profile.yaml"))  # relative to the current directory, as a user types it
    assert plan.source.profile == "profile.yaml"
    (workdir / "profile.yaml").write_text((harness.REPO / "plans/gpt-tiny-cpu.profile.yaml").read_text())
    code, _ = harness.run("mha_save", workdir / "a/plan.yaml", workdir / "out.pt")
    err = capfd.readouterr().err
    assert code == 4 and "is not the one the plan was made for" in err and "changed" not in err


def test_hugging_face_trainer(workdir):
    pytest.importorskip("transformers")
    profile = harness.profile("hf_trainer", workdir)
    reference = harness.plain("hf_trainer", workdir / "plain.pt")
    code, result = harness.run("hf_trainer", harness.forced(profile, optimizer="host"), workdir / "forced.pt")
    assert code == 0
    assert_trains_as_plain(result, reference)
