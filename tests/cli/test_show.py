import json
from pathlib import Path

from hetero.cli.main import main
from hetero.schema import files
from hetero.units import RATE

EXAMPLES = Path(__file__).resolve().parents[2] / "plans"


def test_show_plan_renders_a_table_per_section(capsys):
    assert main(["show", str(EXAMPLES / "gpt-tiny-cpu.plan.yaml")]) == 0
    out = capsys.readouterr().out
    states = len(files.load(EXAMPLES / "gpt-tiny-cpu.plan.yaml").optimizer.states)
    for title in ("budget", "optimizer", f"optimizer.states ({states})", "activations", "activations.schedule",
                  "predicted"):
        assert f"\n{title}" in out
    plan = files.load(EXAMPLES / "gpt-tiny-cpu.plan.yaml")
    assert f"layers: none ({plan.omitted['layers']})" in out  # an absent section: the plan's reason in its place
    assert plan.optimizer.why[:60] in out.replace("\n", " ")


def test_show_profile_renders_layers_and_tiers(capsys):
    assert main(["show", str(EXAMPLES / "gpt-tiny-cpu.profile.yaml")]) == 0
    out = capsys.readouterr().out
    layers = len(files.load(EXAMPLES / "gpt-tiny-cpu.profile.yaml").layers)
    assert f"layers ({layers})" in out and "machine.tiers (2)" in out
    profile = files.load(EXAMPLES / "gpt-tiny-cpu.profile.yaml")
    assert f"machine.gpu: none ({profile.unmeasured['machine.gpu']})" in out  # a null field: the profile's reason
    nvme = files.load(EXAMPLES / "gpt-tiny-cpu.profile.yaml").machine.tiers[1]
    peak = max(p.size_bytes / p.time_s for p in nvme.read)
    assert "h.0.attn.c_attn" in out  # names never wrap
    # a transfer curve shows as its best rate (the cell may wrap inside its column at 100 columns)
    assert RATE.format_short(peak).replace("/s", "") in out


def test_show_json_is_the_parsed_file_in_base_units(capsys):
    path = EXAMPLES / "gpt-tiny-cpu.plan.yaml"
    assert main(["show", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == files.to_data(files.load(path))
    assert data["activations"]["stay_time_s"] == 0.001
    assert data["budget"]["reserve"] == 0.5 and data["budget"]["dram_budget_bytes"] is None


def test_tables_fit_100_columns(repo, capsys):
    for name in ("gpt-tiny-cpu.profile.yaml", "gpt-tiny-cpu.plan.yaml"):
        assert main(["show", str(repo / "plans" / name)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) > 20 and max(len(line) for line in lines) <= 100


def test_tables_fit_the_columns_the_environment_gives(repo, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["show", str(repo / "plans" / "gpt-tiny-cpu.plan.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 20 and max(len(line) for line in lines) <= 80
