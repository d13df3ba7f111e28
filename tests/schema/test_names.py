"""hetero.schema.names: the layers and parameters a plan names, checked against its profile."""

from hetero.schema import files
from hetero.schema.names import unknown_names
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from tests.conftest import REPO

PLAN, PROFILE = REPO / "plans" / "gpt-tiny-cpu.plan.yaml", REPO / "plans" / "gpt-tiny-cpu.profile.yaml"


def test_a_plan_names_only_what_its_profile_has():
    assert unknown_names(files.load(PLAN, expect=Plan), files.load(PROFILE, expect=Profile)) == []


def test_a_misspelt_parameter_is_found_with_its_path_and_the_likely_name():
    plan, profile = files.load(PLAN, expect=Plan), files.load(PROFILE, expect=Profile)
    real = plan.optimizer.states[2].param
    plan.optimizer.states[2].param = real[:-1]
    [(path, message)] = unknown_names(plan, profile)
    assert path == "optimizer.states[2].param"
    assert message.index(repr(real[:-1])) < message.index(repr(real))  # the name given, then the one meant


def test_a_layer_name_is_not_a_parameter_name():
    plan, profile = files.load(PLAN, expect=Plan), files.load(PROFILE, expect=Profile)
    plan.optimizer.states[0].param = profile.layers[0].name  # a layer, not one of its parameters
    [(path, message)] = unknown_names(plan, profile)
    assert path == "optimizer.states[0].param"
    assert repr(profile.layers[0].name) in message
