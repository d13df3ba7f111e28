"""`hetero plan`: a Profile and the user's options in, a Plan out.

The phases run in a fixed order because each needs the ones before it: check the options against the machine,
collect what the user pinned in an earlier plan, place the optimizer states, schedule the activations, route the
synchronization, then (with a GPU) choose gradient places and layer modes with the simulator judging, and finally
predict the iteration. `predict` simulates any plan, edited ones included, the same way.
"""

from __future__ import annotations

from dataclasses import replace

from hetero.errors import USAGE, HeteroError
from hetero.plan import axdimm, fit, footprint, gpu_fit, plain, recompute, routing, simulate, tiering
from hetero.plan.choices import build, gpu_state_bytes, host_tier, sync_times
from hetero.plan.context import Context, PlanOptions, context
from hetero.plan.gpu_layers import layer_modes
from hetero.plan.model import GPU
from hetero.plan.pins import Pins, pins_of
from hetero.plan.simulate import Result
from hetero.schema import files
from hetero.schema.plan import (
    ActivationPlan,
    ActivationPrediction,
    Budget,
    Eviction,
    NvmeOverflow,
    OptimizerPlan,
    Plan,
    PlannedModel,
    Predicted,
    RecomputePlan,
    RoutingPlan,
    Source,
    StatePlacement,
    UpdateInBackward,
)
from hetero.schema.profile import Profile
from hetero.units import SIZE, short_time, size_change

ONE_PROCESS = "the profile has one process: no gradient synchronization to route"


# Under 512 MiB a switch 20 MiB below the budget less headroom was passed before it took hold (a width-768 model of
# 6 layers, killed at 512 MiB with the plan predicting 477): the switch needs at least this share of the budget above.
SWITCH_SHARE = 16
UNPREDICTED = Predicted(iteration_s=0.0, peak_bytes={})  # a draft's: the simulator never reads it


def plan(profile: Profile, options: PlanOptions) -> Plan:
    """The plan for `profile` under `options`; under a DRAM budget without a GPU, the fastest that keeps it
    (hetero.plan.fit)."""
    ctx = context(profile, options)
    pins = pins_of(profile, options.previous)
    if options.recompute and (ctx.gpu is not None or recompute.refused_text(profile)):
        why = "its savings are planned in host memory, and this profile trains on a GPU" if ctx.gpu is not None \
            else recompute.refused_text(profile)
        raise HeteroError(f"--recompute: {why}", hint="plan without --recompute", exit_code=USAGE)
    if fit.applies(profile, ctx.gpu, ctx.budget_source):
        return fit.fit(ctx, lambda levers, blocks=None: _solve(ctx, pins, levers, blocks), ctx.host.name)
    if ctx.gpu is not None:
        out = gpu_fit.fit(ctx, pins, lambda levers: _solve(ctx, pins, levers))
    else:
        out = _solve(ctx, pins, frozenset({"recompute"}) if options.recompute else frozenset())
    _check_dram(ctx, out)
    if ctx.budget_source is None:
        return out
    return replace(out, budget=replace(out.budget, why=f"DRAM budget {SIZE.format_short(ctx.dram_budget_bytes)} "
                                                       f"({ctx.budget_source})"))


def _solve(ctx: Context, pins: Pins, levers: frozenset[str], blocks: int | None = None) -> Plan:
    """The plan with `levers` turned on (hetero.plan.fit.LEVERS without a GPU, hetero.plan.gpu_fit.LEVERS with
    one), predicted, not checked against the budget; `blocks`: how many blocks `recompute` takes (all it can: None)."""
    omitted: dict[str, str] = {}
    optimizer = _optimizer(ctx, pins, omitted, levers)
    recomputed = recompute.plan_for(ctx.profile, blocks) if "recompute" in levers else None
    schedules = _activations(ctx, pins, omitted, levers, recomputed)
    route = _routing(ctx, pins, omitted)
    budget = ctx.dram_budget_bytes if ctx.budget_source is not None else None
    draft = Plan(source=Source(profile=ctx.options.profile_path, profile_sha256=files.content_sha256(ctx.profile),
                               model_fingerprint=ctx.profile.model.fingerprint,
                               models=[PlannedModel(name=m.name, fingerprint=m.fingerprint)
                                       for m in ctx.profile.model.models]),
                 budget=Budget(gpu_memory_bytes=ctx.options.gpu_memory_bytes, dram_budget_bytes=budget,
                               reserve=ctx.options.reserve),
                 layers=[], optimizer=optimizer, activations=None, routing=route, predicted=UNPREDICTED,
                 omitted=omitted, allocator=_allocator(ctx) if "allocator" in levers else None,
                 update_in_backward=_in_backward(ctx) if "in_backward" in levers and optimizer is None else None,
                 recompute=recomputed)
    draft = replace(draft, activations=_pick_schedule(ctx, draft, schedules))
    if ctx.gpu is not None:
        counted = plain.counted_budget_bytes(ctx.profile, draft, int(ctx.gpu_budget_bytes * (1 - gpu_fit.HEADROOM)),
                                             predict(ctx.profile, plain.plain_of(draft)))
        draft = layer_modes(ctx, draft, pins, ctx.options.reserve if "host_grads" in levers else 1.0, counted)
    else:
        draft = layer_modes(ctx, draft, pins)
    return _returning_from(ctx, replace(draft, predicted=predicted_of(ctx.profile, draft, predict(ctx.profile, draft))))


def _returning_from(ctx: Context, out: Plan) -> Plan:
    """Without plain's own peak, freed memory is returned only from halfway between the plan's predicted peak (with
    it returned) and the budget less headroom: below, malloc's defaults cost no page faults; the other half is for
    what the process adds before the switch takes hold. Returning memory cannot take back what live tensors hold,
    and an iteration's saved activations are what the process holds more and more of until backward frees them:
    where they exceed that half, memory is returned from the start, as the profile did."""
    if out.allocator is None or not ctx.profile.memory.dram_peak_estimated:
        return out
    peak, room = out.predicted.peak_bytes[host_tier(ctx.profile)], fit.room_bytes(ctx)
    start = max(peak, (peak + room) // 2 >> 20 << 20)  # whole MiB, as a user would write it
    saved = sum(layer.saved_bytes for layer in ctx.profile.layers) * ctx.profile.training.grad_accumulation
    if saved > room - start:
        return replace(out, allocator=replace(out.allocator, from_bytes=None, why=(
            f"{out.allocator.why}; from the start: an iteration saves {SIZE.format_short(saved)} of activations, "
            f"more than the {SIZE.format_short(room - start)} a switch halfway to the budget would leave")))
    if room - start < ctx.dram_budget_bytes // SWITCH_SHARE:
        return replace(out, allocator=replace(out.allocator, from_bytes=None, why=(
            f"{out.allocator.why}; from the start: a switch halfway to the budget would leave "
            f"{SIZE.format_short(room - start)}, less than 1/{SWITCH_SHARE} of it, for what malloc's defaults add "
            f"before the switch takes hold")))
    # malloc's defaults may take the process up to the switch: the prediction says so (its own account entry)
    host = host_tier(ctx.profile)
    predicted = replace(out.predicted, peak_bytes=out.predicted.peak_bytes | {host: start},
                        dram=out.predicted.dram | ({footprint.BELOW_SWITCH: start - peak} if start > peak else {}))
    return replace(out, predicted=predicted, allocator=replace(out.allocator, from_bytes=start, why=(
        f"{out.allocator.why}; with malloc's defaults, whose peak the profile could not measure, until the process "
        f"holds {SIZE.format_short(start)}, halfway from the predicted {SIZE.format_short(peak)} to the budget less "
        f"headroom ({SIZE.format_short(room)}): no page faults below it, and the process may hold up to it")))


def _allocator(ctx: Context):
    m = ctx.profile.memory
    if m.dram_peak_estimated:  # from when on is decided once the plan's peak is predicted (_returning_from)
        return fit.allocator_plan(
            f"glibc returns the memory freed tensors leave as it did throughout the profile ({m.profiled_under}): "
            f"plain training peaked at {SIZE.format_short(m.dram_peak_returned_bytes)} that way")
    return fit.allocator_plan(
        f"glibc returns the memory freed tensors leave: plain training peaks at "
        f"{SIZE.format_short(m.dram_peak_returned_bytes)} this way against {SIZE.format_short(m.dram_peak_bytes)} "
        f"by default, for {short_time(fit.allocator_cost_s(ctx.profile))} more per step (page faults), as the "
        "profile measured it in a fresh process")


def _in_backward(ctx: Context) -> UpdateInBackward:
    freed = footprint.grads_freed_in_backward(ctx.profile)
    return UpdateInBackward(kind=ctx.profile.training.optimizer, why=(
        f"the script's {ctx.profile.training.optimizer} updates each parameter as soon as backward makes its gradient "
        f"final and frees it: the process holds {SIZE.format_short(freed)} less at its peak, for no time (the same "
        "updates, earlier); the profile saw one backward per step and no clipping, and the script must not read "
        "`.grad` between backward and step (it is None then)"))


def predict(profile: Profile, plan: Plan, record: bool = False) -> Result:
    """The simulated iteration of `plan` (as written, edits included) on the profiled machine."""
    costs, choices = build(profile, plan)
    return simulate.simulate(costs, choices, record)


# -- optimizer ----------------------------------------------------------------------------------------------------


def _optimizer(ctx: Context, pins: Pins, omitted: dict[str, str], levers: frozenset[str]) -> OptimizerPlan | None:
    training = ctx.profile.training
    if training.optimizer in ("other", "none"):
        omitted["optimizer"] = _scripts_own(training)
        return None
    if pins.optimizer is not None:
        return pins.optimizer
    ctx, theirs = _placeable(ctx)
    out = _placed(ctx, pins, omitted, levers)
    if not theirs:
        return out
    if out is None:
        omitted["optimizer"] = f"{omitted['optimizer']}; {theirs}"
        return None
    return replace(out, why=f"{out.why}; {theirs}")


def _placeable(ctx: Context) -> tuple[Context, str]:
    """The context with only the parameters of models whose optimizers hetero's Adam can replace (several models:
    each optimizer is placed, or left to the script), and why the others stay the script's ('' for none)."""
    training = ctx.profile.training
    theirs = ctx.profile.kept_models()
    if not theirs:
        return ctx, ""
    params = [p for p in ctx.params if ctx.profile.layers[p.layer].model not in theirs]
    why = "; ".join(f"{o.name} stays the script's ({o.kept})" if o.kept else
                    f"{o.name} too (it updates {o.model}, whose states the plan does not place)"
                    for o in training.optimizers if o.model in theirs)
    return replace(ctx, params=params, update_order=axdimm.update_order(ctx.profile, params)), why


def _placed(ctx: Context, pins: Pins, omitted: dict[str, str], levers: frozenset[str]) -> OptimizerPlan | None:
    training = ctx.profile.training
    overlap, micro = not training.clips_grad and not training.updates_wait, training.grad_accumulation
    overlap_why = ("updates wait for the whole backward: clip_grad_norm_ needs every gradient" if training.clips_grad
                   else f"updates wait for the whole backward: {training.updates_wait}" if training.updates_wait else
                   "updates overlap backward" + (f" (of the last of {micro} micro-batches)" if micro > 1 else ""))
    device = ctx.device
    if "states" in levers:
        return _states_on_nvme(ctx, grads="grads" in levers)
    if device is None:
        omitted["optimizer"] = "--optimizer-device none: the script's optimizer stays as the script built it"
        return None
    if ctx.gpu is not None and "offload" not in levers and device != "gpu":
        return None  # the script's own optimizer, on the GPU (hetero.plan.gpu_fit says why)
    if ctx.gpu is None and device == "host" and ctx.options.optimizer_device is None:
        omitted["optimizer"] = _host_saves_nothing(ctx)
        return None
    if device == "gpu":
        return OptimizerPlan(kind=training.optimizer, device="gpu", overlap_backward=overlap, micro_batches=micro,
                             states=[StatePlacement(param=p.name, tier="gpu") for p in ctx.params],
                             why=f"--optimizer-device gpu: every state on the GPU; {overlap_why}")
    placement = _placement(ctx, device)
    rates = ctx.rates(device)
    nvme = NvmeOverflow(path=ctx.nvme.path or ctx.nvme.name, size_bytes=placement.nvme_bytes) \
        if placement.nvme_bytes else None
    ax = ctx.profile.machine.axdimm
    out = OptimizerPlan(kind=training.optimizer, device=device, backend=ax.backend if device == "axdimm" else None,
                        channels=ax.channels if device == "axdimm" else None, overlap_backward=overlap,
                        micro_batches=micro, nvme=nvme,
                        states=axdimm.states(ctx.params, placement),
                        why=f"{placement.why}; Adam at {axdimm.rate_text(rates)}; {overlap_why}")
    if device == "axdimm" and ax.backend == "emulated":
        added = footprint.added_host_bytes(ctx.profile, out)
        return replace(out, why=f"{out.why}; emulated (--emulate axdimm): its channels are host DRAM, "
                                f"{SIZE.format_short(added)} more there than plain training, for tests and "
                                "demonstrations")
    return out


def _scripts_own(training) -> str:
    """Why the plan leaves the script's optimizer(s) as they are."""
    if training.optimizer == "none":
        return ("the script updates its parameters itself, without a torch.optim optimizer: there is no optimizer "
                "for hetero's Adam to replace")
    kept = [o for o in training.optimizers if o.kept]
    if not kept:
        return ("the script's optimizer is not Adam or AdamW of the model's parameters without amsgrad (what "
                "hetero's Adam replaces): it stays as the script built it")
    whys = "; ".join(o.kept if len(training.optimizers) == 1 else f"{o.name}: {o.kept}" for o in kept)
    return f"{whys}: {'it stays' if len(kept) == 1 else 'they stay'} as the script built it"


def _states_on_nvme(ctx: Context, grads: bool) -> OptimizerPlan:
    """Every state and master copy in NVMe files, staged through host memory inside step() (hetero.plan.fit); with
    `grads`, the gradients wait there too from backward to step."""
    training, nvme = ctx.profile.training, ctx.nvme
    total = sum(axdimm.state_bytes(p) for p in ctx.params)
    out = OptimizerPlan(kind=training.optimizer, device="host", overlap_backward=False,
                        micro_batches=training.grad_accumulation,
                        nvme=NvmeOverflow(path=nvme.path or nvme.name, size_bytes=total, grads=grads),
                        states=[StatePlacement(param=p.name, tier="nvme") for p in ctx.params])
    staging = footprint.staging_bytes(ctx.profile, out)
    kept = (f"each gradient ({SIZE.format_short(sum(4 * p.num_params for p in ctx.params))} in all) is written "
            f"there too as backward makes it final and read back with its states, so host memory holds none "
            f"between backward and step (`.grad` is None then, and clipping brings them back first; this assumes the "
            f"script zeroes its gradients every step)" if grads else
            "its gradients stay there until it frees them, as in plain training")
    why = (f"to keep the DRAM budget: every state and fp32 master copy ({SIZE.format_short(total)}) on {nvme.name}, "
           f"read, updated and written back inside step() through {SIZE.format_short(staging)} of host staging, "
           f"after backward (updates of NVMe-held states do not overlap it); the script's "
           f"{footprint.ADAM_STATE_BYTES_PER_PARAM} B/param of Adam states leave host memory; {kept}; Adam at "
           f"{axdimm.rate_text(ctx.rates('host'))}")
    return replace(out, why=why)


def _host_saves_nothing(ctx: Context) -> str:
    n = sum(p.num_params for p in ctx.params)
    states, master = footprint.ADAM_STATE_BYTES_PER_PARAM * n, 4 * n
    return (f"without a GPU the script's {ctx.profile.training.optimizer} already keeps its states in host memory "
            f"({SIZE.format_short(states)}); hetero's host Adam would add {SIZE.format_short(master)} of fp32 master "
            "copies there and save nothing, so the script's own optimizer stays (--optimizer-device host uses "
            f"hetero's, at {axdimm.rate_text(ctx.rates('host'))})")


def _placement(ctx: Context, device: str) -> axdimm.Placement:
    nvme = ctx.nvme.name if ctx.nvme else None
    if device == "axdimm":
        ax = ctx.profile.machine.axdimm
        return axdimm.place(ctx.params, ctx.update_order, ax.channels, ax.channel_capacity_bytes, nvme, "axdimm")
    return axdimm.place(ctx.params, ctx.update_order, 1, max(0, ctx.dram_budget_bytes - ctx.host_model_bytes), nvme, "host")


# -- activations --------------------------------------------------------------------------------------------------


def _activations(ctx: Context, pins: Pins, omitted: dict[str, str], levers: frozenset[str],
                 recomputed: RecomputePlan | None = None) -> list[ActivationPlan]:
    """The TierTrain schedule under the paper's busy-prefetcher rule and under ours; `_pick_schedule` simulates
    both. Layers inside `recomputed` blocks save nothing to evict."""
    if ctx.slow is None:
        omitted["activations"] = f"the profile has no tier slower than {ctx.fast} with measured transfer times"
        return []
    if "layers" in ctx.profile.unmeasured:  # a compiled model: per-layer hooks cannot follow it
        omitted["activations"] = ctx.profile.unmeasured["layers"]
        return []
    if ctx.gpu is None and not (pins.evictions or ctx.options.tier_activations or "tiering" in levers):
        omitted["activations"] = _tiering_saves_nothing(ctx)
        return []
    if ctx.gpu is not None and "tiering" not in levers:
        return []  # hetero.plan.gpu_fit says why
    evict, prefetch = ctx.tier_curves(ctx.slow)
    layers = ctx.profile.layers
    rebuilt = recompute.layers_of(ctx.profile, recomputed.blocks) if recomputed is not None else set()
    windows = [tiering.Window(name=x.name, saved_bytes=0 if x.name in rebuilt else x.saved_bytes, fp_end_s=x.fp_end_s,
                              bp_start_s=x.bp_start_s,
                              storages=() if x.name in rebuilt else tuple(x.saved_storages_bytes))
               for x in layers]
    index = {x.name: i for i, x in enumerate(layers)}
    pinned = {index[name]: tiering.Decision(layer=index[name], evict_bytes=e.evict_bytes, prefetch_at_s=e.prefetch_at_s,
                                            prefetch_after=index.get(e.prefetch_after), outcome="pinned", why=e.why)
              for name, e in pins.evictions.items()}
    min_tensor = tiering.min_tensor_bytes(evict, prefetch)
    out = []
    for rule in ("paper", "packed"):
        decisions = tiering.schedule(windows, evict, prefetch, ctx.options.stay_time_s, min_tensor, pinned, rule)
        keyed = ctx.gpu is not None  # see _trigger
        schedule = [Eviction(layer=layers[d.layer].name, evict_bytes=d.evict_bytes, prefetch_at_s=_ns(d.prefetch_at_s),
                             prefetch_after=layers[d.prefetch_after].name if d.prefetch_after is not None else
                             _trigger(layers, d.prefetch_at_s) if keyed and d.outcome != "pinned" and d.evict_bytes
                             else None, pinned=d.outcome == "pinned", why=d.why) for d in decisions]
        out.append(ActivationPlan(fast=ctx.fast, slow=ctx.slow, slow_path=_tier_path(ctx.profile, ctx.slow),
                                  stay_time_s=ctx.options.stay_time_s,
                                  min_tensor_bytes=min_tensor, schedule=schedule, why=rule))
    return out


def _trigger(layers, at_s: float) -> str:
    """On a GPU, the layer whose backward start (as profiled) comes last at or before `at_s`: the prefetch is keyed
    to it instead of the clock. A GPU runs behind the thread that issues its work, and memory is allocated and freed
    in the order the work is issued: a clock-timed prefetch would be issued as soon as that thread reached backward,
    bringing every evicted tensor back at once, while one keyed to a layer's backward start is issued between the
    backward layers the plan put it between."""
    started = [x for x in layers if x.bp_start_s <= at_s]
    first = min(layers, key=lambda x: x.bp_start_s)
    return max(started, key=lambda x: x.bp_start_s, default=first).name


def _tiering_saves_nothing(ctx: Context) -> str:
    saved = max((x.saved_bytes for x in ctx.profile.layers), default=0)
    total = sum(x.saved_bytes for x in ctx.profile.layers)
    fits = "" if ctx.budget_source is None else \
        f"the DRAM budget is kept without it ({ctx.budget_source}); "
    return (f"{fits}saved activations ({SIZE.format_short(total)} per step, {SIZE.format_short(saved)} in the "
            "largest layer) live in host memory, whose allocator keeps the memory evicted tensors free for the next "
            "ones: the process's peak would barely fall while every step waits on the disk (--tier-activations "
            "schedules them anyway)")


def _tier_path(profile: Profile, name: str) -> str | None:
    return next((t.path for t in profile.machine.tiers if t.name == name), None)


def _pick_schedule(ctx: Context, draft: Plan, candidates: list[ActivationPlan]) -> ActivationPlan | None:
    """The faster schedule in simulation, then the one leaving less in fast memory on average."""
    scored = []
    for cand in candidates:
        r = predict(ctx.profile, replace(draft, activations=cand))
        scored.append((_ns(r.iteration_s), r.act_avg_bytes, r.act_peak_bytes, r))
    if not scored:
        return None
    best = min(range(len(scored)), key=lambda k: scored[k][:3])
    chosen, r = candidates[best], scored[best][3]
    others = "; ".join(f"{c.why} rule: {short_time(s[0])}, average {SIZE.format_short(s[1])}"
                       for k, (c, s) in enumerate(zip(candidates, scored)) if k != best)
    basis = "simulated with every layer GFGB" if ctx.gpu else "simulated"
    return replace(chosen, why=f"{chosen.why} prefetch rule, {basis}: iteration {short_time(r.iteration_s)}, "
                               f"{ctx.fast} activations {size_change(r.act_avg_untiered_bytes, r.act_avg_bytes)} on "
                               f"average, {size_change(r.act_peak_untiered_bytes, r.act_peak_bytes)} at peak "
                               f"(the {others})")


def _ns(seconds: float) -> float:
    """Times in the plan to the nanosecond: readable, and far below any clock the runtime keeps."""
    return round(seconds, 9)


# -- routing ------------------------------------------------------------------------------------------------------


def _routing(ctx: Context, pins: Pins, omitted: dict[str, str]) -> RoutingPlan | None:
    if not ctx.links:
        omitted["routing"] = ONE_PROCESS
        return None
    if ctx.profile.model.sharded:
        omitted["routing"] = ("FSDP2 reduce-scatters the gradients of the sharded parameters itself: there is no "
                              "DDP all-reduce to route")
        return None
    if pins.routing is not None:
        return pins.routing
    training = ctx.profile.training
    r = routing.route(ctx.links, ctx.ranks, sum(p.params_bytes for p in ctx.profile.layers), training.forward_s,
                      training.backward_s)
    return RoutingPlan(threshold_bytes=r.threshold_bytes, latency_peer=r.latency_peer, bandwidth_peer=r.bandwidth_peer,
                       shard_bytes=r.shard_bytes, dual_sync_bytes=r.dual_sync_bytes, why=r.why)


# -- prediction ---------------------------------------------------------------------------------------------------


def _check_dram(ctx: Context, out: Plan) -> None:
    host = ctx.host.name
    if out.predicted.peak_bytes[host] > ctx.dram_budget_bytes:
        raise HeteroError(f"the plan needs {SIZE.format_short(out.predicted.peak_bytes[host])} of {host}, over the "
                          f"budget {SIZE.format_short(ctx.dram_budget_bytes)}",
                          hint="raise --dram-budget, lower --stay-time, or move the optimizer (--optimizer-device)",
                          exit_code=USAGE)


def predicted_of(profile: Profile, plan: Plan, result: Result) -> Predicted:
    """The plan's `predicted` section from its simulated iteration."""
    # the GPU's own memory is `gpu` (what torch reserves), not its profile tier
    peak = {t.name: 0 for t in profile.machine.tiers if t.kind != "hbm"} | ({GPU: 0} if profile.machine.gpu else {})
    for tier, used in result.peak_bytes.items():
        peak[tier] = peak.get(tier, 0) + used
    dram: dict[str, int] = {}
    if profile.memory is not None:
        host = host_tier(profile)
        fast = plan.activations.fast if plan.activations else (GPU if profile.machine.gpu else host)
        here = fast == host
        dram = footprint.contributors(profile, plan, peak[host], result.act_peak_bytes if here else 0,
                                      result.act_peak_untiered_bytes - result.act_peak_bytes if here else 0)
        peak[host] = sum(dram.values())
    act = None
    if plan.activations is not None and any(e.evict_bytes for e in plan.activations.schedule):
        act = ActivationPrediction(avg_fast_bytes=result.act_avg_bytes, peak_fast_bytes=result.act_peak_bytes,
                                   avg_fast_untiered_bytes=result.act_avg_untiered_bytes,
                                   peak_fast_untiered_bytes=result.act_peak_untiered_bytes)
    sync = sync_times(profile, plan)
    iteration = result.iteration_s + (fit.allocator_cost_s(profile) if plan.allocator is not None else 0.0) + \
        recompute.cost_s(profile, plan.recompute)
    gpu: dict[str, int] = {}
    if profile.machine.gpu is not None:
        bare = predict(profile, plain.plain_of(plan))
        gpu = plain.gpu_contributors(profile, plan, result, bare, gpu_state_bytes(profile, plan.optimizer))
        peak[GPU] = sum(gpu.values())
        iteration = plain.anchored_iteration_s(profile, iteration, bare.iteration_s)
    return Predicted(iteration_s=_ns(iteration), sync_s=_ns(sum(sync)) if sync else None, peak_bytes=peak,
                     activations=act, dram={k: b for k, b in dram.items() if b > 0},
                     dram_saved={k: -b for k, b in dram.items() if b < 0}, gpu={k: b for k, b in gpu.items() if b > 0},
                     gpu_saved={k: -b for k, b in gpu.items() if b < 0})
