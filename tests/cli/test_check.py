"""`hetero check`: one line per problem at file:line:col, naming what is wrong, exit 3, never a traceback."""

import shutil
from pathlib import Path

import pytest

from hetero.cli.main import main
from hetero.schema import files

EXAMPLES = Path(__file__).resolve().parents[2] / "plans"
PLAN = (EXAMPLES / "gpt-tiny-cpu.plan.yaml").read_text()


def line(needle: str) -> int:
    """Line of `needle` in the example plan: the schema grows, the locations stay pinned."""
    return next(i for i, text in enumerate(PLAN.splitlines(), 1) if needle in text)

# name -> (file content, where `hetero check` places the problem (line, column; None: the whole file), and what its
# line must name: the field, the bad value, the suggestion)
GOLDEN = {
    "misspelt key": (PLAN.replace("  kind: adamw", "  knd: adamw"), (line("  kind: adamw"), 3), ("'knd'", "'kind'")),
    "wrong enum word": (PLAN.replace("  device: axdimm", "  device: axdim"), (line("  device: axdimm"), 11),
                        ("optimizer.device", "'axdim'", "'axdimm'")),
    "negative size": (PLAN.replace("dram_budget: null", "dram_budget: -8GiB"), (line("dram_budget: null"), 41),
                      ("budget.dram_budget", "'-8GiB'")),
    "bad unit": (PLAN.replace("stay_time: 1ms", "stay_time: 1mss"), (line("stay_time: 1ms"), 14),
                 ("activations.stay_time", "'mss'", "'1ms'")),
    "YAML syntax error": (PLAN.replace("layers: []", "layers: [wte"), (line("layers: []") + 1, 10), ("YAML",)),
    "empty file": ("", (1, 1), ("apiVersion: hetero/v1",)),
    "wrong apiVersion": (PLAN.replace("apiVersion: hetero/v1", "apiVersion: hetero/v2"), (line("apiVersion"), 13),
                         ("'hetero/v2'", "hetero/v1")),
    "binary file": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", None, ("0x89",)),
}


@pytest.mark.parametrize("case", GOLDEN, ids=list(GOLDEN))
def test_bad_files_get_one_line_at_the_problem_and_exit_3(case, tmp_path, capsys, monkeypatch):
    content, at, named = GOLDEN[case]
    monkeypatch.chdir(tmp_path)
    Path("bad.yaml").write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["check", "bad.yaml"]) == 3
    out, err = capsys.readouterr()
    (said,) = err.splitlines()
    assert said.startswith(f"error: bad.yaml:{at[0]}:{at[1]}: " if at else "error: bad.yaml: "), said
    assert [x for x in named if x not in said] == [], said
    assert "Traceback" not in out + err


def test_valid_files_pass(capsys):
    assert main(["check", *map(str, sorted(EXAMPLES.glob("*.yaml")))]) == 0
    out, err = capsys.readouterr()
    profile = files.load(EXAMPLES / "gpt-tiny-cpu.profile.yaml")
    plan = files.load(EXAMPLES / "gpt-tiny-cpu.plan.yaml")
    said = {x.split(": ok ")[0]: x for x in out.splitlines()}  # a line per file, what it holds in numbers
    assert sorted(said) == [str(p) for p in sorted(EXAMPLES.glob("*.yaml"))]
    shown = said[str(EXAMPLES / "gpt-tiny-cpu.plan.yaml")]
    assert f"{len(plan.layers)} GPU layers" in shown and "optimizer, activations" in shown
    shown = said[str(EXAMPLES / "gpt-tiny-cpu.profile.yaml")]
    assert f"{profile.model.num_params:,} params" in shown and f"{len(profile.layers)} layers" in shown
    assert err == ""


def test_every_file_is_checked_even_after_a_bad_one(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("")
    good = EXAMPLES / "gpt-tiny-cpu.plan.yaml"
    assert main(["check", str(tmp_path / "a.yaml"), str(good), str(tmp_path / "missing.yaml")]) == 3
    out, err = capsys.readouterr()
    assert "ok (Plan" in out
    assert err.splitlines()[1].startswith(f"error: {tmp_path / 'missing.yaml'}: ")


def test_a_plan_is_checked_against_its_profile_when_found(tmp_path, repo, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the plan names its profile relative to the repository: found beside it here
    shutil.copy(repo / "plans" / "gpt-tiny-cpu.profile.yaml", tmp_path)
    plan = tmp_path / "gpt-tiny-cpu.plan.yaml"
    text = (repo / "plans" / "gpt-tiny-cpu.plan.yaml").read_text()
    plan.write_text(text.replace("{param: wpe.weight,", "{param: wpe.wieght,")
                    .replace("layer: h.0.mlp.c_fc,", "layer: h.0.mlp.c_cf,"))
    lines = plan.read_text().splitlines()
    assert main(["check", str(plan)]) == 3
    err = capsys.readouterr().err.splitlines()
    at = {word: next(i for i, x in enumerate(lines, 1) if word in x) for word in ("wieght", "c_cf")}
    states = files.line_of(plan, "optimizer.states")  # the list starts on the line after its key
    # each at its line, naming its field, and the name the profile has (a suggestion, or the one left unplaced)
    expected = [(at["c_cf"], "activations.schedule[0].layer", "'h.0.mlp.c_fc'"),
                (at["wieght"], "optimizer.states[1].param", "'wpe.weight'"), (states, "optimizer.states", "wpe.weight")]
    assert len(err) >= 3
    for said, (at_line, field, named) in zip(err, expected):
        assert said.startswith(f"error: {plan}:{at_line}: {field}: ") and named in said, said
    (tmp_path / "gpt-tiny-cpu.profile.yaml").unlink()  # without the profile, only with the check skipped (as run)
    assert main(["check", str(plan)]) == 4
    assert main(["check", "--skip-profile-check", str(plan)]) == 0
