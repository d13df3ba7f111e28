"""Hostile and oversized files: every one is exit 0 or 3 with file:line, never a traceback, a crash or a blow-up.

The named cases come from what was seen (deep nesting crashed the parser, an alias bomb expanded to ~20 GB while
hashing, a 50 MB scalar was echoed whole, 1e309 and 1e999999MiB gave tracebacks); the fuzzer mutates the shipped
plan and profile 2,000 times, seeded, in this process.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import resource
from pathlib import Path

import pytest
import yaml

from hetero.cli.main import main
from hetero.errors import FileProblems
from hetero.schema import files, yaml_read

PLANS = sorted((Path(__file__).resolve().parents[2] / "plans").glob("*.yaml"))


def check(path: Path) -> tuple[int, str]:
    """`hetero check` of the file alone: a plan's profile is not beside it here."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["check", "--skip-profile-check", str(path)])
    return code, err.getvalue()


def refused(tmp_path: Path, text: str) -> str:
    """The one problem `hetero check` reports for `text`, after asserting exit 3."""
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    code, err = check(path)
    assert code == 3 and "Traceback" not in err, err
    return err.splitlines()[0]


PLAN_TEXT = PLANS[0].read_text() if PLANS else ""


def _flow(levels: int) -> str:
    return " " + "[" * levels + "]" * levels


def _block(levels: int) -> str:
    return "\n" + "".join(f"{' ' * i}b{i}:\n" for i in range(1, levels)) + " " * levels + "1"


@pytest.mark.parametrize("deep", [_flow(33), _block(33), _block(200), _flow(50_000)],
                         ids=["flow-33", "block-33", "block-200", "flow-50000"])
def test_deep_nesting_is_refused_before_the_parser_sees_it(tmp_path, monkeypatch, deep):
    # hetero's own bound (MAX_DEPTH) speaks first, unless the scanner it guards with stops first (PyYAML 6.0.4 ends
    # flow nesting at 1,000 levels): either way exit 3 at a line of the file, and the parser, which recurses, never
    # runs
    monkeypatch.setattr(yaml, "compose_all", lambda *a, **k: pytest.fail("the parser saw the file"))
    line = refused(tmp_path, "apiVersion: hetero/v1\nkind: Plan\nx:" + deep)
    assert re.match(rf"error: {re.escape(str(tmp_path / 'plan.yaml'))}:\d+:\d+: ", line), line
    if len(deep) < 100_000:  # below any bound of the scanner's
        assert f" {yaml_read.MAX_DEPTH} " in line  # the bound it passed


@pytest.mark.parametrize("loader", {getattr(yaml, "CSafeLoader", yaml.SafeLoader), yaml.SafeLoader},
                         ids=lambda c: c.__name__)
def test_the_scanner_reads_any_nesting_flat(loader):
    """The guard's contract with PyYAML (its range pinned in pyproject.toml): `yaml.scan` keeps no call per level,
    so it tokenizes any depth or stops at a marked error, and never recurses (2,000 levels: past Python's recursion
    limit; the pure-Python scanner takes time quadratic in the depth)."""
    for deep in (_flow(2_000), _block(300)):
        with contextlib.suppress(yaml.MarkedYAMLError):
            depth = 0
            for token in yaml.scan("x:" + deep, Loader=loader):
                depth += isinstance(token, (yaml.FlowSequenceStartToken, yaml.BlockMappingStartToken))
            assert depth >= 300


def test_anchors_and_aliases_are_refused_before_anything_expands_them(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    line = refused(tmp_path, "apiVersion: hetero/v1\nkind: Plan\n" + bomb)
    assert line.startswith("error: ") and ":3:4: " in line and "'a'" in line  # at the first anchor, named


def test_a_huge_file_is_refused_unread_and_a_huge_value_is_not_echoed(tmp_path):
    assert "larger than 16 MiB" in refused(tmp_path, "a: " + "x" * (17 << 20))
    for old in ("kind: Plan", "kind: adam"):
        line = refused(tmp_path, PLAN_TEXT.replace(old, old.split()[0] + " " + "k" * (50 << 20 >> 4), 1))
        assert len(line) < 300 and "kkk..." in line, line


@pytest.mark.parametrize("value, said", [
    ("1e309", "out of range"), ("-1e309", "out of range"), ("9" * 5000, "out of range"),
    ("1e999999MiB", "out of range"), ("1e99999B", "out of range"), (".1e99999999999999999999s", "out of range"),
])
def test_every_out_of_range_number_is_exit_3_at_its_line(tmp_path, value, said):
    key = "stay_time" if value.endswith("s") else "min_tensor" if "B" in value else "reserve"
    line_no = next(i for i, x in enumerate(PLAN_TEXT.splitlines(), 1) if f"{key}: " in x)
    text = re.sub(rf"\b{key}: [^,}}\n]+", f"{key}: {value}", PLAN_TEXT, count=1)
    line = refused(tmp_path, text)
    assert f"plan.yaml:{line_no}:" in line and said in line and "set_int_max_str_digits" not in line
    assert len(line) < 300


@pytest.mark.parametrize("shipped", PLANS, ids=lambda p: p.name)
@pytest.mark.parametrize("channels", ["400", "1e11", "1000000"])
def test_counts_have_sane_bounds_checked_at_load(tmp_path, shipped, channels):
    line = refused(tmp_path, shipped.read_text().replace("channels: 2", f"channels: {channels}", 1))
    assert "channels" in line and ("out of range" in line or "whole number" in line), line


# -- the fuzzer ---------------------------------------------------------------------------------------------------

HOSTILE = ["1e309", "-1e309", "1e999999MiB", "1e99999B", "9" * 5000, "-" + "9" * 50, "nan", ".inf", "0x1f",
           "1e-999999s", "&a x", "*a", "!!python/object/apply:os.system [ls]", "[" * 100, "{", "'", '"\\x00"',
           "~", "yes", "- - - - x", "x" * 5000, "2:30", "1.5 MiB", "NaNB", "99999999999999999999999 params/s"]


def mutate(text: str, rng: random.Random) -> str:
    lines = text.splitlines()
    i = rng.randrange(len(lines))
    kind = rng.randrange(8)
    if kind == 0:  # truncated anywhere
        return text[: rng.randrange(len(text))]
    if kind == 1:  # a value replaced by a hostile one
        key, sep, _ = lines[i].partition(": ")
        lines[i] = f"{key}{sep or ': '}{rng.choice(HOSTILE)}"
    elif kind == 2:  # deep nesting
        lines.insert(i, "x: " + "[" * rng.randrange(20, 3000))
    elif kind == 3:  # aliases
        lines[i] = lines[i] + " &anchor" if rng.random() < 0.5 else lines[i].replace(": ", ": *anchor ", 1)
    elif kind == 4:  # an unknown or repeated key, indented like its neighbour
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        lines.insert(i, indent + rng.choice(["unknwn_key: 1", lines[i].strip(), "why: x", "pinned: maybe"]))
    elif kind == 5:  # a line lost or doubled
        lines.insert(i, lines[i]) if rng.random() < 0.5 else lines.pop(i)
    elif kind == 6:  # a number scaled to the edge
        lines[i] = "".join(c if not c.isdigit() or rng.random() < 0.7 else rng.choice("09") for c in lines[i])
        lines[i] = lines[i].replace("e", "e9999", 1) if rng.random() < 0.3 else lines[i]
    else:  # a byte flipped
        pos = rng.randrange(len(lines[i]) + 1)
        lines[i] = lines[i][:pos] + rng.choice("\t:{}[]&*!|>%@`'\"#,-?\x7f\u00e9") + lines[i][pos + 1:]
    return "\n".join(lines) + "\n"


def trimmed(text: str, keep: int = 2) -> str:
    """`text` with each block list cut to its first `keep` entries (one line each, as hetero writes them): every key
    and shape of the file stays, at a third of the parsing time, so 2,000 cases take seconds."""
    out, run = [], {}
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        run = {i: n for i, n in run.items() if i <= indent}
        if line.lstrip().startswith("- "):
            run[indent] = run.get(indent, 0) + 1
            if run[indent] > keep:
                continue
        out.append(line)
    return "\n".join(out) + "\n"


def load_or_problems(text: str, name: str) -> int:
    """What `hetero check` does with `text`, in this process: 0 (loaded, and showable and hashable) or 3."""
    try:
        obj = files.loads(text, name=name)
    except FileProblems as e:
        assert all(len(str(p)) < 1000 for p in e.problems)
        return 3
    json.dumps(files.to_data(obj), allow_nan=False)  # `show --json`: finite, bounded
    files.content_sha256(obj)
    return 0


@pytest.mark.parametrize("shipped", PLANS, ids=lambda p: p.name)
def test_mutated_shipped_files_are_exit_0_or_3_never_a_traceback(tmp_path, shipped, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the plan's profile is not found: `check` validates the file alone, as loads does
    rng = random.Random(f"hetero-{shipped.name}")
    text, path = trimmed(shipped.read_text()), tmp_path / shipped.name
    # the model of a profile cut to two layers holds what they hold at least: one parameter, say
    text = re.sub(r"^  num_params: .*$", "  num_params: 1", text, count=1, flags=re.MULTILINE)
    assert load_or_problems(text, shipped.name) == 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    codes = {0: 0, 3: 0}
    for case in range(1000):
        mutated = mutate(text, rng)
        code = load_or_problems(mutated, shipped.name)  # any other exception fails the test with its traceback
        codes[code] += 1
        if case % 25 == 0:  # and through the command itself
            path.write_text(mutated)
            cli_code, err = check(path)
            assert cli_code == code and "Traceback" not in err, err
    assert codes[0] > 50 and codes[3] > 400, codes  # the mutations reach both sides
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200 * 1024  # KiB: nothing expanded


def test_a_profile_with_more_layers_than_the_bound_is_refused(tmp_path, monkeypatch):
    from hetero.schema import profile as schema

    profile = next(p for p in PLANS if p.name.endswith(".profile.yaml"))
    monkeypatch.setattr(schema, "MAX_LAYERS", 3)  # the shipped profile has more; the real bound is 20,000
    line = refused(tmp_path, profile.read_text())
    assert "layers: " in line and " entries, at most 3" in line, line
