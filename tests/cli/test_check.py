"""`hetero check`: one exact line per problem with file:line:col, exit 3, never a traceback."""

import shutil
from pathlib import Path

import pytest

from hetero.cli.main import main
from hetero.schema import files

EXAMPLES = Path(__file__).resolve().parents[2] / "plans"
PLAN = (EXAMPLES / "gpt-tiny-cpu.plan.yaml").read_text()


def line(needle: str) -> int:
    """Line of `needle` in the example plan: the schema grows, the messages stay pinned."""
    return next(i for i, text in enumerate(PLAN.splitlines(), 1) if needle in text)

# name -> (file content, the exact line `hetero check` prints for it)
GOLDEN = {
    "misspelt key": (
        PLAN.replace("  kind: adamw", "  knd: adamw"),
        f"error: bad.yaml:{line('  kind: adamw')}:3: unknown key 'knd' in optimizer (did you mean 'kind'?)",
    ),
    "wrong enum word": (
        PLAN.replace("  device: axdimm", "  device: axdim"),
        f"error: bad.yaml:{line('  device: axdimm')}:11: optimizer.device: 'axdim' is not one of axdimm, host or gpu (did you mean 'axdimm'?)",
    ),
    "negative size": (
        PLAN.replace("dram_budget: null", "dram_budget: -8GiB"),
        f"error: bad.yaml:{line('dram_budget: null')}:41: budget.dram_budget: negative size '-8GiB' (a size is >= 0)",
    ),
    "bad unit": (
        PLAN.replace("stay_time: 1ms", "stay_time: 1mss"),
        f"error: bad.yaml:{line('stay_time: 1ms')}:14: activations.stay_time: bad time '1mss': unknown unit 'mss' "
        "(use ns, us, ms, s, µs); did you mean '1ms'?",
    ),
    "YAML syntax error": (
        PLAN.replace("layers: []", "layers: [wte"),
        f"error: bad.yaml:{line('layers: []') + 1}:10: YAML syntax error: did not find expected ',' or ']'",
    ),
    "empty file": ("", "error: bad.yaml:1:1: empty file (expected a Profile or Plan starting with 'apiVersion: hetero/v1')"),
    "wrong apiVersion": (
        PLAN.replace("apiVersion: hetero/v1", "apiVersion: hetero/v2"),
        f"error: bad.yaml:{line('apiVersion')}:13: apiVersion: unsupported 'hetero/v2' (this hetero reads hetero/v1)",
    ),
    "binary file": (
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
        "error: bad.yaml: not a text file (byte 0x89 at offset 0); expected a YAML profile or plan",
    ),
}


@pytest.mark.parametrize("case", GOLDEN, ids=list(GOLDEN))
def test_bad_files_get_one_exact_line_and_exit_3(case, tmp_path, capsys, monkeypatch):
    content, expected = GOLDEN[case]
    monkeypatch.chdir(tmp_path)
    Path("bad.yaml").write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["check", "bad.yaml"]) == 3
    out, err = capsys.readouterr()
    assert err.splitlines() == [expected]
    assert "Traceback" not in out + err


def test_valid_files_pass(capsys):
    assert main(["check", *map(str, sorted(EXAMPLES.glob("*.yaml")))]) == 0
    out, err = capsys.readouterr()
    profile = files.load(EXAMPLES / "gpt-tiny-cpu.profile.yaml")
    assert "gpt-tiny-cpu.plan.yaml: ok (Plan, 0 GPU layers, sections: optimizer, activations)" in out
    assert (f"gpt-tiny-cpu.profile.yaml: ok (Profile, {profile.model.num_params:,} params, "
            f"{len(profile.layers)} layers)") in out
    assert err == ""


def test_every_file_is_checked_even_after_a_bad_one(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("")
    good = EXAMPLES / "gpt-tiny-cpu.plan.yaml"
    assert main(["check", str(tmp_path / "a.yaml"), str(good), str(tmp_path / "missing.yaml")]) == 3
    out, err = capsys.readouterr()
    assert "ok (Plan" in out
    assert err.splitlines()[1] == f"error: {tmp_path / 'missing.yaml'}: no such file"


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
    assert err[:3] == [f"error: {plan}:{at['c_cf']}: activations.schedule[0].layer: no layer 'h.0.mlp.c_cf' in the "
                       "profile (did you mean 'h.0.mlp.c_fc'?)",
                       f"error: {plan}:{at['wieght']}: optimizer.states[1].param: no parameter 'wpe.wieght' in the "
                       "profile (did you mean 'wpe.weight'?)",
                       f"error: {plan}:{states}: optimizer.states: no placement for 1 of the profile's parameters, "
                       "e.g. wpe.weight: hetero run needs one for every parameter"]
    (tmp_path / "gpt-tiny-cpu.profile.yaml").unlink()  # without the profile, only with the check skipped (as run)
    assert main(["check", str(plan)]) == 4
    assert main(["check", "--skip-profile-check", str(plan)]) == 0
