"""A DRAM budget without a GPU: the planner ranks the combinations of levers that lower host memory by their
predicted peak and iteration, takes the fastest that fits, says what each choice saved, and refuses a budget
nothing meets, naming the floor. What `hetero plan` measured of a candidate in fresh processes (a trial) replaces
its prediction: a trial that does not fit passes the planner on to the next candidate, one slower than predicted
is ranked by its measured step, and a plan a trial verified predicts what the trial measured."""

import re
from dataclasses import replace

import pytest

from hetero.errors import USAGE, HeteroError
from hetero.plan import backward, fit, footprint, in_backward
from hetero.plan.in_backward import grads_freed_in_backward
from hetero.plan.policy import POLICY
from hetero.plan.solve import PlanOptions, plan
from hetero.schema import files
from hetero.schema.plan import AllocatorPlan, Trial
from hetero.schema.profile import Memory, Profile
from hetero.units import SIZE, short_time
from tests.figures import figures

MiB = 2**20
PLAIN, RETURNED = 900 * MiB, 700 * MiB
STAGING = 2 * 3 * 4 * 2**18 + 3 * MiB  # two slots of master, m and v of 256K elements; the store's buffers


@pytest.fixture
def cpu(repo) -> Profile:
    profile = files.load(repo / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile)
    profile.memory = Memory(dram_peak_bytes=PLAIN, dram_peak_returned_bytes=RETURNED,
                            returned_step_s=profile.training.iteration_s * 1.25,
                            default_step_s=profile.training.iteration_s)
    return profile


def simulated(profile: Profile) -> Profile:
    """Plain training's peak estimated and freed memory not measured: no allocator lever."""
    profile.memory.dram_peak_estimated, profile.memory.dram_peak_returned_bytes = True, None
    return profile


def own_states(profile: Profile) -> int:
    return footprint.ADAM_STATE_BYTES_PER_PARAM * sum(x.num_params for x in profile.layers)


def peak(p) -> int:
    return p.predicted.peak_bytes["dram"]


def saving(why: str, lever: str) -> list[str] | None:
    """What a budget's `why` says `lever` saves and costs an iteration, in figures, found by the planner's own name
    for it (the wording around may change); None where it says no saving of it."""
    said = re.search(re.escape(fit.LEVER_NAMES[lever]) + r" saves (\S+) for (\S+)", why)
    return [said[1], said[2]] if said else None


def refused(why: str, lever: str) -> str | None:
    """The reason a budget's `why` gives for leaving `lever` out; None where it gives none."""
    said = re.search(r"; not " + re.escape(fit.LEVER_NAMES[lever]) + r": ([^;]*)", why)
    return said[1] if said else None


def trial(p, peaks: list[int], step_s: float, stopped: int = 0, mapped: int = 4 * MiB,
          system_s: float | None = None) -> Trial:
    """What `hetero plan` would have measured of plan `p` in fresh processes."""
    return Trial(levers=sorted(fit.levers_of(None, p)), blocks=len(p.recompute.blocks) if p.recompute else None,
                 predicted_bytes=peak(p), peaks_bytes=peaks, stopped=stopped, stop_bytes=p.budget.dram_budget_bytes or 0,
                 mapped_bytes=mapped, step_s=step_s, step_range_s=0.0,
                 mmap_threshold_bytes=p.allocator.mmap_threshold_bytes if p.allocator else None, system_s=system_s)


def test_the_peak_is_the_sum_of_the_plans_own_account(cpu):
    p = plan(cpu, PlanOptions(dram_budget_bytes=RETURNED + 10 * MiB))
    assert peak(p) == sum(p.predicted.dram.values()) - sum(p.predicted.dram_saved.values())


def test_a_budget_plain_training_fits_moves_nothing_and_says_it_is_predicted(cpu):
    p = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN))
    assert (p.allocator, p.optimizer, p.activations) == (None, None, None)
    assert peak(p) == PLAIN and "predicted: not measured" in p.budget.why and p.budget.trials == []
    below = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN - 1))
    assert fit.levers_of(cpu, below) and peak(below) < PLAIN


def test_returning_freed_memory_is_turned_on_when_it_is_what_fits_and_its_cost_counts(cpu):
    budget = 800 * MiB  # only freed memory returned reaches it: the states alone save 23MiB
    p = plan(cpu, PlanOptions(dram_budget_bytes=budget))
    assert p.allocator is not None and peak(p) <= budget and p.allocator.from_bytes is None
    # what returning memory costs a step, as the profile measured it, is in the prediction
    assert saving(p.budget.why, "allocator") == ["200MiB", short_time(0.25 * cpu.training.iteration_s)]
    assert "--dram-budget" in p.budget.why


def test_below_that_the_planner_adds_what_it_needs_and_each_choice_says_what_it_saved(cpu):
    budget = RETURNED - 10 * MiB
    p = plan(cpu, PlanOptions(dram_budget_bytes=budget))
    assert peak(p) <= budget and p.allocator is not None
    assert p.optimizer is not None or p.activations is not None
    for lever, section in (("states", p.optimizer), ("tiering", p.activations)):
        assert (saving(p.budget.why, lever) is not None) == (section is not None)


def test_optimizer_states_go_to_nvme_when_only_they_fit(cpu):
    simulated(cpu)  # no allocator to turn on: the states are the one lever that saves
    p = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN - own_states(cpu) + STAGING))
    assert p.optimizer.device == "host" and {s.tier for s in p.optimizer.states} == {"nvme"}
    assert p.optimizer.overlap_backward is False and p.activations is None
    assert peak(p) == PLAIN - own_states(cpu) + STAGING
    assert p.predicted.dram_saved == {footprint.STATES: own_states(cpu)}


def test_gradients_follow_the_states_to_nvme_when_only_both_fit(cpu):
    simulated(cpu)
    grads = 4 * sum(x.num_params for x in cpu.layers)
    staging = STAGING + 2 * 4 * 2**18  # each slot also reads a gradient piece back
    p = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN - own_states(cpu) - grads + staging))
    assert p.optimizer.nvme.grads and {s.tier for s in p.optimizer.states} == {"nvme"}
    assert peak(p) == PLAIN - own_states(cpu) - grads + staging
    # each saving on its own line, none counted twice: the states' line is without the gradients' saving
    assert saving(p.budget.why, "states")[0] == SIZE.format_short(own_states(cpu) - STAGING)
    assert saving(p.budget.why, "grads")[0] == SIZE.format_short(grads - 2 * 4 * 2**18)
    states_only = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN - own_states(cpu) + STAGING))
    assert not states_only.optimizer.nvme.grads  # the faster lever where it is enough
    assert p.predicted.iteration_s > states_only.predicted.iteration_s  # the gradients' trip is in the prediction
    cpu.training.edits_grads = True  # the script changes them after backward: they stay in memory
    kept = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN - own_states(cpu) + STAGING))
    assert not kept.optimizer.nvme.grads and refused(kept.budget.why, "grads")


def test_a_budget_nothing_meets_is_refused_naming_the_floor(cpu):
    with pytest.raises(HeteroError) as e:
        plan(cpu, PlanOptions(dram_budget_bytes=100 * MiB))
    assert e.value.exit_code == USAGE and "\n" not in e.value.message
    least = SIZE.parse(e.value.message.split("the least any plan needs is ")[1].split(" ")[0])
    assert least > 100 * MiB and SIZE.format_short(RETURNED) in e.value.message  # what the floor is made of
    assert SIZE.parse(e.value.hint.split("raise --dram-budget to ")[1].split(" ")[0]) >= least


def test_the_memory_cgroup_is_the_default_budget_and_an_option_above_it_is_refused(cpu):
    cpu.machine.memory_limit_bytes = 800 * MiB
    p = plan(cpu, PlanOptions())
    assert p.budget.dram_budget_bytes == 800 * MiB and "cgroup" in p.budget.why  # where the budget came from
    assert p.allocator is not None
    with pytest.raises(HeteroError) as e:
        plan(cpu, PlanOptions(dram_budget_bytes=900 * MiB))
    assert e.value.exit_code == USAGE and figures(e.value.message) == ["900MiB", "800MiB"]
    assert "--dram-budget 800MiB" in e.value.hint


def test_returning_memory_costs_what_the_profile_measured_beside_its_own_steps(cpu):
    assert fit.allocator_cost_s(cpu) == pytest.approx(0.25 * cpu.training.iteration_s)
    cpu.memory.default_step_s = 1.2 * cpu.training.iteration_s
    assert fit.allocator_cost_s(cpu) == pytest.approx(0.05 * cpu.training.iteration_s)
    cpu.memory.default_step_s = None  # older profiles: against the profile's own iteration
    assert fit.allocator_cost_s(cpu) == pytest.approx(0.25 * cpu.training.iteration_s)


def test_a_trial_that_fits_is_the_plan_and_its_prediction_is_what_it_measured(cpu):
    options = PlanOptions(dram_budget_bytes=PLAIN + 100 * MiB)
    first = plan(cpu, options)
    assert fit.levers_of(cpu, first) == frozenset() and fit.wants_trial(cpu, options, first, [])
    measured = trial(first, [PLAIN + 10 * MiB, PLAIN + 30 * MiB, PLAIN], step_s=0.5)
    p = plan(cpu, replace(options, trials=(measured,)))
    assert p.budget.trials == [measured] and not fit.wants_trial(cpu, options, p, [measured])
    held = PLAIN + 30 * MiB + 30 * MiB + 4 * MiB  # the highest, the spread above it, the file pages beside
    assert POLICY.held_bytes(measured) == held and peak(p) == held and p.predicted.iteration_s == 0.5
    assert p.predicted.dram[fit.TRIED] == held - PLAIN
    assert "3 fresh processes" in p.budget.why and SIZE.format_short(PLAIN + 30 * MiB) in p.budget.why  # peaks


@pytest.mark.parametrize("how", ["stopped", "spread", "mapped"])
def test_a_trial_that_does_not_fit_passes_the_planner_on_to_the_next_candidate(cpu, how):
    options = PlanOptions(dram_budget_bytes=PLAIN + 20 * MiB)
    first = plan(cpu, options)
    assert first.allocator is None  # plain training fits by prediction
    found = {"stopped": trial(first, [PLAIN], 0.5, stopped=2),
             "spread": trial(first, [PLAIN - 10 * MiB, PLAIN + 10 * MiB, PLAIN], 0.5),
             "mapped": trial(first, [PLAIN, PLAIN, PLAIN], 0.5, mapped=21 * MiB)}[how]
    second = plan(cpu, replace(options, trials=(found,)))
    assert fit.levers_of(cpu, second) and peak(second) < PLAIN and fit.wants_trial(cpu, options, second, [found])


def test_a_trial_slower_than_predicted_is_ranked_by_its_measured_step(cpu):
    options = PlanOptions(dram_budget_bytes=RETURNED - 10 * MiB)
    first = plan(cpu, options)
    slow = trial(first, [RETURNED - 40 * MiB] * 3, step_s=10 * first.predicted.iteration_s, mapped=0)
    second = plan(cpu, replace(options, trials=(slow,)))
    assert fit.levers_of(cpu, second) != fit.levers_of(cpu, first)
    assert second.predicted.iteration_s < slow.step_s


def rung_of(p) -> int | None:
    return p.allocator.mmap_threshold_bytes if p.allocator is not None else None


@pytest.mark.parametrize("rung_fits", [True, False])
def test_a_trial_paying_page_faults_has_higher_rungs_tried_and_the_fastest_kept(cpu, rung_fits):
    options = PlanOptions(dram_budget_bytes=RETURNED + 40 * MiB, measuring=True)
    first = plan(cpu, options)
    assert rung_of(first) == AllocatorPlan.RUNGS[0]
    faulting = trial(first, [RETURNED] * 3, step_s=1.0, mapped=0, system_s=0.3)
    second = plan(cpu, replace(options, trials=(faulting,)))
    assert rung_of(second) == AllocatorPlan.RUNGS[1] and fit.wants_trial(cpu, options, second, [faulting])
    assert fit.levers_of(cpu, second) == fit.levers_of(cpu, first)
    tried = replace(trial(second, [RETURNED + 20 * MiB] * 3, step_s=0.8, mapped=0, system_s=0.05,
                          stopped=0 if rung_fits else 3), step_range_s=0.1)
    third = plan(cpu, replace(options, trials=(faulting, tried)))
    if rung_fits:  # faster: the next rung is tried in turn
        assert rung_of(third) == AllocatorPlan.RUNGS[2] and fit.wants_trial(cpu, options, third, [faulting, tried])
        slower = trial(third, [RETURNED + 30 * MiB] * 3, step_s=0.9, mapped=0, system_s=0.01)
        third = plan(cpu, replace(options, trials=(faulting, tried, slower)))
        assert rung_of(third) == AllocatorPlan.RUNGS[1] and third.predicted.iteration_s == 0.8
        assert not fit.wants_trial(cpu, options, third, [faulting, tried, slower])
    else:
        assert rung_of(third) == AllocatorPlan.RUNGS[0] and third.predicted.iteration_s == 1.0
        assert not fit.wants_trial(cpu, options, third, [faulting, tried])  # a verified plan: written


def test_no_kernel_time_measured_keeps_the_first_rung(cpu):
    options = PlanOptions(dram_budget_bytes=RETURNED + 40 * MiB, measuring=True)
    first = plan(cpu, options)
    quiet = trial(first, [RETURNED] * 3, step_s=1.0, mapped=0, system_s=None)
    second = plan(cpu, replace(options, trials=(quiet,)))
    assert rung_of(second) == AllocatorPlan.RUNGS[0] and not fit.wants_trial(cpu, options, second, [quiet])


def test_after_the_last_trial_only_tried_candidates_are_chosen_and_the_floor_says_what_was_measured(cpu):
    options = PlanOptions(dram_budget_bytes=PLAIN + 20 * MiB)
    trials, p = [], plan(cpu, options)
    for _ in range(POLICY.max_trials):  # every candidate tried passes the budget
        trials.append(trial(p, [PLAIN + 40 * MiB] * 3, 0.5, stopped=3))
        with pytest.raises(HeteroError) if len(trials) == POLICY.max_trials else _nothing():
            p = plan(cpu, replace(options, trials=tuple(trials)))
    assert len({tuple(t.levers) for t in trials}) == POLICY.max_trials


def test_a_budget_that_binds_is_tried_and_one_the_profile_found_ample_is_not(cpu):
    cpu.machine.memory_limit_bytes = 20 * 1024 * MiB
    p = plan(cpu, PlanOptions())
    assert p.budget.dram_budget_bytes == cpu.machine.memory_limit_bytes
    assert not fit.wants_trial(cpu, PlanOptions(), p, [])  # the profile kept no budget: plain's peak is measured
    cpu.memory.dram_peak_estimated = True  # the profile had to return memory under it: it binds
    p = plan(cpu, PlanOptions())
    assert fit.wants_trial(cpu, PlanOptions(), p, [])
    other = trial(plan(cpu, PlanOptions(dram_budget_bytes=RETURNED - 10 * MiB)), [PLAIN] * 3, 0.5)
    assert not fit.wants_trial(cpu, PlanOptions(), p, [other] * POLICY.max_trials)  # no trial left


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def without_nvme(profile: Profile) -> Profile:
    """This machine's NVMe makes the states' updates faster than torch's own (the host Adam rate): without it, the
    levers that cost time are the allocator's page faults."""
    profile.machine.tiers = [t for t in profile.machine.tiers if t.kind != "nvme"]
    return profile


def gradients_at_the_peak(profile: Profile) -> Profile:
    """The tiny GPT saves 4.6x its parameters' bytes: with a hundredth of that, the optimizer's step (every gradient
    held) is the peak, which updates in backward lower."""
    for x in profile.layers:
        x.saved_bytes //= 100
    return profile


def test_updating_in_backward_frees_only_gradients_that_coexist_at_the_peak(cpu):
    assert grads_freed_in_backward(cpu) == 0  # the peak is backward's start, before any gradient exists
    params, largest = (sum(x.params_bytes for x in cpu.layers),
                       max(b for x in cpu.layers for b in x.params.values()))
    # with the step the peak (every gradient, Adam's temporaries for the largest parameter), what is left is
    # backward's highest, the largest parameter's gradient and the temporaries of one piece of it on top
    in_backward = backward.peak_bytes(gradients_at_the_peak(cpu).layers, backward.Held(in_backward=True))
    on_top = largest + 2 * min(largest, backward.UPDATE_PIECE_BYTES)
    assert on_top < in_backward < on_top + MiB
    assert grads_freed_in_backward(cpu) == params + 2 * largest - in_backward


def test_updating_in_backward_is_the_free_lever_where_freeing_the_gradients_is_enough(cpu):
    cpu = gradients_at_the_peak(without_nvme(simulated(cpu)))
    freed = grads_freed_in_backward(cpu)
    assert 0 < freed < PLAIN - RETURNED
    p = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN - freed))
    assert p.update_in_backward is not None and (p.optimizer, p.allocator) == (None, None)
    assert peak(p) == PLAIN - freed and p.predicted.dram_saved == {footprint.GRADS_FREED: freed}
    assert saving(p.budget.why, "in_backward") == [SIZE.format_short(freed), "0s"]
    assert p.predicted.iteration_s == plan(cpu, PlanOptions()).predicted.iteration_s  # the same updates, earlier


@pytest.mark.parametrize("script", ["clips", "accumulates"])
def test_a_script_that_needs_every_gradient_at_once_is_not_updated_in_backward(cpu, script):
    cpu = gradients_at_the_peak(cpu)
    if script == "clips":
        cpu.training.edits_grads = True
    else:
        cpu.training.grad_accumulation = 2
    p = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN - grads_freed_in_backward(cpu)))
    reason = refused(p.budget.why, "in_backward")
    assert p.update_in_backward is None and reason == in_backward.refused(cpu, 1) != ""  # the profile's reason
    assert figures(reason) == ([] if script == "clips" else ["2"])  # 2 backward passes a step


def test_among_equally_fast_plans_one_that_evicts_activations_comes_last(cpu):
    cpu.memory = Memory(dram_peak_bytes=RETURNED, dram_peak_estimated=True, dram_peak_returned_bytes=RETURNED,
                        returned_step_s=cpu.training.iteration_s)
    p = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN))
    tiered = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN, tier_activations=True))
    assert tiered.activations is not None
    assert tiered.predicted.iteration_s == pytest.approx(p.predicted.iteration_s)
    assert p.activations is None
