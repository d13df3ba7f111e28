"""GPU plans start from plain training as the profile measured it (hetero.plan.gpu_fit, hetero.plan.gpu_peak,
hetero.plan.plain): plain where it fits, a mechanism only where the budget needs it or it is faster, predictions
anchored on the measured reserved peak and step."""

import dataclasses

import pytest

from hetero.errors import USAGE, HeteroError
from hetero.plan import backward, gpu_fit, gpu_peak
from hetero.plan.model import GPU
from hetero.plan.policy import POLICY
from hetero.plan.sections import plain_of
from hetero.plan.solve import PlanOptions, plan, predict, predicted_of
from hetero.schema import files
from hetero.schema.profile import Memory, Profile, ScriptOptimizer
from hetero.units import SIZE, TIME, short_time
from tests.figures import figures
from tests.plan.synthetic import GiB, MiB, gpu_profile

STEP = 0.05  # plain training's measured step, s


def measured(profile: Profile, overhead: float = 1.1) -> Profile:
    """`profile` as if `hetero profile` had timed plain's step and read torch's peaks: the reserved peak is the
    count of plain training (hetero.plan.gpu_peak) plus `overhead` for what it does not count."""
    counted = gpu_peak.phases(profile, gpu_peak.PLAIN).peak_bytes
    reserved = int(counted * overhead)
    return dataclasses.replace(
        profile, memory=Memory(dram_peak_bytes=4 * GiB, gpu_allocated_peak_bytes=counted,
                               gpu_reserved_peak_bytes=reserved),
        training=dataclasses.replace(profile.training, plain_iteration_s=STEP))


@pytest.fixture
def profile() -> Profile:
    return measured(gpu_profile(12, seed=3))


def test_a_training_that_fits_is_planned_plain_and_predicted_as_measured(profile):
    p = plan(profile, PlanOptions())
    assert (p.layers, p.optimizer, p.activations) == ([], None, None)
    assert {"layers", "optimizer", "activations"} <= set(p.omitted)
    assert p.predicted.iteration_s == STEP
    assert p.predicted.peak_bytes[GPU] == profile.memory.gpu_reserved_peak_bytes
    assert sum(p.predicted.gpu.values()) - sum(p.predicted.gpu_saved.values()) == p.predicted.peak_bytes[GPU]
    assert p.predicted.gpu[gpu_peak.SLACK] == gpu_peak.slack_bytes(profile) > 0  # what the count leaves out
    assert SIZE.format_short(profile.memory.gpu_reserved_peak_bytes) in p.budget.why and "fits" in p.budget.why
    assert files.loads(files.dumps(p)) == p


def test_a_gpu_budget_plain_training_exceeds_moves_what_it_must_and_keeps_under_it(profile):
    reserved = profile.memory.gpu_reserved_peak_bytes
    budget = reserved // 2
    p = plan(profile, PlanOptions(gpu_memory_bytes=budget))
    assert p.optimizer is not None and p.optimizer.device == "host"
    peak = p.predicted.peak_bytes[GPU]
    assert peak <= budget * (1 - POLICY.gpu_headroom)
    assert sum(p.predicted.gpu.values()) - sum(p.predicted.gpu_saved.values()) == peak
    assert p.predicted.gpu[gpu_peak.SLACK] == gpu_peak.slack_bytes(profile)  # plain's, added once
    assert gpu_peak.STATES not in p.predicted.gpu  # Adam's states left the GPU with its updates
    assert p.predicted.iteration_s >= STEP / (1 + gpu_fit.TIE)  # plain is the default plan: none is clearly faster
    assert "exceeds it" in p.budget.why


def test_no_default_plan_predicts_a_slower_iteration_than_plain_training():
    for seed in range(5):
        for profile in (gpu_profile(8, seed=seed), measured(gpu_profile(8, seed=seed))):
            p = plan(profile, PlanOptions())
            bare = predict(profile, plain_of(p)).iteration_s
            reference = STEP if profile.memory is not None else bare
            assert p.predicted.iteration_s <= reference + 1e-9  # the plan's times are to the ns


def test_a_budget_below_any_plan_is_refused_naming_the_least_need_which_then_plans(profile):
    with pytest.raises(HeteroError) as refused:
        plan(profile, PlanOptions(gpu_memory_bytes=64 * MiB))
    assert refused.value.exit_code == USAGE and SIZE.format_short(64 * MiB, 4) in refused.value.message
    need = refused.value.hint.split("--gpu-memory ")[1].split()[0]

    p = plan(profile, PlanOptions(gpu_memory_bytes=SIZE.parse(need)))
    assert p.predicted.peak_bytes[GPU] <= SIZE.parse(need)


@pytest.mark.parametrize("saved_per_layer", [0, 64 * MiB])
def test_gradients_moved_to_host_save_at_the_plans_peak_only_what_coexists_with_the_saved_activations(
        profile, saved_per_layer):
    """With Adam off the GPU, a plan's GPU peak is backward's start where activations outweigh gradients (no gradient
    exists then: moving them saves nothing there), and its end or the step where gradients do (moving them saves
    them all)."""
    profile = dataclasses.replace(profile, layers=[dataclasses.replace(x, saved_bytes=saved_per_layer)
                                                   for x in profile.layers])
    kept = plan(profile, PlanOptions(optimizer_device="host", reserve=1.0))
    kept.layers = [dataclasses.replace(e, grad="gpu") for e in kept.layers]
    kept.activations = None
    moved_all = dataclasses.replace(kept, layers=[dataclasses.replace(e, grad="host") for e in kept.layers])
    held, gone = (predicted_of(profile, p, predict(profile, p)).peak_bytes[GPU] for p in (kept, moved_all))
    moved = sum(x.params_bytes for x in profile.layers)
    largest = max(x.params_bytes for x in profile.layers)
    saved = held - gone
    if saved_per_layer:  # each layer's saved activations outweigh any layer's gradients
        assert largest < saved_per_layer and saved <= largest
    else:
        assert saved == moved


def test_the_reserve_moves_gradients_only_when_the_budget_needs_it(profile):
    total = sum(x.params_bytes for x in profile.layers)
    roomy = plan(profile, PlanOptions(optimizer_device="host", reserve=0.2))
    keep_all = plan(profile, PlanOptions(optimizer_device="host", reserve=1.0))
    assert [x.grad for x in roomy.layers] == [x.grad for x in keep_all.layers], "gradients that fit stay put"
    kept_all = sum(x.params_bytes for x, e in zip(profile.layers, keep_all.layers) if e.grad == "gpu")
    assert kept_all > 0.9 * total  # only those whose host write is faster leave
    tight_budget = keep_all.predicted.peak_bytes[GPU] - total
    moved = []
    for r in (0.0, 0.3, 0.6):
        p = plan(profile, PlanOptions(optimizer_device="host", reserve=r, gpu_memory_bytes=tight_budget))
        kept = sum(x.params_bytes for x, e in zip(profile.layers, p.layers) if e.grad == "gpu")
        assert p.predicted.peak_bytes[GPU] <= tight_budget
        assert kept == kept_all or kept <= r * total  # the faster of: all kept (and DHA), or the reserve's share
        moved.append(kept < kept_all)
    assert any(moved)


def test_forced_options_are_honoured_and_what_is_left_out_says_why():
    base = gpu_profile(12, seed=3)
    for x in base.layers:  # activations outweigh the step's gradients and scratch: evicting them lowers the peak
        x.saved_bytes *= 8
    profile = measured(base)
    tiered = plan(profile, PlanOptions(tier_activations=True))
    assert tiered.activations is not None and tiered.optimizer is None
    assert tiered.predicted.peak_bytes[GPU] < profile.memory.gpu_reserved_peak_bytes
    offloaded = plan(profile, PlanOptions(optimizer_device="host"))
    assert offloaded.optimizer.device == "host" and "activations" in offloaded.omitted
    # what evicting would predict, against this plan's own peak and iteration: no faster, and not needed to fit
    would = figures(offloaded.omitted["activations"])
    assert would[2:] == [SIZE.format_short(offloaded.predicted.peak_bytes[GPU]),
                         short_time(offloaded.predicted.iteration_s)]
    assert TIME.parse(would[1]) >= TIME.parse(would[3])
    budget = profile.memory.gpu_reserved_peak_bytes * 19 // 20
    kept = plan(profile, PlanOptions(optimizer_device="none", gpu_memory_bytes=budget))
    assert kept.optimizer is None and kept.activations is not None  # the only lever left that saves GPU memory


def test_the_runtimes_host_work_is_counted_where_the_profile_measured_it(profile):
    forced = PlanOptions(tier_activations=True)
    before = plan(profile, forced).predicted.iteration_s
    m = profile.machine
    costly = dataclasses.replace(profile, machine=dataclasses.replace(
        m, cpu=dataclasses.replace(m.cpu, hook_pair_s=1e-4, saved_tensor_s=2e-4),
        gpu=dataclasses.replace(m.gpu, event_s=1e-5)))
    after = plan(costly, forced).predicted.iteration_s
    layers = len(profile.layers)  # each layer's boundary hooks, at least; and every saved storage's trip
    assert after >= before + layers * 1e-4 - 1e-9
    assert plan(costly, PlanOptions()).predicted.iteration_s == STEP  # plain training runs none of it


def test_on_a_gpu_every_prefetch_is_keyed_to_backward_progress_not_the_clock(profile):
    """The thread issuing a GPU's work runs ahead of it: a clock would bring every evicted tensor back at once."""
    tiered = plan(profile, PlanOptions(tier_activations=True))
    moved = [e for e in tiered.activations.schedule if e.evict_bytes]
    assert moved and all(e.prefetch_after is not None for e in moved)
    starts = {x.name: x.bp_start_s for x in profile.layers}
    assert all(starts[e.prefetch_after] <= max(e.prefetch_at_s, min(starts.values())) for e in moved)


@pytest.mark.parametrize("implementation", ["foreach", "fused", "single"])
def test_the_scripts_adam_step_scratch_leaves_the_gpu_with_its_optimizer_whatever_torch_steps_it_by(implementation):
    """Plain training's count holds the step's scratch of the script's Adam (foreach: the size of every parameter;
    one tensor at a time: two of the largest; fused: none) where the step is the peak, and so does its measured
    peak: a plan that moves the optimizer off the GPU predicts the same peak whichever the script used."""
    def stepped_by(how: str) -> Profile:
        base = gpu_profile(12, seed=3)
        for x in base.layers:  # the step, not backward, is plain's peak
            x.saved_bytes //= 1000
        base.training.optimizers = [ScriptOptimizer(name="opt", kind="adamw", model="Net", num_params=base.model.num_params,
                                                    implementation=how)]
        return base

    params = [b for x in stepped_by(implementation).layers for b in x.params.values()]
    scratch = {"foreach": sum(params), "fused": 0, "single": 2 * max(params)}[implementation]
    assert backward.step_scratch_bytes(implementation, params) == scratch
    fused, profile = measured(stepped_by("fused")), measured(stepped_by(implementation))
    added = gpu_peak.phases(profile, gpu_peak.PLAIN).peak_bytes - gpu_peak.phases(fused, gpu_peak.PLAIN).peak_bytes
    assert 0 < scratch - added < scratch // 100 if scratch else added == 0  # its backward's peak held a little more
    profile.memory.gpu_reserved_peak_bytes = fused.memory.gpu_reserved_peak_bytes + added  # torch reserved it too
    plain = plan(profile, PlanOptions())
    assert plain.predicted.gpu.get(gpu_peak.SCRATCH, 0) == scratch
    assert plain.predicted.peak_bytes[GPU] == profile.memory.gpu_reserved_peak_bytes
    offloaded = plan(profile, PlanOptions(optimizer_device="host"))
    assert gpu_peak.SCRATCH not in offloaded.predicted.gpu
    assert offloaded.predicted.peak_bytes[GPU] == plan(fused, PlanOptions(optimizer_device="host")
                                                        ).predicted.peak_bytes[GPU]
