"""`hetero plan`: a Profile and the user's options in, a Plan out.

In order, each phase needing those before: check the options against the machine, collect what an earlier plan
pinned, choose the levers (hetero.plan.fit without a GPU under a DRAM budget, hetero.plan.gpu_fit with one), and for
each choice solve the sections (hetero.plan.sections: the `draft` ones in order, then the `whole` ones, which
simulate the draft), predict the iteration, and let the sections settle what depends on the prediction. `predict`
simulates any plan, edited ones included, the same way. No phase names a section: each comes from the table.
"""

from __future__ import annotations

from dataclasses import replace

from hetero.errors import USAGE, HeteroError
from hetero.plan import fit, footprint, gpu_fit, gpu_peak, plain, recompute, simulate
from hetero.plan.choices import build, host_tier
from hetero.plan.context import Context, PlanOptions, context
from hetero.plan.model import GPU
from hetero.plan.pins import pins_of
from hetero.plan.section import Phase, Pins, Step, ns
from hetero.plan.sections import TABLE, plain_of
from hetero.plan.sections.optimizer_bytes import gpu_state_bytes
from hetero.plan.sections.routing import ONE_PROCESS, sync_times
from hetero.plan.simulate import Result
from hetero.schema import files
from hetero.schema.plan import ActivationPrediction, Budget, Plan, PlannedModel, Predicted, Source
from hetero.schema.profile import Profile
from hetero.units import SIZE

__all__ = ["ONE_PROCESS", "PlanOptions", "build", "plan", "predict", "predicted_of"]

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
        out = gpu_fit.fit(ctx, pins, lambda levers, gpu_budget: _solve(replace(ctx, gpu_budget_bytes=gpu_budget),
                                                                        pins, levers))
    else:
        out = _solve(ctx, pins, fit.recompute_levers(ctx) if options.recompute else frozenset())
    _check_dram(ctx, out)
    if ctx.budget_source is None:
        return out
    return replace(out, budget=replace(out.budget, why=f"DRAM budget {SIZE.format_short(ctx.dram_budget_bytes)} "
                                                       f"({ctx.budget_source})"))


def _solve(ctx: Context, pins: Pins, levers: frozenset[str], blocks: int | None = None) -> Plan:
    """The plan with `levers` turned on (hetero.plan.fit.LEVERS without a GPU, hetero.plan.gpu_fit.LEVERS with
    one), predicted, not checked against the budget; `blocks`: how many blocks `recompute` takes (all it can: None)."""
    omitted: dict[str, str] = {}
    draft = _empty(ctx, omitted)
    for phase in ("draft", "whole"):
        draft = _solved(ctx, pins, levers, blocks, draft, phase)
    draft = replace(draft, omitted={s.name: omitted[s.name] for s in TABLE if s.name in omitted})
    return _settled(ctx, replace(draft, predicted=predicted_of(ctx.profile, draft, predict(ctx.profile, draft))))


def _empty(ctx: Context, omitted: dict[str, str]) -> Plan:
    """The plan before any section is solved: where it came from and its budget; `omitted` is filled as sections
    are left out."""
    budget = ctx.dram_budget_bytes if ctx.budget_source is not None else None
    return Plan(source=_source(ctx.profile, ctx.options.profile_path),
                budget=Budget(gpu_memory_bytes=ctx.options.gpu_memory_bytes, dram_budget_bytes=budget,
                              reserve=ctx.options.reserve),
                predicted=UNPREDICTED, omitted=omitted, **{s.name: s.absent() for s in TABLE})


def _source(profile: Profile, profile_path: str) -> Source:
    return Source(profile=profile_path, profile_sha256=files.content_sha256(profile),
                  model_fingerprint=profile.model.fingerprint,
                  models=[PlannedModel(name=m.name, fingerprint=m.fingerprint) for m in profile.model.models])


def _solved(ctx: Context, pins: Pins, levers: frozenset[str], blocks: int | None, draft: Plan, phase: Phase) -> Plan:
    """`draft` with the sections of `phase` solved, in the table's order, each seeing the ones before it."""
    for section in TABLE:
        if section.phase == phase:
            step = Step(ctx=ctx, pins=pins, levers=levers, blocks=blocks, draft=draft, omitted=draft.omitted,
                        predict=lambda p: predict(ctx.profile, p), build=lambda p: build(ctx.profile, p),
                        plain_of=plain_of)
            draft = replace(draft, **{section.name: section.solve(step)})
    return draft


def _settled(ctx: Context, predicted: Plan) -> Plan:
    """The predicted plan with what each section decides from the prediction (hetero.plan.section.Section.settle)."""
    for section in TABLE:
        predicted = section.settle(ctx, predicted)
    return predicted


def predict(profile: Profile, plan: Plan, record: bool = False) -> Result:
    """The simulated iteration of `plan` (as written, edits included) on the profiled machine."""
    costs, choices = build(profile, plan)
    return simulate.simulate(costs, choices, record)


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
    iteration = result.iteration_s
    for section in TABLE:  # what the simulator does not time: returning memory's page faults, recomputation
        iteration += section.cost_s(profile, plan)
    gpu: dict[str, int] = {}
    if profile.machine.gpu is not None:
        states = gpu_state_bytes(profile, plan.optimizer, host_tier(profile))
        gpu = gpu_peak.contributors(profile, gpu_peak.on_gpu(plan, result, states))
        peak[GPU] = sum(gpu.values())
    iteration = plain.anchored_iteration_s(profile, iteration, predict(profile, plain_of(plan)).iteration_s)
    return Predicted(iteration_s=ns(iteration), sync_s=ns(sum(sync)) if sync else None, peak_bytes=peak,
                     activations=act, dram={k: b for k, b in dram.items() if b > 0},
                     dram_saved={k: -b for k, b in dram.items() if b < 0}, gpu={k: b for k, b in gpu.items() if b > 0},
                     gpu_saved={k: -b for k, b in gpu.items() if b < 0})
