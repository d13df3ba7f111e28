"""`hetero plan` and `hetero show --timeline` from the command line."""

import json
import re
import shutil
from pathlib import Path

from hetero.cli.main import main
from hetero.plan.solve import predict
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from hetero.units import TIME

REPO = Path(__file__).resolve().parents[2]
PROFILE = "tests/plan/fixtures/handworked.profile.yaml"
MECHANISMS = ["--emulate", "axdimm", "--tier-activations"]  # without a GPU the default plan runs plain


def test_plan_writes_a_plan_that_check_accepts_and_show_renders(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--profile", PROFILE, "-o", str(out), *MECHANISMS]) == 0
    summary = capsys.readouterr().out
    profiled = files.load(PROFILE, expect=Profile).training.iteration_s
    assert f"wrote {out}" in summary and f"({TIME.format_short(profiled)} profiled)" in summary
    assert "peak nvme0" in summary
    text = out.read_text()
    plan = files.load(out, expect=Plan)
    header = text.splitlines()[0]  # the file says where it came from
    assert header.startswith("# ") and PROFILE in header and "examples/train_gpt.py" in header
    assert f"optimizer:  # why: {plan.optimizer.why[:40]}" in text  # a section's why beside its key
    assert main(["check", str(out)]) == 0
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    schedule = len(files.load(out, expect=Plan).activations.schedule)
    assert "predicted" in shown and f"activations.schedule ({schedule})" in shown


def test_plan_json_is_the_written_plan(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--profile", PROFILE, "-o", str(out), "--json", "--stay-time", "2ms", *MECHANISMS]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == files.to_data(files.load(out))
    assert data["activations"]["stay_time_s"] == 0.002


def test_bad_flags_exit_2_with_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = str(tmp_path / "plan.yaml")
    assert main(["plan", "--profile", PROFILE, "-o", out, "--slow-tier", "nvme9"]) == 2
    error, hint = capsys.readouterr().err.splitlines()
    assert error.startswith("error: --slow-tier nvme9") and hint.startswith("hint: ")
    assert hint.split(": ")[-1].split(", ") == ["dram", "nvme0"]  # the tiers it could have named
    assert main(["plan", "--profile", PROFILE, "-o", out, "--gpu-memory", "20GB2"]) == 2
    assert "unknown unit 'GB2'" in capsys.readouterr().err
    assert main(["plan", "--profile", "missing.yaml", "-o", out]) == 3
    assert not Path(out).exists()


def test_from_keeps_pinned_entries(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    old = tmp_path / "old.yaml"
    assert main(["plan", "--profile", PROFILE, "-o", str(old), *MECHANISMS]) == 0
    edited = files.load(old, expect=Plan)
    first = next(e for e in edited.activations.schedule if e.evict_bytes)
    first.evict_bytes, first.pinned = 100 * 1024, True  # the user's edit
    files.save(edited, old)
    new = tmp_path / "new.yaml"
    assert main(["plan", "--profile", PROFILE, "-o", str(new), "--from", str(old)]) == 0
    kept = next(e for e in files.load(new, expect=Plan).activations.schedule if e.layer == first.layer)
    assert (kept.evict_bytes, kept.pinned) == (100 * 1024, True)


def test_show_timeline_writes_a_trace(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "predicted.json"
    assert main(["show", "--timeline", "plans/gpt-tiny-cpu.plan.yaml", "-o", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: ")
    trace = json.loads(out.read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"compute", "evict", "prefetch", "axdimm ch0", "axdimm ch1"} <= lanes
    plan = files.load("plans/gpt-tiny-cpu.plan.yaml")
    assert abs(trace["otherData"]["predicted_iteration_s"] - plan.predicted.iteration_s) < 1e-9
    assert trace["otherData"]["iteration_s"] == predict(files.load(plan.source.profile), plan).iteration_s


def test_show_timeline_needs_the_plans_profile(tmp_path, monkeypatch, capsys):
    shutil.copy(REPO / "plans/gpt-tiny-cpu.plan.yaml", tmp_path / "plan.yaml")
    monkeypatch.chdir(tmp_path)
    assert main(["show", "--timeline", "plan.yaml"]) == 1
    error, hint = capsys.readouterr().err.splitlines()
    assert error.startswith("error: ") and "plans/gpt-tiny-cpu.profile.yaml" in error and hint.startswith("hint: ")
    (tmp_path / "plans").mkdir()
    example = "plans/gpt-tiny-cpu.profile.yaml"
    profile = re.sub(r"  warmup_steps: \d+", "  warmup_steps: 99", (REPO / example).read_text())
    (tmp_path / example).write_text(profile)
    assert main(["show", "--timeline", "plan.yaml"]) == 4  # STALE_PLAN: the profile changed since
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["show", "plan.yaml", "-o", "x.json"]) == 2


def test_a_gpu_plan_from_the_command_line(tmp_path, monkeypatch, capsys):
    from tests.plan.synthetic import gpu_profile

    monkeypatch.chdir(tmp_path)
    files.save(gpu_profile(6, seed=2), "profile.yaml")
    assert main(["plan", "--gpu-memory", "1GiB", "--reserve", "0.3", "--optimizer-device", "host"]) == 0
    assert "write gradients to host" in capsys.readouterr().out
    plan = files.load("plan.yaml", expect=Plan)
    assert (len(plan.layers), plan.budget.gpu_memory_bytes, plan.budget.reserve) == (6, 2**30, 0.3)
    assert all("# why: " in line for line in Path("plan.yaml").read_text().splitlines() if "{name: layer" in line)
    assert main(["check", "plan.yaml"]) == 0 and main(["show", "plan.yaml"]) == 0
    assert "layers (6)" in capsys.readouterr().out
    assert main(["show", "--timeline", "plan.yaml"]) == 0
    lanes = {e["args"]["name"] for e in json.loads(Path("predicted.json").read_text())["traceEvents"] if e["ph"] == "M"}
    assert {"compute", "h2d", "d2h", "host adam"} <= lanes
    assert main(["plan", "--help"]) == 0 and "Example: hetero plan" in capsys.readouterr().out


def test_the_summary_fits_columns_when_piped_and_a_plan_says_why_next_to_each_absent_section(tmp_path, monkeypatch,
                                                                                              capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "plan.yaml"
    for columns, widest in (("70", 70), ("", 120)):  # unset: a sane width, not the 160 of before
        monkeypatch.setenv("COLUMNS", columns)
        assert main(["plan", "--profile", PROFILE, "-o", str(out)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert max(len(line) for line in lines) <= widest and any(len(line) > 60 for line in lines)
    plan = files.load(out, expect=Plan)
    text = out.read_text()
    for section in ("optimizer", "activations"):  # the default plan without a GPU runs plain
        assert getattr(plan, section) is None
        assert f"\n{section}: null  # why: {plan.omitted[section][:40]}" in text


def test_a_forced_mechanism_that_applies_to_nothing_says_why_in_one_line(tmp_path, monkeypatch, capsys):
    """--tier-activations where no saved storage is worth a transfer, --optimizer-device host where the script's
    optimizer cannot be offloaded: the plan is written (exit 0) and stderr names each flag once, on one line."""
    import dataclasses

    from hetero.schema.profile import Profile

    monkeypatch.chdir(tmp_path)
    profile = files.load(REPO / PROFILE, expect=Profile)
    small = [dataclasses.replace(x, saved_bytes=min(x.saved_bytes, 3 << 10), saved_storages_bytes=[])
             for x in profile.layers]
    training = dataclasses.replace(profile.training, optimizer="other")
    files.save(dataclasses.replace(profile, layers=small, training=training), "profile.yaml")
    assert main(["plan", "--tier-activations", "--optimizer-device", "host"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert sum("--tier-activations" in line for line in err) == 1 and sum("--optimizer-device" in line for line in err) == 1
    assert main(["plan", "--tier-activations"]) == 0
    assert len(capsys.readouterr().err.splitlines()) == 1
    files.save(profile, "profile.yaml")  # as measured: tiering applies, nothing is said
    assert main(["plan", "--tier-activations"]) == 0
    assert capsys.readouterr().err == ""
