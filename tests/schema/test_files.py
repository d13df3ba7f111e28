import dataclasses
import os
import random
import typing
from pathlib import Path

import pytest

from hetero.errors import FileProblems, Problem
from hetero.schema import files
from hetero.schema.fields import is_schema, specs
from hetero.schema.plan import SECTIONS, LayerPlan, Plan
from hetero.schema.profile import Profile
from tests import schema_random
from tests.figures import figures

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "plans").glob("*.yaml"))
PLAN = next(p for p in EXAMPLES if p.name.endswith(".plan.yaml"))


def line(needle: str) -> int:
    """Line of `needle` in the example plan: the schema grows, the locations stay pinned."""
    return next(i for i, text in enumerate(PLAN.read_text().splitlines(), 1) if needle in text)


def problems(text: str) -> list[Problem]:
    with pytest.raises(FileProblems) as e:
        files.loads(text, name="plan.yaml")
    assert {p.file for p in e.value.problems} == {"plan.yaml"}
    return e.value.problems


def at(found: list[Problem]) -> list[tuple[int, int, str]]:
    """Where each problem is (line, column) and the field its message starts with."""
    return [(p.line, p.column, p.message.split(": ")[0]) for p in found]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_round_trip(path):
    obj = files.load(path)
    text = files.dumps(obj)
    assert files.loads(text) == obj
    assert files.dumps(files.loads(text)) == text


@pytest.mark.parametrize("cls", [Profile, Plan])
def test_random_valid_files_round_trip(cls):
    rng = random.Random(1234)
    checked = 0
    for _ in range(400):
        obj = schema_random.instance(cls, rng)
        if cls is Plan:  # a random plan's empty sections need the reason the schema asks for
            obj.omitted = {s: "none" for s in SECTIONS if getattr(obj, s) in (None, [])}
        if not schema_random.valid(obj):
            continue
        text = files.dumps(obj)
        assert files.loads(text) == obj, text
        checked += 1
    assert checked >= 100


def test_why_comments_are_written_and_read_back():
    plan = files.load(PLAN)
    plan.layers = [LayerPlan(name="wte", mode="dha", grad="host", why="DHA fp 0.21ms < copy 3.1ms + fp 0.05ms"),
                   LayerPlan(name="h.0", mode="gfgb", grad="gpu")]
    del plan.omitted["layers"]
    text = files.dumps(plan)
    wte = next(x for x in text.splitlines() if "{name: wte," in x)  # a flow entry, its why beside it
    assert wte.startswith("  - {name: wte, mode: dha,") and wte.endswith(f"}}  # why: {plan.layers[0].why}")
    assert f"optimizer:  # why: {plan.optimizer.why[:20]}" in text
    again = files.loads(text)
    assert [layer.why for layer in again.layers] == [plan.layers[0].why, ""]
    assert again.optimizer.why == plan.optimizer.why
    assert [e.why for e in again.activations.schedule] == [e.why for e in plan.activations.schedule]


def test_content_hash_ignores_formatting_and_comments():
    text = PLAN.read_text()
    reformatted = "# a comment of the user's\n" + text.replace("# why:", "# why: edited,")
    assert files.content_sha256(files.loads(reformatted)) == files.content_sha256(files.loads(text))
    changed = text.replace("reserve: 0.5", "reserve: 0.25")
    assert files.content_sha256(files.loads(changed)) != files.content_sha256(files.loads(text))


def test_only_true_and_false_are_booleans():
    for word in ("yes", "on", "True", "1"):
        text = PLAN.read_text().replace("overlap_backward: true", f"overlap_backward: {word}")
        found = problems(text)
        assert at(found) == [(line("overlap_backward"), 21, "optimizer.overlap_backward")] and repr(word) in \
            found[0].message


def test_words_yaml_1_1_would_mangle_stay_strings(repo):
    text = PLAN.read_text().replace("fast: dram", "fast: off").replace("slow: nvme0", "slow: 1:20")
    plan = files.loads(text)
    assert (plan.activations.fast, plan.activations.slow) == ("off", "1:20")


def test_every_problem_is_reported_at_once():
    text = (PLAN.read_text().replace("reserve: 0.5", "reserve: 1.5").replace("  kind: adamw", "  kind: sgd")
            .replace("stay_time: 1ms", "stay_time: soon"))
    found = problems(text)
    assert at(found) == [(line("reserve: 0.5"), 56, "budget.reserve"), (line("  kind: adamw"), 9, "optimizer.kind"),
                         (line("stay_time: 1ms"), 14, "activations.stay_time")]
    assert [bad in p.message for p, bad in zip(found, ("1.5", "'sgd'", "'soon'"))] == [True] * 3  # each value named


def test_semantic_problems_point_at_the_value():
    text = PLAN.read_text().replace("{param: wpe.weight, tier: axdimm, channel: 1}",
                                    "{param: wpe.weight, tier: axdimm, channel: 5}")
    found = problems(text)
    assert at(found) == [(line("param: wpe.weight"), 50, "optimizer.states[1].channel")]
    assert figures(found[0].message.split(": ", 1)[1]) == ["5", "2"]  # the channel, and how many there are


def test_absent_section_needs_a_reason():
    text = PLAN.read_text().replace(
        '  routing: "the profile has one process: no gradient synchronization to route"\n', "")
    found = problems(text)
    assert at(found) == [(line("routing: null"), 10, "routing")] and "omitted" in found[0].message  # where to say why


def test_duplicate_keys_and_unsupported_tags_are_errors():
    text = PLAN.read_text().replace("layers: []", "layers: []\nlayers: []").replace(
        "reserve: 0.5", "reserve: !!python/object/apply:os.system [ls]")
    tag, duplicate = problems(text)
    assert at([tag]) == [(line("reserve: 0.5"), 56, "budget.reserve")] and "os.system" in tag.message
    assert (duplicate.line, duplicate.column) == (line("layers: []") + 1, 1) and "'layers'" in duplicate.message


def test_kind_must_match_what_the_caller_expects(tmp_path):
    with pytest.raises(FileProblems) as e:
        files.load(PLAN, expect=Profile)
    first = e.value.problems[0]
    assert (first.line, first.column) == (4, 7) and first.message.startswith("kind: ") and "Profile" in first.message


def test_save_is_atomic_and_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "plan.yaml"
    target.write_text("old")
    plan = files.load(PLAN)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError):
        files.save(plan, target)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["plan.yaml"]
    monkeypatch.undo()
    files.save(plan, target)
    assert files.load(target) == plan
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_schema_dataclasses_are_kw_only_slotted():
    seen, todo = set(), [Profile, Plan]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        assert hasattr(cls, "__slots__"), cls
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls
        for spec in specs(cls):
            for inner in _types(spec.type):
                if is_schema(inner):
                    todo.append(inner)


def _types(tp):
    yield tp
    for arg in typing.get_args(tp):
        yield from _types(arg)


def test_kind_of_reads_the_declared_kind_and_nothing_else(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("apiVersion: hetero/v1\nkind: Plan\n")
    (tmp_path / "list.yaml").write_text("- kind: Run\n")
    (tmp_path / "bad.yaml").write_text("kind: [\n")
    assert files.kind_of(plan) == "Plan"
    assert [files.kind_of(tmp_path / n) for n in ("list.yaml", "bad.yaml", "missing.yaml")] == [None, None, None]


@pytest.mark.parametrize("text", ["apiVersion: [a, b]\nkind: Plan\n", "apiVersion: hetero/v1\nkind: {a: 1}\n"])
def test_a_collection_where_the_header_wants_a_word_is_exit_3(tmp_path, text):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(FileProblems) as e:
        files.load(path)
    assert e.value.exit_code == 3 and "a collection" in e.value.message


def test_a_field_added_later_is_left_out_of_files_and_hashes_while_at_its_default():
    """plan.recompute and profile.blocks came after files were written without them: such a file keeps its hash, and
    a new file that does not use them is one the hetero before them reads."""
    from hetero.schema.plan import RecomputePlan

    plan = files.loads(PLAN.read_text())
    assert plan.recompute is None and "recompute" not in files.dumps(plan)
    before = files.content_sha256(plan)
    plan.recompute = RecomputePlan(blocks=["h.0"])
    assert "recompute:" in files.dumps(plan) and files.content_sha256(plan) != before
    assert files.loads(files.dumps(plan)).recompute.blocks == ["h.0"]


def test_host_adams_rate_beyond_the_cache_is_read_back_and_older_profiles_keep_their_hash(repo):
    """cpu.adam_beyond_cache and cpu.last_level_cache came after profiles were written without them."""
    profile = files.load(repo / "plans/gpt-tiny-cpu.profile.yaml")
    cpu = profile.machine.cpu
    assert cpu.adam_beyond_cache_params_per_s is None and cpu.last_level_cache_bytes is None
    before = files.content_sha256(profile)
    assert "beyond_cache" not in files.dumps(profile) and "last_level_cache" not in files.dumps(profile)
    profile.machine.cpu = dataclasses.replace(profile.machine.cpu, adam_beyond_cache_params_per_s=1.25e9,
                                              last_level_cache_bytes=32 * 2**20)
    text = files.dumps(profile)
    assert "adam_beyond_cache: 1.25B params/s" in text and "last_level_cache: 32MiB" in text, text
    again = files.loads(text).machine.cpu
    assert (again.adam_beyond_cache_params_per_s, again.last_level_cache_bytes) == (1.25e9, 32 * 2**20)
    assert files.content_sha256(profile) != before
