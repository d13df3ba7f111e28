"""The optimizer section: where Adam's states and updates live (AXDIMM channels, host, GPU, NVMe overflow), or
why the script's own optimizer stays. Its memory is counted in hetero.plan.sections.optimizer_bytes. Pure: no
torch, no I/O."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hetero.errors import USAGE, HeteroError
from hetero.plan import axdimm
from hetero.plan.context import Context
from hetero.plan.section import HostPeak, Section, Step, Translation, busy_share
from hetero.plan.sections import optimizer_bytes
from hetero.schema.plan import NvmeOverflow, OptimizerPlan, Plan, StatePlacement
from hetero.schema.profile import Profile
from hetero.units import SIZE


class Optimizer(Section):
    name = "optimizer"

    def solve(self, step: Step) -> OptimizerPlan | None:
        training = step.ctx.profile.training
        if training.optimizer in ("other", "none"):
            step.omitted["optimizer"] = _scripts_own(training)
            return None
        if (kept := step.pinned("optimizer")) is not None:  # pinned in the earlier plan
            return kept
        ctx, theirs = _placeable(step.ctx)
        out = _placed(ctx, step.omitted, step.levers)
        if not theirs:
            return out
        if out is None:
            step.omitted["optimizer"] = f"{step.omitted['optimizer']}; {theirs}"
            return None
        return replace(out, why=f"{out.why}; {theirs}")

    def pinned(self, profile: Profile, previous: Plan) -> OptimizerPlan | None:
        """The earlier plan's optimizer section where pinned; refused where its parameters are not the profile's."""
        optimizer = previous.optimizer if previous.optimizer and previous.optimizer.pinned else None
        if optimizer is not None and {s.param for s in optimizer.states} != {p.name for p in axdimm.params(profile)}:
            raise HeteroError("--from plan pins an optimizer section whose parameters differ from the profile's",
                              hint="unpin the optimizer section of the old plan (pinned: false)", exit_code=USAGE)
        return optimizer

    def static_bytes(self, profile: Profile, plan: Plan, host: str) -> dict[str, int]:
        return optimizer_bytes.static_bytes(profile, plan.optimizer, host)

    def choose(self, t: Translation) -> dict[str, Any]:
        """Each parameter's update, the lanes that run them, and where gradients and parameters live."""
        profile, opt = t.profile, t.plan.optimizer
        gpu, n = profile.machine.gpu is not None, len(t.costs.layers)
        rates = axdimm.rates(profile, opt.device) if opt else None
        lanes = rates.lanes if rates else []
        updates = axdimm.updates(axdimm.params(profile), opt.states, n, rates,
                                 grads=optimizer_bytes.grads_on_nvme(profile, opt)) if opt else [[] for _ in range(n)]
        return dict(updates=updates, lanes=lanes, overlap_backward=opt.overlap_backward if opt else False,
                    grads_to_host=opt is not None and opt.device != "gpu",
                    params_on_gpu=gpu and (opt is None or opt.device == "gpu"),
                    step_s=0.0 if opt else profile.training.optimizer_step_s,
                    staging_bytes=optimizer_bytes.simulated_staging_bytes(profile, t.plan,
                                                                          t.static_bytes.get(t.host, 0), t.host),
                    cpu_share=_cpu_share(profile, opt, lanes))

    def host_bytes(self, profile: Profile, plan: Plan, peak: HostPeak) -> dict[str, int]:
        return optimizer_bytes.host_entries(profile, plan, peak)


def _cpu_share(profile: Profile, opt: OptimizerPlan | None, lanes: list[str]) -> dict[str, float]:
    """Disk workers mostly wait for the device (the profile measures how much). Emulated AXDIMM channels and the
    host optimizer's driver are host threads running Adam; a hardware AXDIMM computes on its own device."""
    m, out = profile.machine, {}
    nvme = axdimm.nvme_tier(profile)  # the tier whose curves time the optimizer's state reads and writes
    if nvme is not None:
        out["nvme read"], out["nvme write"] = busy_share(nvme.read_cpu), busy_share(nvme.write_cpu)
    on_device = opt is not None and opt.device == "axdimm" and m.axdimm is not None and m.axdimm.backend == "hardware"
    if opt is not None and opt.device == "host":
        worker = m.cpu.adam_cpu
    else:
        worker = m.axdimm.cpu if m.axdimm is not None else None
    out.update(dict.fromkeys(lanes, 0.0 if on_device else busy_share(worker)))
    return out


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


def _placed(ctx: Context, omitted: dict[str, str], levers: frozenset[str]) -> OptimizerPlan | None:
    training = ctx.profile.training
    overlap, micro = not training.edits_grads and not training.updates_wait, training.grad_accumulation
    overlap_why = ("updates wait for step(): the script changes the gradients after backward" if training.edits_grads
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
        omitted["optimizer"] = _host_saves_nothing(ctx, overlap)
        return None
    if device == "gpu":
        return OptimizerPlan(kind=training.optimizer, device="gpu", overlap_backward=overlap, micro_batches=micro,
                             states=[StatePlacement(param=p.name, tier="gpu") for p in ctx.params],
                             why=f"--optimizer-device gpu: every state on the GPU; {overlap_why}")
    placement = _placement(ctx, device)
    rates = ctx.rates(device)
    nvme = NvmeOverflow(path=ctx.nvme.path or ctx.nvme.name, tier=ctx.nvme.name, size_bytes=placement.nvme_bytes) \
        if placement.nvme_bytes else None
    ax = ctx.profile.machine.axdimm
    out = OptimizerPlan(kind=training.optimizer, device=device, backend=ax.backend if device == "axdimm" else None,
                        channels=ax.channels if device == "axdimm" else None, overlap_backward=overlap,
                        micro_batches=micro, nvme=nvme,
                        states=axdimm.states(ctx.params, placement),
                        why=f"{placement.why}; Adam at {axdimm.rate_text(rates)}; {overlap_why}")
    if device == "axdimm" and ax.backend == "emulated":
        added = optimizer_bytes.added_host_bytes(ctx.profile, out, ctx.host.name)
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
                        nvme=NvmeOverflow(path=nvme.path or nvme.name, tier=nvme.name, size_bytes=total, grads=grads),
                        states=[StatePlacement(param=p.name, tier="nvme") for p in ctx.params])
    staging = optimizer_bytes.staging_bytes(ctx.profile, out)
    kept = (f"each gradient ({SIZE.format_short(sum(4 * p.num_params for p in ctx.params))} in all) is written "
            f"there too as backward makes it final and read back with its states, so host memory holds none "
            f"between backward and step (`.grad` is None then, and clipping brings them back first; this assumes the "
            f"script zeroes its gradients every step)" if grads else
            "its gradients stay there until it frees them, as in plain training")
    why = (f"to keep the DRAM budget: every state and fp32 master copy ({SIZE.format_short(total)}) on {nvme.name}, "
           f"read, updated and written back inside step() through {SIZE.format_short(staging)} of host staging, "
           f"after backward (updates of NVMe-held states do not overlap it); the script's "
           f"{optimizer_bytes.ADAM_STATE_BYTES_PER_PARAM} B/param of Adam states leave host memory; {kept}; Adam at "
           f"{axdimm.rate_text(ctx.rates('host'))}")
    return replace(out, why=why)


def _host_saves_nothing(ctx: Context, overlap: bool) -> str:
    n = sum(p.num_params for p in ctx.params)
    host = OptimizerPlan(kind=ctx.profile.training.optimizer, device="host", overlap_backward=overlap)
    states = optimizer_bytes.ADAM_STATE_BYTES_PER_PARAM * n
    adds = ("would update the parameters in place (their own bytes are its master copies)" if
            host.shares_master("host") else f"would add {SIZE.format_short(4 * n)} of fp32 master copies there")
    return (f"without a GPU the script's {ctx.profile.training.optimizer} already keeps its states in host memory "
            f"({SIZE.format_short(states)}); hetero's host Adam {adds} and save nothing, so the script's own optimizer "
            f"stays (--optimizer-device host uses hetero's, at {axdimm.rate_text(ctx.rates('host'))})")


def _placement(ctx: Context, device: str) -> axdimm.Placement:
    nvme = ctx.nvme.name if ctx.nvme else None
    if device == "axdimm":
        ax = ctx.profile.machine.axdimm
        return axdimm.place(ctx.params, ctx.update_order, ax.channels, ax.channel_capacity_bytes, nvme, "axdimm")
    room = max(0, ctx.dram_budget_bytes - ctx.host_model_bytes)
    return axdimm.place(ctx.params, ctx.update_order, 1, room, nvme, "host")
