"""A DRAM budget is a hard limit on the predicted whole-process peak: the planner turns on what it needs, the
fastest combination that fits, says what each choice saved, and refuses a budget nothing meets."""

import pytest

from hetero.errors import USAGE, HeteroError
from hetero.plan import backward, fit, footprint
from hetero.plan.in_backward import grads_freed_in_backward
from hetero.plan.solve import PlanOptions, plan
from hetero.schema import files
from hetero.schema.profile import Memory, Profile
from hetero.units import SIZE

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


def room_for(peak: int, returned: bool = False) -> int:
    """The least budget a plan predicting `peak` fits, headroom included, and where it keeps malloc's defaults
    (not `returned`) their spread."""
    return fit.budget_for(peak if returned else fit.with_spread(peak))


def simulated(profile: Profile) -> Profile:
    """Plain training's peak estimated and freed memory not measured: every candidate, plain's too, is a simulation
    held to the room (`fit.room_of`), and no lever is forced; the tiny GPT's levers save less than the headroom a
    peak measured alone is spared (`fit.measured_fits`)."""
    profile.memory.dram_peak_estimated, profile.memory.dram_peak_returned_bytes = True, None
    return profile


def own_states(profile: Profile) -> int:
    return footprint.ADAM_STATE_BYTES_PER_PARAM * sum(x.num_params for x in profile.layers)


def peak(p) -> int:
    return p.predicted.peak_bytes["dram"]


def test_the_peak_is_the_sum_of_the_plans_own_account(cpu):
    p = plan(cpu, PlanOptions(dram_budget_bytes=RETURNED + 10 * MiB))
    assert peak(p) == sum(p.predicted.dram.values()) - sum(p.predicted.dram_saved.values())


def test_a_budget_plain_training_fits_moves_nothing_and_says_so(cpu):
    p = plan(cpu, PlanOptions(dram_budget_bytes=room_for(PLAIN)))
    assert (p.allocator, p.optimizer, p.activations) == (None, None, None)
    assert peak(p) == PLAIN and "more for malloc's defaults' spread, nothing moved" in p.budget.why
    # a budget plain's predicted peak meets only without the headroom, or without that spread, is not met by plain
    # training
    assert peak(plan(cpu, PlanOptions(dram_budget_bytes=PLAIN))) <= fit.room_of(PLAIN)
    assert plan(cpu, PlanOptions(dram_budget_bytes=fit.budget_for(PLAIN))).allocator is not None


def test_a_peak_measured_alone_keeps_its_spread_and_the_mapped_files_under_the_budget_but_no_headroom(cpu):
    """Plain's peak measured alone has no simulation's error to allow for: it fits where malloc's spread above it
    and the mapped files do; a simulated peak also keeps the headroom."""
    least = fit.with_spread(PLAIN) + fit.MAPPED_BYTES
    assert fit.measured_fits(PLAIN, least) and not fit.measured_fits(PLAIN, least - 1)
    assert peak(plan(cpu, PlanOptions(dram_budget_bytes=least))) == PLAIN
    assert peak(plan(cpu, PlanOptions(dram_budget_bytes=least - MiB))) < PLAIN
    p = plan(simulated(cpu), PlanOptions(dram_budget_bytes=least))  # the same peak as estimated: not plain's
    assert p.optimizer is not None and peak(p) < PLAIN


def test_returning_freed_memory_is_turned_on_when_it_is_what_fits_and_its_cost_counts(cpu):
    budget = 800 * MiB  # only freed memory returned reaches it: the states alone save 23MiB
    p = plan(cpu, PlanOptions(dram_budget_bytes=budget))
    assert p.allocator is not None and peak(p) <= budget
    assert "returning freed memory saves 200MiB" in p.budget.why and "--dram-budget" in p.budget.why
    alone = plan(cpu, PlanOptions(dram_budget_bytes=room_for(RETURNED, returned=True)))
    assert peak(alone) <= RETURNED and p.predicted.iteration_s <= alone.predicted.iteration_s  # the fastest fit
    states = plan(simulated(cpu), PlanOptions(dram_budget_bytes=room_for(PLAIN - own_states(cpu) + STAGING)))
    both_off = plan(cpu, PlanOptions())
    # what returning memory costs a step, as the profile measured it, is in the prediction
    assert p.predicted.iteration_s == pytest.approx(states.predicted.iteration_s + 0.25 * cpu.training.iteration_s,
                                                    rel=1e-6) or p.optimizer is None
    assert both_off.allocator is None


def test_below_that_the_planner_adds_what_it_needs_and_each_choice_says_what_it_saved(cpu):
    budget = RETURNED - 10 * MiB
    p = plan(cpu, PlanOptions(dram_budget_bytes=budget))
    assert peak(p) <= budget and p.allocator is not None
    assert p.optimizer is not None or p.activations is not None
    for lever, section in (("optimizer states on NVMe", p.optimizer), ("evicting saved activations", p.activations)):
        assert (f"{lever} saves" in p.budget.why) == (section is not None)


def test_optimizer_states_go_to_nvme_when_only_they_fit(cpu):
    simulated(cpu)  # no allocator to turn on: the states are the one lever that saves
    p = plan(cpu, PlanOptions(dram_budget_bytes=room_for(PLAIN - own_states(cpu) + STAGING)))
    assert p.optimizer.device == "host" and {s.tier for s in p.optimizer.states} == {"nvme"}
    assert p.optimizer.overlap_backward is False and p.activations is None
    assert peak(p) == PLAIN - own_states(cpu) + STAGING
    assert p.predicted.dram_saved == {footprint.STATES: own_states(cpu)}
    assert "allocator" not in p.budget.why or "did not measure" in p.budget.why


def test_a_budget_nothing_meets_is_refused_with_the_least_the_plan_needs(cpu):
    with pytest.raises(HeteroError) as e:
        plan(cpu, PlanOptions(dram_budget_bytes=100 * MiB))
    assert e.value.exit_code == USAGE and "below the floor: no plan keeps the budget 100MiB" in e.value.message
    assert "\n" not in e.value.message and e.value.hint.startswith("raise --dram-budget to")
    # the floor is named, and what it is made of by the plan's account
    least = SIZE.parse(e.value.message.split("the least any plan needs is ")[1].split(" ")[0])
    assert least > 100 * MiB and f"plain training, memory returned {SIZE.format_short(RETURNED)}" in e.value.message
    assert fit.room_of(SIZE.parse(e.value.hint.split("raise --dram-budget to ")[1].split(" ")[0])) >= least


def test_the_memory_cgroup_is_the_default_budget_and_an_option_above_it_is_refused(cpu):
    cpu.machine.memory_limit_bytes = 800 * MiB
    p = plan(cpu, PlanOptions())
    assert p.budget.dram_budget_bytes == 800 * MiB and "memory cgroup the profile ran in" in p.budget.why
    assert p.allocator is not None
    with pytest.raises(HeteroError, match="exceeds the 800MiB limit of the memory cgroup"):
        plan(cpu, PlanOptions(dram_budget_bytes=900 * MiB))


def test_a_profile_that_could_not_measure_plains_peak_always_returns_memory(cpu):
    cpu.memory = Memory(dram_peak_bytes=RETURNED, dram_peak_estimated=True, dram_peak_returned_bytes=RETURNED,
                        returned_step_s=cpu.training.iteration_s)
    p = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN))
    assert p.allocator is not None and "own peak is not known" in p.budget.why and "exceeds" not in p.budget.why
    assert "as it did throughout the profile" in p.allocator.why


def test_returning_memory_costs_what_the_fresh_runs_measured_beside_each_other(cpu):
    assert fit.allocator_cost_s(cpu) == pytest.approx(0.25 * cpu.training.iteration_s)
    cpu.memory.default_step_s = 1.2 * cpu.training.iteration_s  # the moment both ran was slower than the profile's
    assert fit.allocator_cost_s(cpu) == pytest.approx(0.05 * cpu.training.iteration_s)
    cpu.memory.default_step_s = None  # older profiles: against the profile's own iteration
    assert fit.allocator_cost_s(cpu) == pytest.approx(0.25 * cpu.training.iteration_s)


def test_gradients_follow_the_states_to_nvme_when_only_both_fit(cpu):
    simulated(cpu)
    grads = 4 * sum(x.num_params for x in cpu.layers)
    staging = STAGING + 2 * 4 * 2**18  # each slot also reads a gradient piece back
    p = plan(cpu, PlanOptions(dram_budget_bytes=room_for(PLAIN - own_states(cpu) - grads + staging)))
    assert p.optimizer.nvme.grads and {s.tier for s in p.optimizer.states} == {"nvme"}
    assert peak(p) == PLAIN - own_states(cpu) - grads + staging
    assert "gradients on NVMe from backward to step" in p.budget.why
    # each saving on its own line, none counted twice: the states' line is without the gradients' saving
    assert f"optimizer states on NVMe saves {SIZE.format_short(own_states(cpu) - STAGING)}" in p.budget.why
    assert f"saves {SIZE.format_short(grads - 2 * 4 * 2**18)} for" in p.budget.why
    states_only = plan(cpu, PlanOptions(dram_budget_bytes=room_for(PLAIN - own_states(cpu) + STAGING)))
    assert not states_only.optimizer.nvme.grads  # the faster lever where it is enough
    # the gradients' trip to NVMe and back is in the prediction
    assert p.predicted.iteration_s > states_only.predicted.iteration_s


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
    p = plan(cpu, PlanOptions(dram_budget_bytes=room_for(PLAIN - freed)))
    assert p.update_in_backward is not None and (p.optimizer, p.allocator) == (None, None)
    assert peak(p) == PLAIN - freed and p.predicted.dram_saved == {footprint.GRADS_FREED: freed}
    assert f"updating each parameter in backward (for a script that reads no gradient before step) saves " \
           f"{SIZE.format_short(freed)} for 0s" in p.budget.why
    assert p.predicted.iteration_s == plan(cpu, PlanOptions()).predicted.iteration_s  # the same updates, earlier


@pytest.mark.parametrize("script", ["clips", "accumulates"])
def test_a_script_that_needs_every_gradient_at_once_is_not_updated_in_backward(cpu, script):
    cpu = gradients_at_the_peak(cpu)
    if script == "clips":
        cpu.training.edits_grads = True
    else:
        cpu.training.grad_accumulation = 2
    p = plan(cpu, PlanOptions(dram_budget_bytes=room_for(PLAIN - grads_freed_in_backward(cpu))))
    assert p.update_in_backward is None and "not updating each parameter in backward" in p.budget.why
    assert ("changes the gradients" if script == "clips" else "accumulates 2 backward passes") in p.budget.why


def test_without_plains_own_peak_memory_is_returned_only_near_the_budget_and_the_lower_peak_wins(cpu):
    cpu = gradients_at_the_peak(without_nvme(cpu))
    cpu.memory = Memory(dram_peak_bytes=RETURNED, dram_peak_estimated=True, dram_peak_returned_bytes=RETURNED,
                        returned_step_s=cpu.training.iteration_s)
    p = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN))
    # returning memory alone fits too, but malloc's defaults run up to a mark: the equally fast, lower peak
    returned = RETURNED - grads_freed_in_backward(cpu)
    assert p.update_in_backward is not None
    halfway = (returned + fit.room_bytes(fit_context(cpu, PLAIN))) // 2
    assert 0 <= halfway - p.allocator.from_bytes < MiB  # in whole MiB
    # malloc's defaults may hold the process up to the switch: the prediction is the switch, and says so
    assert peak(p) == p.allocator.from_bytes <= fit.room_bytes(fit_context(cpu, PLAIN))
    assert p.predicted.dram[footprint.BELOW_SWITCH] == p.allocator.from_bytes - returned
    # a half above the switch under a step's saved activations returns memory from the start: backward frees them
    # into the heaps, and past a switch the process grew by a share of them (docs/benchmarks.md, round seven)
    room = fit.room_bytes(fit_context(cpu, PLAIN))
    cpu.layers[-1].saved_bytes += room - returned
    p = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN))
    assert p.allocator.from_bytes is None and "or a step's saved activations" in p.allocator.why
    # and under a SWITCH_SHARE of the budget
    cpu.layers[-1].saved_bytes -= room - returned
    tight = room_for(returned + 2 * MiB, returned=True)
    assert plan(cpu, PlanOptions(dram_budget_bytes=tight)).allocator.from_bytes is None


def fit_context(profile: Profile, budget: int):
    from hetero.plan.context import context
    return context(profile, PlanOptions(dram_budget_bytes=budget))


def test_among_equally_fast_plans_one_that_evicts_activations_comes_last(cpu):
    # with the peak estimated, the lower peak wins a tie; evictions simulated behind compute tie, yet cost the cores
    cpu.memory = Memory(dram_peak_bytes=RETURNED, dram_peak_estimated=True, dram_peak_returned_bytes=RETURNED,
                        returned_step_s=cpu.training.iteration_s)
    p = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN))
    tiered = plan(cpu, PlanOptions(dram_budget_bytes=PLAIN, tier_activations=True))
    assert tiered.activations is not None and peak(tiered) < peak(p)
    assert tiered.predicted.iteration_s == pytest.approx(p.predicted.iteration_s)
    assert p.activations is None and p.allocator is not None
