"""The names a plan uses, checked against its profile (a typo in an edited plan is found by `hetero check`, not at
run time), and the one rule grouping parameters' updates into buckets, for the planner and the runtime. Pure."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from hetero.schema.yaml_read import did_you_mean

FP32_BYTES = 4


def unknown_names(plan: Plan, profile: Profile) -> list[tuple[str, str]]:
    """(YAML path in the plan, message) for each layer or parameter the plan names that `profile` does not have."""
    layers = [layer.name for layer in profile.layers]
    params = [name for layer in profile.layers for name in layer.param_names()]
    named: list[tuple[str, str | None, list[str], str]] = [
        (f"layers[{i}].name", entry.name, layers, "layer") for i, entry in enumerate(plan.layers)]
    if plan.activations is not None:
        for i, e in enumerate(plan.activations.schedule):
            named += [(f"activations.schedule[{i}].layer", e.layer, layers, "layer"),
                      (f"activations.schedule[{i}].prefetch_after", e.prefetch_after, layers, "layer")]
    if plan.optimizer is not None:
        named += [(f"optimizer.states[{i}].param", s.param, params, "parameter")
                  for i, s in enumerate(plan.optimizer.states)]
    known = {id(layers): set(layers), id(params): set(params)}
    return [(path, f"no {what} {name!r} in the profile" + did_you_mean(name, names))
            for path, name, names, what in named if name is not None and name not in known[id(names)]]


@dataclass(frozen=True, slots=True)
class UpdateBuckets:
    """How hetero's host Adam groups parameters' updates into buckets, each one fused call once all of its
    gradients are final (hetero.run.offloaded_adam); the planner prices one call per bucket (hetero.plan.axdimm)."""

    # fp32 parameter bytes a bucket fills up to: large enough that a call's fixed cost is small beside its work,
    # small enough that the first buckets run while backward still computes the rest
    target_bytes: int = 32 << 20


UPDATE_BUCKETS = UpdateBuckets()


def update_buckets(params: list[tuple[str, int]], policy: UpdateBuckets = UPDATE_BUCKETS) -> dict[str, int]:
    """Each parameter's bucket (0 first), from (qualified name, element count) in forward order. Buckets are filled
    in backward order with whole modules' parameters (never split) while their fp32 bytes stay within
    `policy.target_bytes`; a module larger than that is a bucket alone."""
    module_bytes: dict[str, int] = defaultdict(int)
    for name, numel in params:
        module_bytes[_module(name)] += FP32_BYTES * numel
    of_module: dict[str, int] = {}
    bucket, filled = 0, 0
    for name, _ in reversed(params):
        module = _module(name)
        if module in of_module:
            continue
        if filled and filled + module_bytes[module] > policy.target_bytes:
            bucket, filled = bucket + 1, 0
        of_module[module] = bucket
        filled += module_bytes[module]
    return {name: of_module[_module(name)] for name, _ in params}


def _module(param: str) -> str:
    """The module that owns a parameter directly: its name up to the last dot ('' for the root module's own)."""
    return param.rpartition(".")[0]
