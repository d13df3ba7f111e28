"""Predicted against measured, on a run made from the shipped profile: exact where nothing changed, a warning
for each entry off by more than 15%, timer-noise entries shown but not checked."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetero.plan.solve import predict, predicted_of
from hetero.report.compare import compare, warnings
from hetero.schema import files
from hetero.schema.plan import ActivationPlan, Plan
from hetero.schema.profile import Profile
from hetero.schema.run import ProcessPeaks, Run, RunLayer, RunSource, RunTiming, StepEnd
from tests.conftest import REPO

PLAN = REPO / "plans/gpt-tiny-cpu.plan.yaml"


def shipped() -> tuple[Plan, Profile]:
    """The shipped plan and its profile, with compute not slowed by workers beside it: layers then take their
    profiled times in the prediction, as in `synthetic_run`."""
    plan = files.load(PLAN, expect=Plan)
    profile = files.load(REPO / plan.source.profile, expect=Profile)
    profile.machine.cpu.background_slowdown = None
    return plan, profile


def synthetic_run(plan: Plan, profile: Profile, scale: float = 1.0, iteration_s: float | None = None) -> Run:
    """A run whose layers took `scale` times their profiled time, its iteration and memory as simulated."""
    t, predicted = profile.training, predicted_of(profile, plan, predict(profile, plan))
    layers = [RunLayer(name=x.name, fp_s=x.fp_s * scale, bp_s=x.bp_s * scale, fp_end_s=x.fp_end_s * scale,
                       bp_start_s=x.bp_start_s * scale, saved_bytes=None) for x in profile.layers]
    timing = RunTiming(device="cpu", warmup_steps=1, steps_recorded=2, micro_batches=1,
                       iteration_s=iteration_s or predicted.iteration_s, forward_s=t.forward_s * scale,
                       backward_s=t.backward_s * scale, optimizer_step_s=0.004, other_s=0.002, overhead=0.001)
    return Run(source=RunSource(plan=str(PLAN), plan_sha256=files.content_sha256(plan),
                                model_fingerprint=plan.source.model_fingerprint, script="examples/train_gpt.py"),
               timing=timing, peak_bytes=dict(predicted.peak_bytes), activations=predicted.activations,
               steps=[StepEnd(step=2, at_s=0.3, resident_bytes={"dram": 1}), StepEnd(step=3, at_s=0.6,
                                                                                     resident_bytes={"dram": 1})],
               layers=layers)


def test_a_run_as_predicted_has_no_warning():
    plan, profile = shipped()
    rows = compare(synthetic_run(plan, profile), plan, profile)
    by = {r.entry: r for r in rows}
    assert by["iteration"].error == 0 and by["peak dram"].error == 0
    result = predict(profile, plan)
    fp = result.fp_end_s[3] - result.fp_start_s[3]
    assert by[f"fp {profile.layers[3].name}"].predicted == pytest.approx(fp)
    assert warnings(rows) == []


def test_each_entry_more_than_15_percent_off_gets_a_warning_and_small_ones_are_not_checked():
    plan, profile = shipped()
    run = synthetic_run(plan, profile, scale=1.3, iteration_s=predict(profile, plan).iteration_s * 1.2)
    rows = compare(run, plan, profile)
    lines = warnings(rows)
    assert lines[0].startswith("iteration: measured ") and lines[0].endswith("(+20%)")
    small = [r for r in rows if not r.checked]
    assert small and all(max(r.predicted, r.measured) < 0.01 * plan.predicted.iteration_s for r in small)
    assert len(lines) == sum(r.checked and abs(r.error) > 0.15 for r in rows if r.error is not None)
    assert not any(line.startswith(f"fp {r.entry}") for r in small for line in lines)


def test_an_edited_plan_is_compared_with_its_own_simulation_not_the_planners_prediction():
    plan, profile = shipped()
    kept = replace(plan, activations=replace(plan.activations, schedule=[
        replace(e, evict_bytes=0) for e in plan.activations.schedule]))  # tiering switched off by hand
    by = {r.entry: r for r in compare(synthetic_run(kept, profile), kept, profile)}
    assert by["iteration"].error == 0 and by["peak dram"].error == 0
    # evicting from host memory lowers the process's peak only by the store's bounce buffers (the allocator keeps
    # what evicted tensors free); evicting nothing, the store fills none: the same peak either way
    store = ActivationPlan.STORE_BYTES
    assert plan.predicted.dram_saved["evicted activations"] == plan.predicted.dram["activation store buffers"] == store
    assert by["peak dram"].predicted == plan.predicted.peak_bytes["dram"]


def test_without_the_profile_only_the_iteration_and_memory_are_compared():
    plan, profile = shipped()
    rows = compare(replace(synthetic_run(plan, profile), activations=None), plan, None)
    assert [r.entry for r in rows] == ["iteration", "peak dram", "peak nvme0"]


def test_measured_peaks_are_the_processs_own_not_the_mechanisms_count():
    plan, profile = shipped()
    counted = synthetic_run(plan, profile)
    counted.peak_bytes["dram"] = 15 << 20  # what the mechanisms hold: a small part of the process
    process = ProcessPeaks(dram_peak_bytes=plan.predicted.peak_bytes["dram"] + (40 << 20))
    by = {r.entry: r for r in compare(replace(counted, process=process), plan, profile)}
    assert by["peak dram"].measured == process.dram_peak_bytes
    assert by["peak nvme0"].measured == counted.peak_bytes["nvme0"]  # files on disk: the runtime's count
    on_gpu = ProcessPeaks(dram_peak_bytes=1, gpu_allocated_peak_bytes=900 << 20, gpu_reserved_peak_bytes=1 << 30)
    rows = {r.entry: r for r in compare(replace(counted, process=on_gpu, peak_bytes={"gpu": 5}), plan, None)}
    assert rows["peak gpu"].measured == 1 << 30 and rows["peak gpu allocated"].measured == 900 << 20
