"""Plain training as the profile measured it, and a GPU plan's predictions anchored on it.

The simulator counts what a plan places (parameters, gradients, saved activations, optimizer states) and what it
times (kernels, copies, updates); a process pays for more: the caching allocator's reserve, workspaces, temporaries
of backward, the launch gaps of a real step. So on a GPU a plan's prediction starts from plain training's measured
figures and adds what the plan changes: its GPU peak is torch's reserved peak of plain training (what the process
holds from the GPU) plus the difference, item by item, between the plan's count and plain training's. On every
device a plan's iteration is plain training's measured step plus the simulated difference. A plan that moves
nothing is predicted exactly as measured. Where the profile has no measurement (an older profile), the count itself
is the prediction, the script's own Adam states included.
"""

from __future__ import annotations

from hetero.plan.backward import ADAM_TEMPORARIES, Held, peak_bytes
from hetero.plan.model import GPU
from hetero.plan.simulate import Result
from hetero.schema.plan import LayerGrad, LayerMode, Plan
from hetero.schema.profile import Profile

PLAIN_MEASURED = "plain training (measured reserved peak)"
PLAIN_COUNTED = "plain training (counted: parameters, gradients, activations, adam states)"
OWN_STATES = "script's adam states moved off the gpu"
OWN_SCRATCH = "script's adam step scratch moved off the gpu"
HETERO_STATES = "hetero's adam states on the gpu"
PARAMS = "parameters read from host memory (dha)"
GRADS = "gradients written to host memory"
ACTIVATIONS = "activations evicted to host memory"
TRANSIENT_GRAD = "a host gradient made on the gpu first (the largest, briefly)"


def own_gpu_states(profile: Profile) -> int:
    """Bytes of the script's own Adam(W) states on the GPU under plain training: exp_avg and exp_avg_sq in the
    parameters' dtype (0 without a GPU, or for another optimizer, whose states never move)."""
    if profile.machine.gpu is None or profile.training.optimizer == "other":
        return 0
    return 2 * sum(x.params_bytes for x in profile.layers)


def own_gpu_scratch(profile: Profile) -> int:
    """Bytes the script's own Adam(W) steps make on the GPU beside its states, by how torch steps it
    (`ScriptOptimizer.implementation`): a foreach step's scratch the size of every parameter it updates, a single
    tensor's temporaries the size of the largest, a fused step's none. Where plain's measured peak is its step, that
    scratch is in it, and a plan that moves the optimizer off the GPU takes it away."""
    if profile.machine.gpu is None:
        return 0
    out = 0
    for o in profile.training.optimizers or [None]:
        if o is not None and (o.kind == "other" or o.kept):
            continue
        params = [b for x in profile.layers if o is None or x.model in (None, o.model) for b in x.params.values()]
        implementation = o.implementation if o is not None else "single"
        out += {"foreach": sum(params), "fused": 0}.get(implementation, ADAM_TEMPORARIES * max(params, default=0))
    return out


def _scratch_at_peak(profile: Profile) -> int:
    """What the script's Adam step scratch adds to plain training's peak: its step holds every gradient and the
    scratch, backward its saved activations and the gradients made so far; the scratch counts only above backward."""
    grads = sum(x.params_bytes for x in profile.layers)
    backward = backward_peak_bytes(profile, set())
    return max(backward, grads + own_gpu_scratch(profile)) - max(backward, grads)


def gpu_contributors(profile: Profile, plan: Plan, result: Result, plain: Result,
                     hetero_states_bytes: int) -> dict[str, int]:
    """The predicted GPU peak by what makes it up (its sum is the prediction; negative items are what the plan
    moves off the GPU). `result` and `plain` are the simulated plan and plain training; `hetero_states_bytes` what
    the plan's own optimizer keeps on the GPU (`optimizer.device: gpu`)."""
    own = own_gpu_states(profile)
    measured = profile.memory.gpu_reserved_peak_bytes if profile.memory is not None else None
    out = {PLAIN_MEASURED: measured} if measured else {PLAIN_COUNTED: plain.peak_bytes.get(GPU, 0) + own}
    opt = plan.optimizer
    if opt is not None:
        out[OWN_STATES] = -own
        out[OWN_SCRATCH] = -_scratch_at_peak(profile) if measured and opt.device != "gpu" else 0
        out[HETERO_STATES] = hetero_states_bytes
    offloaded = opt is not None and opt.device != "gpu"
    by_name = {x.name: x.params_bytes for x in profile.layers}
    out[PARAMS] = -sum(by_name.get(e.name, 0) for e in plan.layers if e.mode == LayerMode.DHA) if offloaded else 0
    host = {e.name for e in plan.layers if e.grad == LayerGrad.HOST} if offloaded else set()
    out[GRADS] = backward_peak_bytes(profile, host) - backward_peak_bytes(profile, set())
    out[TRANSIENT_GRAD] = _transient_grad_bytes(profile, plan) if offloaded else 0
    fast_is_gpu = plan.activations is None or plan.activations.fast == GPU
    out[ACTIVATIONS] = result.act_peak_bytes - plain.act_peak_bytes if fast_is_gpu else 0
    return {what: b for what, b in out.items() if b}


def backward_peak_bytes(profile: Profile, host_grads: set[str]) -> int:
    """Saved activations and gradients on the GPU at their highest through backward, gradients of `host_grads`
    layers written to host memory instead (hetero.plan.backward). Moving gradients saves at plain training's peak
    only what coexists with the activations still saved: nothing where backward's start, before any gradient exists,
    is the peak."""
    return peak_bytes(profile.layers, Held(gone_grads=frozenset(host_grads)), profile.training.output_bytes)


def _transient_grad_bytes(profile: Profile, plan: Plan) -> int:
    """Backward writes a Linear layer's gradients into host memory itself (hetero.run.grad_offload); any other
    layer's host gradient is made on the GPU and copied down, one parameter at a time."""
    host = {e.name for e in plan.layers if e.grad == LayerGrad.HOST}
    return max((b for x in profile.layers if x.name in host and x.type != "Linear" for b in x.params.values()),
               default=0)


def anchored_iteration_s(profile: Profile, simulated_s: float, plain_simulated_s: float) -> float:
    """A plan's iteration: plain training's measured step (on a GPU timed without the profiler's hooks, whose launch
    gaps a CPU's kernels hide) plus the simulated difference, so that a plan that moves nothing is predicted as
    measured, however the simulator counts the script's steps (a GAN's three backward calls); the simulation as is
    where a GPU's plain step was not timed."""
    t = profile.training
    measured = t.plain_iteration_s if profile.machine.gpu is not None else t.iteration_s
    if measured is None:  # a GPU's plain step untimed (an older profile, a single warm-up step)
        return simulated_s
    return max(0.0, measured + simulated_s - plain_simulated_s)


def counted_budget_bytes(profile: Profile, bare: Plan, budget_bytes: int, plain: Result) -> int:
    """The GPU budget in the simulator's count, for the searches that compare counts (MemFerry's modes): what
    the count of an offloading plan may reach so that its anchored prediction stays within `budget_bytes`. `bare`:
    the plan with nothing moved (hetero.plan.sections.plain_of), `plain` its simulated iteration."""
    base = sum(gpu_contributors(profile, bare, plain, plain, 0).values())
    return budget_bytes - base + plain.peak_bytes.get(GPU, 0) + own_gpu_states(profile)
