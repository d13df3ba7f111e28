"""hetero.schema.names: the layers and parameters a plan names, checked against its profile; the update buckets."""

from hetero.schema import files
from hetero.schema.names import UPDATE_BUCKETS, UpdateBuckets, unknown_names, update_buckets
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


def test_buckets_fill_with_whole_modules_in_backward_order():
    """A 4-element target: the last module first, then modules added while they fit; one larger than the target is
    a bucket alone; a module's weight and bias are never split."""
    params = [("a.weight", 1), ("a.bias", 1), ("b.weight", 2), ("c.weight", 6), ("d.weight", 1), ("d.bias", 1),
              ("e.weight", 1)]
    of = update_buckets(params, UpdateBuckets(target_bytes=4 * 4))
    assert of == {"e.weight": 0, "d.weight": 0, "d.bias": 0, "c.weight": 1, "b.weight": 2, "a.weight": 2,
                  "a.bias": 2}


def test_small_modules_share_one_bucket_by_default_and_large_ones_have_their_own():
    small = [(f"h.{k}.{local}", 1000) for k in range(50) for local in ("weight", "bias")]
    assert set(update_buckets(small).values()) == {0}
    full = UPDATE_BUCKETS.target_bytes // 4
    of = update_buckets([("", 10), ("h.0.weight", full - 10), ("h.1.weight", full), ("head.weight", 1)])
    assert of == {"head.weight": 0, "h.1.weight": 1, "h.0.weight": 2, "": 2}


def test_a_modules_parameters_stay_together_where_the_list_parts_them():
    params = [("x.weight", 3), ("y.weight", 3), ("x.bias", 1)]
    assert update_buckets(params, UpdateBuckets(target_bytes=4 * 4)) == {"x.bias": 0, "x.weight": 0, "y.weight": 1}
