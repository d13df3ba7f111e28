"""`hetero report`: the table and warnings, the PNG, and clear errors for what is missing."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from hetero.cli.main import main
from hetero.schema import files
from tests.report.test_compare import shipped, synthetic_run


def write_run(tmp_path, slower: float = 1.0, layers_slower: float = 1.0):
    plan, profile = shipped()
    run = synthetic_run(plan, profile, scale=layers_slower, iteration_s=plan.predicted.iteration_s * slower)
    trace = {"traceEvents": [{"name": "memory dram", "ph": "C", "pid": 1, "ts": t * 1e6, "args": {"params": b}}
                             for t, b in ((0.1, 1 << 20), (0.35, 3 << 20), (0.5, 2 << 20))]}
    (tmp_path / "run.json").write_text(json.dumps(trace))
    run = replace(run, source=replace(run.source, trace=str(tmp_path / "run.json")))
    files.save(run, tmp_path / "run.yaml")
    return tmp_path / "run.yaml"


def test_prints_predicted_against_measured_with_warnings(tmp_path, capfd):
    assert main(["report", str(write_run(tmp_path, slower=1.25))]) == 0
    out = capfd.readouterr().out
    assert "iteration" in out and "+25%" in out and "bp h.1.attn.c_attn" in out and "short layers, summed" in out
    warned = [x for x in out.splitlines() if x.startswith("warning: ")]
    assert len(warned) == 1 and warned[0].startswith("warning: iteration") and "+25%" in warned[0], out
    assert "fp h.0.ln_1 " not in out  # under 1% of the iteration: summed into one row


def test_draws_memory_per_tier_as_png(tmp_path, capfd):
    png = tmp_path / "memory.png"
    assert main(["report", str(write_run(tmp_path)), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in capfd.readouterr().out


def test_without_matplotlib_says_how_to_install_it(tmp_path, capfd, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert main(["report", str(write_run(tmp_path)), "--png", str(tmp_path / "m.png")]) == 2
    error, hint = capfd.readouterr().err.splitlines()
    assert error.startswith("error: --png") and hint.startswith("hint: ") and "pip install matplotlib" in hint


def test_a_missing_plan_or_another_models_plan_is_refused(tmp_path, capfd, repo):
    run = write_run(tmp_path)
    assert main(["report", str(run), "--plan", str(tmp_path / "nope.yaml")]) == 2
    assert "hint: pass --plan PLAN" in capfd.readouterr().err
    other = files.load(repo / "plans/gpt-tiny-cpu.plan.yaml")
    other = replace(other, source=replace(other.source, model_fingerprint="sha256:" + "0" * 64))
    files.save(other, tmp_path / "other.yaml")
    assert main(["report", str(run), "--plan", str(tmp_path / "other.yaml")]) == 2
    error, hint = capfd.readouterr().err.splitlines()
    assert error.startswith(f"error: {tmp_path / 'other.yaml'}") and "--plan" in hint


def test_a_plan_file_is_not_a_run(capfd, repo):
    assert main(["report", str(repo / "plans/gpt-tiny-cpu.plan.yaml")]) == 3
    err = capfd.readouterr().err
    assert "plan.yaml:4:7: kind: " in err and "Run" in err  # at the kind's value, naming the kind expected


def test_leads_with_iteration_and_peak_groups_layer_warnings_and_says_how_to_replan(tmp_path, capfd):
    run = write_run(tmp_path, slower=1.25, layers_slower=1.3)
    assert main(["report", str(run)]) == 0
    out = capfd.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("iteration: ") and "measured" in lines[0] and "(+25%)" in lines[0]
    assert lines[1].startswith("peak dram: ")
    assert not any(line.startswith(("warning: fp ", "warning: bp ")) for line in lines)  # folded into one line
    assert sum("layer times: " in line for line in lines) == 1
    hint = out[out.index("hint: "):].replace("\n", "")
    assert f"hetero plan --from-run {run}" in hint  # the command to plan again with what this run measured
    assert max(len(line) for line in lines) <= 100
