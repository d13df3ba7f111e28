"""The simulator: curves, a timeline worked by hand, stalls, NVMe staging, memory peaks, the trace, background
work slowing compute without a GPU."""

import dataclasses
import json
import random

import pytest

from hetero.plan.choices import build
from hetero.plan.model import Choices, Costs, Curve, LayerCosts, Update, costs
from hetero.plan.simulate import chrome_trace, simulate
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import CurvePoint, Profile
from tests.plan.synthetic import gpu_profile

MS = 1e-3


def points(*pairs):
    return [CurvePoint(size_bytes=s, time_s=t) for s, t in pairs]


def test_curve_interpolates_floors_and_extrapolates():
    c = Curve.of(points((1000, 1e-6), (2000, 1.5e-6), (4000, 2e-6)))
    assert c.time_s(0) == 0
    assert c.time_s(10) == 1e-6  # never below the smallest measured transfer (its latency)
    assert c.time_s(1500) == pytest.approx(1.25e-6)
    assert c.time_s(8000) == pytest.approx(3e-6)  # the last segment's 4 GB/s beyond the last point
    assert c.peak_rate == pytest.approx(2e9)


def test_curve_is_made_monotone_and_inverts_exactly():
    c = Curve.of(points((4096, 5e-6), (65536, 4e-6), (2**20, 60e-6), (2**24, 1e-3)))  # a noisy median at 64 KiB
    assert c.times[1] == 5e-6
    rng = random.Random(0)
    for _ in range(300):
        t = rng.uniform(0, 3e-3)
        size = c.size_within(t)
        assert c.time_s(size) <= t
        assert size == 0 or c.time_s(size + 1) > t or c.times[1] == c.times[0]
    assert c.size_within(4e-6) == 0


def layer(name, fp_ms, bp_ms, size=1000, saved=0, gap_ms=0.0):
    return LayerCosts(name=name, params_bytes=size, num_params=size // 4, saved_bytes=saved, fp_s=fp_ms * MS,
                      bp_s=bp_ms * MS, fp_dha_s=None, bp_dha_s=None, bp_grad_host_s=None, copy_s=0.0, grad_copy_s=0.0,
                      fp_gap_s=gap_ms * MS, bp_gap_s=gap_ms * MS)


def cpu_case(updates, overlap=True, evict=(0, 0), trigger=(None, None), at=(0.0, 0.0), lanes=("ch0",), staging=0):
    c = Costs(layers=[layer("a", 1, 2, saved=4000), layer("b", 2, 4, saved=8000, gap_ms=0.5)], bp_order=[1, 0],
              tail_s=3 * MS, micro_batches=1, has_gpu=False, evict=Curve.linear(4e6), prefetch=Curve.linear(2e6))
    ch = Choices(modes=["gfgb"] * 2, grads=["gpu"] * 2, evict_bytes=list(evict), trigger=list(trigger),
                 prefetch_at_s=list(at), updates=updates, lanes=list(lanes), overlap_backward=overlap,
                 grads_to_host=True, params_on_gpu=False, staging_bytes=staging, fast="dram", slow="nvme0",
                 static_bytes={"dram": 100})
    return c, ch


def test_cpu_timeline_by_hand():
    """Forward a 0-1, gap 0.5, b 1.5-3.5; backward b 4-8 (after its 0.5 ms gap), a 8-10; b's update on the channel
    8-9 overlaps a's backward; a's 10-11; then the 3 ms tail: 14 ms."""
    c, ch = cpu_case([[Update(lane=0, update_s=1 * MS)], [Update(lane=0, update_s=1 * MS)]])
    r = simulate(c, ch)
    assert [round(t / MS, 9) for t in (*r.fp_start_s, *r.fp_end_s, *r.bp_start_s, *r.bp_end_s)] == [
        0, 1.5, 1, 3.5, 8, 4, 10, 8]
    assert r.iteration_s == pytest.approx(14 * MS)
    no_overlap = simulate(c, cpu_case(ch.updates, overlap=False)[1])
    assert no_overlap.iteration_s == pytest.approx(15 * MS)  # both updates after the backward
    host = simulate(c, cpu_case([[Update(lane=-1, update_s=1 * MS)], [Update(lane=-1, update_s=1 * MS)]])[1])
    assert host.bp_start_s[0] == pytest.approx(9 * MS)  # host Adam without a GPU shares the compute lane
    assert host.iteration_s == pytest.approx(15 * MS)


def test_activations_peak_and_a_late_prefetch_stalls():
    """a's 4 KB are evicted 1-2 ms (4 MB/s); triggered by b's backward start (4 ms), the 2 ms prefetch lands at
    6 ms, before a's backward at 8 ms. Triggered by a's own backward it stalls 2 ms; by the clock at 7.5 ms, 1.5."""
    updates = [[], []]
    c, ch = cpu_case(updates, evict=(4000, 0), trigger=(1, None))
    r = simulate(c, ch)
    assert r.stall_s == 0
    assert r.act_peak_untiered_bytes == r.act_peak_bytes == 12_000  # a is back at 4 ms, b leaves at 8 ms
    assert r.peak_bytes == {"dram": 100 + 12_000, "nvme0": 4000}
    assert r.act_avg_bytes < r.act_avg_untiered_bytes
    late = simulate(c, cpu_case(updates, evict=(4000, 0), trigger=(0, None))[1])  # its own backward: on demand
    assert late.stall_s == pytest.approx(2 * MS)
    timed = simulate(c, cpu_case(updates, evict=(4000, 0), at=(7.5 * MS, 0.0))[1])  # by clock: 7.5 + 2 > 8.5
    assert timed.stall_s == pytest.approx(1.5 * MS)


def test_a_layers_storages_are_timed_one_transfer_each():
    """a's 4 KB saved as two 2 KB storages: on a 1 ms-latency disk its eviction is two transfers, 1 ms longer."""
    def busy(storages: tuple[int, ...]) -> dict[str, float]:
        c, ch = cpu_case([[], []], evict=(4000, 0), trigger=(1, None))
        c.evict = c.prefetch = Curve.linear(4e6, latency_s=1 * MS)
        c.layers[0].saved_storages = storages
        spans = simulate(c, ch, record=True).spans
        return {lane: sum(x.end_s - x.start_s for x in spans if x.lane == lane) for lane in ("evict", "prefetch")}

    whole, split = busy(()), busy((2000, 2000))
    assert whole == {"evict": pytest.approx(2 * MS), "prefetch": pytest.approx(2 * MS)}
    assert split == {"evict": pytest.approx(3 * MS), "prefetch": pytest.approx(3 * MS)}


def test_nvme_states_are_read_updated_and_written_in_the_step_through_two_slots():
    """As the runtime does it: backward ends at 10 ms; a's two tensors and then b's are read, updated and written in
    parameter order. The second read follows the first on the drive (11-12); b's read waits for slot 0, which a1's
    write frees at 13; each update waits for its read (a1 1 ms, b 1 ms late) and the step ends with b's write at 16,
    then the 3 ms tail."""
    nvme = dict(nvme_bytes=16, read_s=1 * MS, write_s=1 * MS)
    c, ch = cpu_case([[Update(lane=0, update_s=1 * MS, **nvme), Update(lane=0, update_s=1 * MS, **nvme)],
                      [Update(lane=0, update_s=1 * MS, **nvme)]], staging=32)
    r = simulate(c, ch, record=True)

    def lane(name):
        return [(s.name, round(s.start_s / MS, 9), round(s.end_s / MS, 9)) for s in r.spans if s.lane == name]

    assert lane("nvme read") == [("read states a", 10, 11), ("read states a", 11, 12), ("read states b", 13, 14)]
    assert lane("ch0") == [("adam a", 11, 12), ("adam a", 12, 13), ("adam b", 14, 15)]
    assert lane("nvme write") == [("write states a", 12, 13), ("write states a", 13, 14), ("write states b", 15, 16)]
    assert r.nvme_late_s == pytest.approx(2 * MS) and r.iteration_s == pytest.approx(19 * MS)


def test_chrome_trace_has_a_thread_per_lane_spans_and_memory_counters():
    c, ch = cpu_case([[Update(lane=0, update_s=1 * MS)], []], evict=(4000, 0), trigger=(1, None))
    trace = json.loads(json.dumps(chrome_trace(simulate(c, ch, record=True), 1.0)))
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == {"compute", "evict", "prefetch", "ch0"}
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert names[:3] == ["fp a", "evict a", "fp b"] and "adam a" in names
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "C"} == {"memory dram", "memory nvme0"}
    assert trace["otherData"]["iteration_s"] == pytest.approx(14 * MS)


def test_costs_take_the_compute_between_layers_from_the_profiled_timeline(repo):
    profile = files.load(repo / "tests/plan/fixtures/handworked.profile.yaml", expect=Profile)
    c = costs(profile)
    assert c.layers[0].fp_gap_s == pytest.approx(0.4 * MS)  # wte's forward ends at 450 us after 50 us of work
    assert c.layers[1].fp_gap_s == pytest.approx(0.05 * MS)
    assert [c.layers[i].name for i in c.bp_order[:2]] == ["lm_head", "ln_f"]
    assert c.layers[c.bp_order[0]].bp_gap_s == pytest.approx(1.05 * MS)  # loss: lm_head's forward end to backward
    assert c.tail_s == pytest.approx(46 * MS - 1.2 * MS - 30.87 * MS)
    assert not c.has_gpu and all(x.copy_s == 0 for x in c.layers)


def interference_case(saved_a=4000, slowdown=3.0, share=None):
    """a (fp 1 ms) then b (fp 2 ms), no gaps; a's saved bytes are evicted at 4 MB/s from 1 ms, beside b's forward;
    b's backward start triggers a's prefetch. `share`: the lanes' shares of a core (default: the evicting worker
    half a core, the others none)."""
    c = Costs(layers=[layer("a", 1, 2, saved=saved_a), layer("b", 2, 4)], bp_order=[1, 0], tail_s=3 * MS,
              micro_batches=1, has_gpu=False, evict=Curve.linear(4e6), prefetch=Curve.linear(2e6),
              background_slowdown=slowdown)
    ch = Choices(modes=["gfgb"] * 2, grads=["gpu"] * 2, evict_bytes=[saved_a, 0], trigger=[1, None],
                 prefetch_at_s=[0.0, 0.0], updates=[[], []], lanes=[], overlap_backward=True, grads_to_host=True,
                 params_on_gpu=False, fast="dram", slow="nvme0", static_bytes={"dram": 100},
                 cpu_share={"evict": 0.5} if share is None else share)
    return c, ch


def test_an_eviction_beside_a_forward_layer_stretches_it_by_its_cpu_share():
    """a's eviction runs 1-2 ms beside b's forward (from 1 ms). With f = 3 and the worker at half a core, compute
    runs at 1 / (1 + (3 - 1) * 0.5) = half speed while it works: b does 0.5 ms of its 2 ms by 2 ms, the other 1.5 ms
    by 3.5 ms. The stretch, 0.5 ms, is (f - 1) x share x the 0.5 ms of b's compute the eviction overlapped. The
    prefetch (no CPU share here) slows nothing: everything after b's forward moves by the same 0.5 ms."""
    c, ch = interference_case()
    r = simulate(c, ch)
    assert r.fp_end_s[1] == pytest.approx(3.5 * MS)
    assert r.fp_end_s[1] - (1 + 2) * MS == pytest.approx((3 - 1) * 0.5 * 0.5 * MS)
    assert [r.bp_start_s[1], r.bp_end_s[1], r.bp_end_s[0]] == pytest.approx([3.5 * MS, 7.5 * MS, 9.5 * MS])
    assert r.iteration_s == pytest.approx(12.5 * MS)
    spans = {s.name: (s.start_s, s.end_s) for s in simulate(c, ch, record=True).spans}
    assert spans["evict a"] == pytest.approx((1 * MS, 2 * MS)) and spans["fp b"] == pytest.approx((1 * MS, 3.5 * MS))


def test_a_worker_busy_throughout_slows_compute_by_the_measured_factor():
    """A 10 ms eviction (1-11 ms) covers b's whole forward; a worker of a whole core slows it by f, as measured."""
    c, ch = interference_case(saved_a=40_000, slowdown=2.5, share={"evict": 1.0})
    assert simulate(c, ch).fp_end_s[1] == pytest.approx((1 + 2.5 * 2) * MS)


def test_prefetches_and_channel_updates_slow_the_backward_beside_them():
    """With f = 3: a's prefetch (3-5 ms, triggered by b's backward start) at a quarter of a core runs b's backward at
    1 / 1.5 speed: 4/3 ms of its 4 ms by 5 ms, the other 8/3 ms after. b's update on an emulated channel (a whole
    core, 1 ms from b's backward end) then runs a's backward at a third of its speed for 1 ms: 1/3 ms of its 2."""
    c, ch = interference_case(share={"prefetch": 0.25, "ch0": 1.0})
    ch.lanes, ch.updates = ["ch0"], [[], [Update(lane=0, update_s=1 * MS)]]
    r = simulate(c, ch)
    assert r.fp_end_s[1] == pytest.approx(3 * MS)  # the eviction takes no CPU here
    assert r.bp_end_s[1] == pytest.approx((3 + 2 + 8 / 3) * MS)
    # b's update runs 7.67-8.67 ms beside a's backward (from 7.67 ms): 1 ms of wall time at 1/3 speed, then the rest
    assert r.bp_end_s[0] == pytest.approx(r.bp_start_s[0] + 1 * MS + (2 - 1 / 3) * MS)


def test_without_a_measured_slowdown_or_with_a_gpu_nothing_changes():
    c, ch = interference_case()
    before = simulate(dataclasses.replace(c, background_slowdown=None), ch)
    assert before.fp_end_s[1] == pytest.approx(3 * MS) and before.iteration_s == pytest.approx(12 * MS)
    assert simulate(dataclasses.replace(c, background_slowdown=1.0), ch).iteration_s == before.iteration_s
    assert simulate(c, dataclasses.replace(ch, cpu_share={})).iteration_s == before.iteration_s
    gpu = dataclasses.replace(c, has_gpu=True)
    assert simulate(gpu, ch).iteration_s == simulate(dataclasses.replace(gpu, background_slowdown=None), ch).iteration_s


def test_the_plan_gives_each_background_lane_the_cpu_share_the_profile_measured(repo):
    shipped = files.load(repo / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile)
    plan = files.load(repo / "plans/gpt-tiny-cpu.plan.yaml", expect=Plan)
    m = shipped.machine
    unmeasured = [dataclasses.replace(m.tiers[0]), dataclasses.replace(m.tiers[1], read_cpu=None, write_cpu=None)]
    profile = dataclasses.replace(shipped, machine=dataclasses.replace(
        m, cpu=dataclasses.replace(m.cpu, background_slowdown=None), tiers=unmeasured,
        axdimm=dataclasses.replace(m.axdimm, cpu=None)))
    c, ch = build(profile, plan)
    assert c.background_slowdown is None  # not measured: compute is not slowed
    assert ch.cpu_share == {"evict": 1.0, "prefetch": 1.0, "nvme read": 1.0, "nvme write": 1.0, "axdimm ch0": 1.0,
                            "axdimm ch1": 1.0}  # unmeasured workers count as busy throughout
    nvme = dataclasses.replace(m.tiers[1], read_cpu=0.5, write_cpu=0.125)
    measured = dataclasses.replace(profile, machine=dataclasses.replace(
        m, cpu=dataclasses.replace(m.cpu, background_slowdown=2.0), tiers=[m.tiers[0], nvme],
        axdimm=dataclasses.replace(m.axdimm, cpu=0.75)))
    c2, ch2 = build(measured, plan)
    assert c2.background_slowdown == 2.0
    assert ch2.cpu_share == {"evict": 0.125, "prefetch": 0.5, "nvme read": 0.5, "nvme write": 0.125,
                             "axdimm ch0": 0.75, "axdimm ch1": 0.75}
    slowed = simulate(c2, ch2)
    alone = simulate(c, ch)
    assert slowed.iteration_s > alone.iteration_s
    assert all(b >= a - 1e-12 for a, b in zip(alone.fp_end_s, slowed.fp_end_s))
    hardware = dataclasses.replace(measured, machine=dataclasses.replace(
        measured.machine, axdimm=dataclasses.replace(m.axdimm, backend="hardware")))
    assert build(hardware, plan)[1].cpu_share["axdimm ch0"] == 0.0  # its own device: no host thread


def test_a_gpu_profile_never_slows_compute_by_host_workers():
    profile = gpu_profile(4)
    m = profile.machine
    profile.machine = dataclasses.replace(m, cpu=dataclasses.replace(m.cpu, background_slowdown=2.0))
    assert costs(profile).background_slowdown is None  # the GPU computes: host threads do not take its cores
