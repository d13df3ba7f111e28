"""The GPU peak counted phase by phase (hetero.plan.gpu_peak), on the bench's model as the H100 ran it
(docs/gpu-results.md, 2026-11-27, second session, "Beyond a GPU budget": bench/gpu_offload.py at 14 blocks)."""

import dataclasses
import io
import tarfile
from pathlib import Path

import pytest
import yaml

from hetero.plan import backward, gpu_peak
from hetero.plan.context import context
from hetero.plan.gpu_layers import counted_budget_bytes
from hetero.plan.model import GPU
from hetero.plan.policy import POLICY
from hetero.plan.solve import PlanOptions, build, plan, predict, predicted_of
from hetero.schema import files
from hetero.schema.plan import Budget, LayerPlan, OptimizerPlan, Plan, Predicted, Source, StatePlacement
from hetero.schema.profile import Memory, Profile
from hetero.units import SIZE
from tests.plan.synthetic import GiB, MiB, gpt_profile

# bench/gpu_offload.py on the H100: plain training (AdamW fused) reserved 3.12GiB; hetero's run of the plan below
# held 662MiB; ZeRO-Offload-style held 1.17GiB, where the planner of that day refused
PLAIN_FUSED_RESERVED = int(3.12 * GiB)
PLAIN_STEP_S = 31.1e-3
HELD = 662 * MiB
ZERO = SIZE.parse("1.17GiB")
ARCHIVE = Path(__file__).parents[2] / "docs/gpu-artifacts/2026-11-27b/call1-gpu-check-work.tar.gz"


def measured(profile: Profile, reserved: int) -> Profile:
    """`profile` with plain training's step and reserved peak as measured (the host's peak was not: no DRAM budget
    binds here)."""
    return dataclasses.replace(profile, memory=Memory(dram_peak_bytes=4 * GiB, gpu_reserved_peak_bytes=reserved),
                               training=dataclasses.replace(profile.training, plain_iteration_s=PLAIN_STEP_S))


def bench(implementation: str) -> Profile:
    """The bench's model, its script's AdamW stepped as `implementation`. Plain training with the fused AdamW is what
    the bench measured; with another, torch reserves what its step adds to the count on top (not measured alone)."""
    fused = gpt_profile(implementation="fused")
    own = gpt_profile(implementation=implementation)
    added = gpu_peak.phases(own, gpu_peak.PLAIN).peak_bytes - gpu_peak.phases(fused, gpu_peak.PLAIN).peak_bytes
    return measured(own, PLAIN_FUSED_RESERVED + added)


def ran_on_the_h100(profile: Profile) -> Plan:
    """The plan hetero ran, written through the schema: every layer DHA but the tied `lm_head` (GFGB, no weight of
    its own), 28 of 88 layers' gradients to host memory (which 28 was not recorded: here the MLPs', the largest),
    Adam on the host, overlapping backward."""
    layers = [LayerPlan(name=x.name, mode="gfgb" if x.name == "lm_head" else "dha",
                        grad="host" if ".mlp." in x.name else "gpu") for x in profile.layers]
    states = [StatePlacement(param=name, tier="host") for x in profile.layers for name in x.param_names()]
    written = Plan(source=Source(profile="profile.yaml", profile_sha256=files.content_sha256(profile),
                                 model_fingerprint=profile.model.fingerprint),
                   budget=Budget(gpu_memory_bytes=SIZE.parse("1.42GiB"), dram_budget_bytes=None, reserve=0.5),
                   layers=layers, optimizer=OptimizerPlan(kind="adamw", device="host", overlap_backward=True,
                                                          states=states),
                   activations=None, routing=None, predicted=Predicted(iteration_s=0.0, peak_bytes={}),
                   omitted={"activations": "as it ran", "routing": "one process"})
    read = files.loads(files.dumps(written))
    return dataclasses.replace(read, predicted=predicted_of(profile, read, predict(profile, read)))


def test_the_synthetic_gpt_is_the_script_as_the_profiler_listed_it_on_an_h100():
    """gpt_profile's layers, parameters and saved storages are those `hetero profile` measured of
    examples/train_gpt.py on the H100 (make gpu-check's `fits` piece: 8 blocks of width 512, 8 heads, batch 8 x 256)."""
    with tarfile.open(ARCHIVE) as archive:
        real = yaml.safe_load(io.TextIOWrapper(archive.extractfile("./fits/profile.yaml")))
    synthetic = gpt_profile(n_layer=8, n_embd=512, n_head=8, vocab=4096, batch=8, seq=256)

    def size(v) -> int:
        return SIZE.parse(v) if isinstance(v, str) else v

    assert [(x["name"], x["type"], {k: size(v) for k, v in x["params"].items()}, size(x["saved"]),
             sorted(size(s) for s in x["saved_storages"])) for x in real["layers"]] == \
        [(x.name, x.type, x.params, x.saved_bytes, sorted(x.saved_storages_bytes)) for x in synthetic.layers]
    assert size(real["training"]["output"]) == synthetic.training.output_bytes


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_the_plan_that_ran_on_the_h100_is_predicted_within_a_tenth_of_what_it_held(implementation):
    """Weights in host memory and Adam on the host: the peak is backward's start, saved activations and the loss's
    tensors, plus what plain's reserved peak holds beyond its count; the script's Adam left with its scratch."""
    profile = bench(implementation)
    predicted = ran_on_the_h100(profile).predicted
    assert abs(predicted.peak_bytes[GPU] / HELD - 1) <= 0.10
    assert predicted.peak_bytes[GPU] == ran_on_the_h100(bench("fused")).predicted.peak_bytes[GPU]
    assert set(predicted.gpu) == {gpu_peak.SLACK, gpu_peak.BACKWARD_SAVED}  # only Linear layers' grads to host
    assert predicted.gpu[gpu_peak.SLACK] == gpu_peak.slack_bytes(profile)


def test_at_zeros_peak_the_planner_writes_one_plan_whatever_torch_steps_the_scripts_adam_by():
    """Where the planner of that day refused, it plans, the same plan for either script: with Adam off the GPU how
    torch stepped it there no longer matters."""
    plans = [plan(bench(how), PlanOptions(optimizer_device="host", gpu_memory_bytes=ZERO, reserve=0.5))
             for how in ("foreach", "fused")]
    assert all(p.predicted.peak_bytes[GPU] <= ZERO * (1 - POLICY.gpu_headroom) for p in plans)
    assert plans[0].layers == plans[1].layers and plans[0].activations == plans[1].activations


def test_each_phase_holds_what_the_plan_keeps_on_the_gpu_then():
    profile = gpt_profile(implementation="foreach")
    params = [b for x in profile.layers for b in x.params.values()]
    model, out = sum(params), profile.training.output_bytes
    plain = gpu_peak.phases(profile, gpu_peak.PLAIN)
    assert plain.step == {gpu_peak.WEIGHTS: model, gpu_peak.STATES: 2 * model, gpu_peak.STEP_GRADS: model,
                          gpu_peak.SCRATCH: model}
    assert plain.backward[gpu_peak.BACKWARD_SAVED] == backward.peak_bytes(profile.layers, backward.Held(), out)
    assert plain.forward[gpu_peak.FORWARD_SAVED] == sum(x.saved_bytes for x in profile.layers) + out
    assert plain.peak == plain.step  # the foreach step: every gradient, the states and a scratch of the model

    mlp = frozenset(x.name for x in profile.layers if ".mlp." in x.name)
    off = gpu_peak.phases(profile, gpu_peak.OnGpu(dha=frozenset(x.name for x in profile.layers), host_grads=mlp,
                                                  adam="off"))
    assert off.step == {gpu_peak.WEIGHTS: 0, gpu_peak.STATES: 0, gpu_peak.SCRATCH: 0,
                        gpu_peak.STEP_GRADS: sum(x.params_bytes for x in profile.layers if x.name not in mlp)}
    assert off.peak == off.backward  # the activations at backward's start outweigh the gradients kept


def test_tiering_lowers_the_prediction_only_where_saved_activations_make_the_peak():
    """At most the simulator's peak of saved activations is on the GPU at once: the peak at backward's start drops
    by at most what tiering takes off them (the gradients made meanwhile may make it later); the step's, not."""
    profile = measured(gpt_profile(implementation="foreach"), PLAIN_FUSED_RESERVED)
    mlp = frozenset(x.name for x in profile.layers if ".mlp." in x.name)
    at_start = gpu_peak.OnGpu(dha=frozenset(x.name for x in profile.layers), host_grads=mlp, adam="off")
    cap = sum(x.saved_bytes for x in profile.layers) - 64 * MiB
    for held, lowered in ((at_start, True), (gpu_peak.PLAIN, False)):
        tiered = dataclasses.replace(held, saved_cap=cap)
        saved = gpu_peak.predicted_bytes(profile, held) - gpu_peak.predicted_bytes(profile, tiered)
        assert 0 < saved <= 64 * MiB if lowered else saved == 0
        assert (gpu_peak.EVICTED in gpu_peak.contributors(profile, tiered)) == lowered


def test_an_optimizer_the_plan_leaves_to_the_script_keeps_its_states_and_scratch_on_the_gpu():
    profile = gpt_profile(implementation="foreach")
    model = sum(x.params_bytes for x in profile.layers)
    off = gpu_peak.OnGpu(adam="off")
    assert gpu_peak.phases(profile, off).step[gpu_peak.STATES] == 0
    kept = dataclasses.replace(profile.training.optimizers[0], kept="amsgrad")
    profile.training.optimizers = [kept]
    step = gpu_peak.phases(profile, off).step
    assert (step[gpu_peak.STATES], step[gpu_peak.SCRATCH]) == (2 * model, model)


def test_gradients_of_earlier_micro_batches_are_held_from_forward_on():
    profile = gpt_profile(implementation="fused")
    profile.training.grad_accumulation = 4
    model = sum(x.params_bytes for x in profile.layers)
    counted = gpu_peak.phases(profile, gpu_peak.PLAIN)
    assert counted.forward[gpu_peak.EARLIER_GRADS] == counted.backward[gpu_peak.EARLIER_GRADS] == model


def test_without_a_measurement_the_count_is_the_prediction_and_with_one_plain_is_predicted_as_measured():
    profile = gpt_profile(implementation="foreach")
    assert gpu_peak.predicted_bytes(profile, gpu_peak.PLAIN) == gpu_peak.phases(profile, gpu_peak.PLAIN).peak_bytes
    profile = bench("foreach")
    assert gpu_peak.predicted_bytes(profile, gpu_peak.PLAIN) == profile.memory.gpu_reserved_peak_bytes
    assert plan(profile, PlanOptions()).predicted.peak_bytes[GPU] == profile.memory.gpu_reserved_peak_bytes


def test_memferrys_search_compares_counts_that_keep_the_prediction_within_the_budget():
    """The simulator's count and the prediction differ by the same bytes whatever the modes, for given gradient
    places: the search's budget is the prediction's, translated on the plan with every layer resident."""
    profile = bench("foreach")
    ctx = context(profile, PlanOptions(optimizer_device="host"))
    ran = ran_on_the_h100(profile)
    grads = [e.grad for e in ran.layers]
    counted = counted_budget_bytes(ctx, ran, grads, lambda p: build(profile, p), ZERO)
    for modes in (["dha"] * 88, ["gfgb"] * 88, ["gfgb", "dha"] * 44):
        placed = dataclasses.replace(ran, layers=[dataclasses.replace(e, mode=m) for e, m in zip(ran.layers, modes)])
        result = predict(profile, placed)
        assert ZERO - counted == predicted_of(profile, placed, result).peak_bytes[GPU] - result.peak_bytes[GPU]
