import json
from pathlib import Path

from hetero import files
from hetero.cli.main import main

EXAMPLES = Path(__file__).resolve().parents[2] / "plans"


def test_show_plan_renders_a_table_per_section(capsys):
    assert main(["show", str(EXAMPLES / "gpt-tiny-cpu.plan.yaml")]) == 0
    out = capsys.readouterr().out
    for title in ("budget", "optimizer", "optimizer.states (28)", "activations", "activations.schedule",
                  "predicted"):
        assert f"\n{title}" in out
    assert "layers: none (the profile has no GPU: DHA modes and gradient offload need a CUDA device)" in out
    assert "all states fit in 2 x 8GiB channels; round-robin" in out


def test_show_profile_renders_layers_and_tiers(capsys):
    assert main(["show", str(EXAMPLES / "gpt-tiny-cpu.profile.yaml")]) == 0
    out = capsys.readouterr().out
    assert "layers (16)" in out and "machine.tiers (2)" in out
    assert "machine.gpu: none (no CUDA device visible)" in out
    assert "h.0.attn.c_attn" in out and "peak 800MB/s (5 sizes)" in out


def test_show_json_is_the_parsed_file_in_base_units(capsys):
    path = EXAMPLES / "gpt-tiny-cpu.plan.yaml"
    assert main(["show", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == files.to_data(files.load(path))
    assert data["activations"]["stay_time_s"] == 0.001
    assert data["budget"]["dram_budget_bytes"] == 8 * 2**30
