"""Optimizer-state placement: balanced round-robin over channels, NVMe overflow of the last-updated, host, gpu."""

from dataclasses import replace

import pytest

from hetero.errors import USAGE, HeteroError
from hetero.plan import axdimm, tiering
from hetero.plan.sections.layers import ON_GPU
from hetero.plan.solve import PlanOptions, build, plan, predict
from hetero.schema import files
from hetero.schema.names import UpdateBuckets, update_buckets
from hetero.schema.plan import StatePlacement
from hetero.schema.profile import Profile
from tests.figures import figures
from tests.plan.synthetic import GiB, curve, gpu_profile


def params(*counts):
    return [axdimm.Param(name=f"p{k}", layer=k, num_params=n) for k, n in enumerate(counts)]


def test_round_robin_by_bytes_balances_alternating_weights_and_biases():
    ps = params(800, 100, 800, 100, 800, 100)
    placed = axdimm.place(ps, list(range(6))[::-1], 2, GiB, "nvme0", "axdimm")
    assert placed.channels == [0, 1, 1, 0, 0, 1]  # a plain turn-by-turn would put every weight on channel 0
    assert placed.channel_bytes == [1700 * 16, 1000 * 16]
    assert figures(placed.why) == ['2x', '1GiB', '42.2KiB', '16B/param', '0', '26.6KiB', '1', '15.6KiB']


def test_overflow_goes_to_nvme_for_the_parameters_updated_last():
    """Ten tensors of 1600 B of states, 2 x 6400 B of channels: staging for two of the largest spilled tensors
    (3200 B) leaves 9600 B, so the six updated first (the last layers) stay; layers 0-3 go to NVMe."""
    ps = params(*[100] * 10)
    placed = axdimm.place(ps, list(range(10))[::-1], 2, 6400, "nvme0", "axdimm")
    assert placed.tiers == ["nvme0"] * 4 + ["axdimm"] * 6
    assert (placed.nvme_bytes, placed.staging_bytes, placed.channel_bytes) == (6400, 3200, [4800, 4800])
    assert all(b <= 6400 - 1600 for b in placed.channel_bytes)  # each channel keeps its half of the staging
    assert figures(placed.why)[:8] == ['15.6KiB', '2x', '6.25KiB', '4', '6.25KiB', '0', '2', '1.56KiB']
    assert placed.channels[4:] == [1, 0, 1, 0, 1, 0]  # by room, in update order (layer 9 first)
    states = axdimm.states(ps, placed)
    assert [s.tier for s in states[:5]] == ["nvme"] * 4 + ["axdimm"] and states[0].channel is None


def test_no_room_and_no_nvme_is_an_error_with_a_hint():
    with pytest.raises(HeteroError, match="do not fit in axdimm") as e:
        axdimm.place(params(1000), [0], 2, 100, None, "axdimm")
    assert "nvme tier" in e.value.hint


def test_host_placement():
    placed = axdimm.place(params(1000, 10), [1, 0], 1, 10**6, "nvme0", "host")
    assert placed.tiers == ["host", "host"] and placed.channels == [None, None]
    assert figures(placed.why) == ['15.8KiB', '16B/param', '977KiB']


def test_nvme_reads_and_their_waits_in_the_simulated_iteration():
    """The spilled states are read in step(), as the runtime does, in parameter order, two staging slots at a time:
    each update waits for its read where the drive is slower than Adam, so a faster drive shortens the wait and the
    iteration, and even the fastest cannot hide the first read (the prediction says so)."""
    profile = gpu_profile(20, seed=5, axdimm=True)
    for x in profile.layers:
        x.params, x.num_params = {"weight": 8 * 2**20}, 2 * 2**20
    profile.machine.axdimm.channel_capacity_bytes = 128 * 2**20  # 32 MiB of states each: room for six of twenty
    profile.machine.axdimm.adam_params_per_s = 4e9  # Adam keeps up: staging slots free up as gradients arrive
    slow = predict(profile, plan(profile, PlanOptions(emulate=True)))
    nvme = profile.machine.tiers[1]
    nvme.read, nvme.write = curve(100e9, 80e-6), curve(100e9, 60e-6)
    p = plan(profile, PlanOptions(emulate=True))
    opt = p.optimizer
    assert opt.device == "axdimm" and opt.nvme.size_bytes > 0 and opt.nvme.path == "/tmp/hetero-nvme"
    on_nvme = [s.param for s in opt.states if s.tier == "nvme"]
    assert on_nvme == [f"layer{k}.weight" for k in range(14)]  # the first layers: updated last
    for c in range(2):
        assert sum(16 * profile.layers[int(s.param[5:-7])].num_params for s in opt.states if s.channel == c) \
            <= profile.machine.axdimm.channel_capacity_bytes
    result = predict(profile, p)
    assert 0 < result.nvme_late_s < slow.nvme_late_s and result.iteration_s < slow.iteration_s
    assert result.peak_bytes["nvme0"] >= opt.nvme.size_bytes


def test_gpu_and_host_devices():
    profile = gpu_profile(4, seed=2)
    gpu = plan(profile, PlanOptions(optimizer_device="gpu"))
    assert {s.tier for s in gpu.optimizer.states} == {"gpu"}
    assert gpu.layers == [] and gpu.omitted["layers"] == ON_GPU
    host = plan(profile, PlanOptions(optimizer_device="host"))
    assert {s.tier for s in host.optimizer.states} == {"host"}
    assert host.optimizer.nvme is None  # all states fit in host memory
    with pytest.raises(HeteroError) as e:
        plan(profile, PlanOptions(optimizer_device="gpu", gpu_memory_bytes=2**20))
    assert e.value.exit_code == USAGE and "--gpu-memory" in e.value.hint
    assert "--optimizer-device gpu" in e.value.hint  # the option that keeps the optimizer on the GPU


def test_each_update_on_a_channel_pays_the_launch_cost():
    """An update's time is the channel's fixed cost (mode switches, launch, status) plus its size at the rate: small
    tensors (biases, norms) cost their launch, which the rate alone would call free."""
    rates = axdimm.Rates(adam_params_per_s=1e9, lanes=["axdimm ch0", "axdimm ch1"], launch_s=2e-4)
    ps = params(1000, 4_000_000)
    placed = [StatePlacement(param=p.name, tier="axdimm", channel=k % 2) for k, p in enumerate(ps)]
    first, second = axdimm.updates(ps, placed, 2, rates)
    assert first[0].update_s == pytest.approx(2e-4 + 1e-6) and first[0].lane == 0
    assert second[0].update_s == pytest.approx(2e-4 + 4e-3) and second[0].lane == 1


def test_where_the_cpu_computes_workers_are_timed_as_measured_beside_compute(repo):
    profile = files.load(repo / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile)
    x, disk = profile.machine.axdimm, profile.machine.tiers[1]
    r = axdimm.rates(profile, "axdimm")
    assert (r.adam_params_per_s, r.launch_s) == (x.adam_beside_compute_params_per_s, x.launch_beside_compute_s)
    evict, prefetch = tiering.curves(profile, disk.name)
    assert evict.times == tuple(p.time_s for p in disk.write_beside_compute)
    assert (r.nvme_read, r.nvme_write) == (prefetch, evict)  # one disk, the same workers' times
    profile.machine.axdimm = replace(x, adam_beside_compute_params_per_s=None, launch_beside_compute_s=None)
    profile.machine.tiers[1] = replace(disk, read_beside_compute=[], write_beside_compute=[])  # a GPU computes
    alone = axdimm.rates(profile, "axdimm")
    assert (alone.adam_params_per_s, alone.launch_s) == (x.adam_params_per_s, x.launch_s)
    assert tiering.curves(profile, disk.name)[1].times == tuple(p.time_s for p in disk.read)


def test_host_adam_runs_on_its_driver_lane_and_slows_cpu_compute_as_measured(repo):
    profile = files.load(repo / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile)
    c = profile.machine.cpu
    r = axdimm.rates(profile, "host")
    assert r.lanes == ["host adam"]
    assert (r.adam_params_per_s, r.launch_s) == (c.adam_beside_compute_params_per_s, c.adam_launch_beside_compute_s)
    hosted = plan(profile, PlanOptions(reserve=0.5, optimizer_device="host"))
    costs, ch = build(profile, hosted)
    assert ch.cpu_share["host adam"] == c.adam_cpu
    assert all(u.lane == 0 for layer in ch.updates for u in layer)  # never on the compute lane
    spans = predict(profile, hosted, record=True).spans
    assert any(s.lane == "host adam" for s in spans) and not any(s.lane == "compute" and "adam" in s.name
                                                                 for s in spans)


def module_params(*modules: tuple[str, list[int]]) -> list[axdimm.Param]:
    """Parameters by module, in order: ("h.0", [weight, bias]) is h.0.weight and h.0.bias of layer k; "" the root's."""
    return [axdimm.Param(name=f"{m}.{local}" if m else local, layer=k, num_params=n)
            for k, (m, counts) in enumerate(modules) for local, n in zip(("weight", "bias", "scale"), counts)]


HOST = axdimm.Rates(adam_params_per_s=1e9, lanes=["host adam"], launch_s=2e-4, bucketed=True)


def test_host_adam_pays_one_call_per_bucket_and_one_per_nvme_staged_parameter():
    """The runtime's host Adam makes one fused call per bucket (hetero.schema.names.update_buckets: small modules
    share one), and stages NVMe-held states one parameter at a time: the planner prices the same calls, each with
    the layer of its bucket's first parameter in forward order (whose gradient becomes final last)."""
    ps = module_params(("h.0", [4000, 1000]), ("h.1", [4000, 1000]), ("", [10]))
    placed = [StatePlacement(param=p.name, tier="nvme" if p.name.startswith("h.1") else "host") for p in ps]
    profile = gpu_profile(3)
    disk = axdimm.nvme_tier(profile)
    rates = replace(HOST, nvme_read=tiering.disk_curves(disk)[1], nvme_write=tiering.disk_curves(disk)[0])
    first, second, root = axdimm.updates(ps, placed, 3, rates)
    assert [u.update_s for u in first] == [pytest.approx(2e-4 + 5010 / 1e9)]  # h.0 and the root's: one call
    assert [u.update_s for u in second] == [pytest.approx(2e-4 + 4000 / 1e9), pytest.approx(2e-4 + 1000 / 1e9)]
    assert all(u.nvme_bytes for u in second) and root == []
    channels = axdimm.updates(ps[:2], [StatePlacement(param=p.name, tier="axdimm", channel=0) for p in ps[:2]], 1,
                              replace(HOST, bucketed=False))
    assert len(channels[0]) == 2  # an AXDIMM channel launches each parameter's update on its own


def test_small_modules_cost_one_call_as_the_same_parameters_in_one_module():
    many = module_params(*((f"blocks.{k}.norm", [600, 400]) for k in range(16)))
    few = module_params(("blocks.0.mlp", [12_000, 4000]))
    cost = {}
    for name, ps in (("many", many), ("few", few)):
        placed = [StatePlacement(param=p.name, tier="host") for p in ps]
        cost[name] = sum(u.update_s for per in axdimm.updates(ps, placed, len(ps), HOST) for u in per)
    assert sum(p.num_params for p in many) == sum(p.num_params for p in few)
    assert cost["many"] == pytest.approx(2e-4 + 16_000 / 1e9) == cost["few"]


def test_buckets_beyond_the_target_size_are_calls_of_their_own():
    """4 modules of 1000 elements, a target of 2 of them: 2 calls, modules taken from the last one back."""
    ps = module_params(*((f"blocks.{k}.norm", [600, 400]) for k in range(4)))
    where = {p.name: StatePlacement(param=p.name, tier="host") for p in ps}
    made = axdimm.calls(ps, where, bucketed=True, policy=UpdateBuckets(target_bytes=2 * 4000))
    assert [[p.name for p in call] for call in made] == [[p.name for p in ps[:4]], [p.name for p in ps[4:]]]


def host_profile(num_params: int, cache: int | None = 32 * 2**20, beyond: float | None = 1.5e9):
    """A GPU profile whose host Adam runs at 5G params/s on states a cache holds and at `beyond` on others."""
    profile = gpu_profile(4, seed=2)
    profile.model.num_params = num_params
    profile.machine.cpu = replace(profile.machine.cpu, adam_params_per_s=5e9, adam_launch_s=2.5e-4,
                                  adam_beyond_cache_params_per_s=beyond, last_level_cache_bytes=cache)
    return profile


def test_a_model_whose_states_exceed_the_last_level_cache_is_priced_at_the_rate_beyond_it():
    large = axdimm.rates(host_profile(185_000_000), "host")
    assert (large.adam_params_per_s, large.launch_s, large.bucketed) == (1.5e9, 2.5e-4, True)
    assert "2.76GiB of states, beyond the 32MiB last-level cache" in axdimm.rate_text(large)
    assert "per call (one per bucket)" in axdimm.rate_text(large)
    small = axdimm.rates(host_profile(1_000_000), "host")  # 15 MiB of states: the cache holds them
    assert small.adam_params_per_s == 5e9 and "within the 32MiB" in small.note
    assert axdimm.rates(host_profile(1_000_000, cache=None), "host").adam_params_per_s == 1.5e9  # cache unknown
    older = axdimm.rates(host_profile(185_000_000, cache=None, beyond=None), "host")  # profiled before it was timed
    assert older.adam_params_per_s == 5e9 and older.note == ""


def test_beside_compute_beyond_the_cache_host_adam_runs_no_faster_than_alone_there():
    cpu = replace(host_profile(0).machine.cpu, adam_beside_compute_params_per_s=2e9)
    assert axdimm.host_rate(cpu, 185_000_000, beside=True) == 1.5e9
    assert axdimm.host_rate(cpu, 1_000_000, beside=True) == 2e9
    assert axdimm.host_rate(replace(cpu, adam_beyond_cache_params_per_s=3e9), 185_000_000, beside=True) == 2e9


def test_the_simulated_iteration_runs_one_host_adam_call_per_bucket():
    profile = gpu_profile(6, seed=3)
    for x in profile.layers:  # a weight and a bias per layer
        x.params = {"weight": x.params["weight"], "bias": 4096}
        x.num_params += 1024
    profile.model.num_params = sum(x.num_params for x in profile.layers)
    hosted = plan(profile, PlanOptions(optimizer_device="host", gpu_memory_bytes=GiB, reserve=0.0))
    assert hosted.optimizer.device == "host" and {s.tier for s in hosted.optimizer.states} == {"host"}
    adam = [s for s in predict(profile, hosted, record=True).spans if s.lane == "host adam"]
    of = update_buckets([(p.name, p.num_params) for p in axdimm.params(profile)])
    assert len(adam) == len(set(of.values())) < len(profile.layers)  # not one per parameter, nor per module
