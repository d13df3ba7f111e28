"""The recorder: examples/train_gpt.py under the shipped demo plan traced with `hetero run --trace`; the trace's lanes,
spans and counters against the runtime's own accounting; training unchanged by recording; the pieces it is built of."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections import defaultdict

import pytest

from hetero.cli.main import main
from hetero.run.recorder import own_segments
from hetero.schema import files
from hetero.schema.run import Run
from tests.conftest import REPO, cuda_reported_in

STEPS = 4  # 1 warm-up + 3 recorded
PLAN = "plans/gpt-tiny-cpu.plan.yaml"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """One traced run of the demo script under the demo plan, and one plain run of the same script and seed."""
    repo = REPO
    out = tmp_path_factory.mktemp("trace")
    script = [str(repo / "examples/train_gpt.py"), "--device", "cpu", "--steps", str(STEPS), "--log-every", "1"]
    with cuda_reported_in(out / "cuda.log"):  # as on a GPU machine: the example stays on the CPU it was given
        result = subprocess.run([sys.executable, "-m", "hetero", "run", "--plan", str(repo / PLAN), "--trace",
                                 str(out / "run.json"), *script], cwd=repo, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        plain = subprocess.run([sys.executable, *script], cwd=repo, capture_output=True, text=True)
    trace = json.loads((out / "run.json").read_text())
    return trace, files.load(out / "run.yaml", expect=Run), result, plain


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss ([\d.]+)", stdout)]


@pytest.mark.slow
def test_recording_changes_nothing_the_script_computes(traced):
    *_, result, plain = traced
    assert len(_losses(result.stdout)) == STEPS
    assert _losses(result.stdout) == _losses(plain.stdout)  # printed to 4 decimals: the same numbers


@pytest.mark.slow
def test_the_trace_has_a_lane_per_worker_and_no_overlap_within_a_lane(traced):
    trace, run, *_ = traced
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    # Activations' disk I/O runs on the evict and prefetch threads themselves (NvmeStore.write/read): no nvme lane.
    assert {"compute", "optimizer.step", "evict", "prefetch", "axdimm ch0 (emulated)",
            "axdimm ch1 (emulated)"} <= set(lanes.values())
    spans = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert {"name", "cat", "pid", "tid", "ts", "dur"} <= set(e) and e["dur"] >= 0
            spans[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    assert set(spans) == set(lanes)
    for tid, intervals in spans.items():
        intervals.sort()
        for (_, end), (start, _) in zip(intervals, intervals[1:]):
            assert start >= end - 1e-3, f"lane {lanes[tid]} overlaps at {start}us"
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and lanes[e["tid"]] == "compute"]
    assert "fp h.0.attn.c_attn" in names and "bp lm_head" in names
    assert trace["otherData"]["iteration_s"] == pytest.approx(run.timing.iteration_s)


@pytest.mark.slow
def test_counters_match_the_runtimes_accounting_when_each_step_ends(traced):
    trace, run, *_ = traced
    counters = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "C":
            counters[e["name"]].append((e["ts"], sum(e["args"].values())))
    assert {"memory dram", "memory nvme0"} <= set(counters)
    assert len(run.steps) == STEPS - 1
    for step in run.steps:
        for tier, resident in step.resident_bytes.items():
            at = [v for ts, v in sorted(counters[f"memory {tier}"]) if ts <= step.at_s * 1e6 + 1e-3]
            assert at[-1] == resident, (step.step, tier)
    assert run.steps[-1].resident_bytes["dram"] >= 16 * 4_240_896  # optimizer states, 16 B/param


@pytest.mark.slow
def test_run_yaml_has_every_layer_and_the_activation_measurement(traced, repo):
    _, run, *_ = traced
    profile = files.loads((repo / "plans/gpt-tiny-cpu.profile.yaml").read_text())
    assert [x.name for x in run.layers] == [x.name for x in profile.layers]
    assert all(x.saved_bytes is None for x in run.layers)  # tiering owns the saved-tensor hooks
    t = run.timing
    assert t.steps_recorded == STEPS - 1 and t.device == "cpu" and t.micro_batches == 1
    assert t.forward_s + t.backward_s + t.optimizer_step_s <= t.iteration_s * 1.01
    assert math.isfinite(t.overhead) and t.overhead >= 0  # what recording costs: bench/recorder.py
    a = run.activations
    assert 0 < a.avg_fast_bytes < a.avg_fast_untiered_bytes and a.peak_fast_bytes <= a.peak_fast_untiered_bytes
    assert run.peak_bytes["nvme0"] > 0


def test_no_trace_when_the_script_ends_before_the_window(tmp_path, capfd, repo, cuda_reported):
    trace = tmp_path / "run.json"
    code = main(["run", "--plan", str(repo / "plans/gpt-tiny-cpu.plan.yaml"), "--trace", str(trace),
                 str(repo / "examples/train_gpt.py"), "--device", "cpu", "--steps", "1", "--n-layer", "4"])
    assert code == 0
    said = [x for x in capfd.readouterr().err.splitlines() if x.startswith("hetero: no trace")]
    assert len(said) == 1, said
    assert not trace.exists()


def test_a_trace_path_that_is_not_json_is_refused(tmp_path, capfd, repo):
    assert main(["run", "--plan", str(repo / "plans/gpt-tiny-cpu.plan.yaml"), "--trace", str(tmp_path / "run.yaml"),
                 str(repo / "examples/train_gpt.py")]) == 2
    assert "hint: --trace " in capfd.readouterr().err


def test_own_segments_split_a_parent_around_its_children():
    # layer 0 runs [0, 10] with children 1 [2, 4] and 2 [6, 7]; layer 3 runs [12, 13]
    got = own_segments([(1, 2, 4), (0, 0, 10), (2, 6, 7), (3, 12, 13)])
    assert got == [(0, 0, 2), (1, 2, 4), (0, 4, 6), (2, 6, 7), (0, 7, 10), (3, 12, 13)]


def test_a_trace_whose_summary_would_overwrite_the_plan_is_refused(tmp_path, capfd, repo):
    plan = tmp_path / "plan.yaml"
    plan.write_text((repo / "plans/gpt-tiny-cpu.plan.yaml").read_text())
    before = plan.read_text()
    assert main(["run", "--plan", str(plan), "--trace", str(tmp_path / "plan.json"),
                 str(repo / "examples/train_gpt.py")]) == 2
    error, hint = capfd.readouterr().err.splitlines()[-2:]  # the file it would overwrite, and a --trace that won't
    assert error.startswith(f"error: --trace {tmp_path / 'plan.json'}") and str(plan) in error
    assert hint.startswith("hint: --trace ") and plan.read_text() == before
