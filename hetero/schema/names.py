"""The names a plan uses, checked against its profile: a layer or parameter name the profile does not have (a typo
in an edited plan) is found by `hetero check`, not at run time once the model is built; and the one rule that groups
parameters by name, which the planner and the runtime both follow. Pure: no torch, no I/O."""

from __future__ import annotations

from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from hetero.schema.yaml_read import did_you_mean


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


def update_bucket(param: str) -> str:
    """The bucket of a parameter's update, by its qualified name (as in `model.named_parameters()`): the module that
    owns it directly, its name up to the last dot ('' for the root module's own). hetero's host Adam updates a
    bucket in one fused call once all of its gradients are final (hetero.run.offloaded_adam), and the planner
    prices one call per bucket (hetero.plan.axdimm)."""
    return param.rpartition(".")[0]
