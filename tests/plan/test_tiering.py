"""TierTrain's queue (Eq. 2-10) on a case worked by hand, our packed rule and eviction queue, the trigger layer."""

import dataclasses

import pytest

from hetero.plan import tiering
from hetero.plan.model import Curve
from hetero.plan.solve import PlanOptions, plan
from hetero.schema import files
from hetero.schema.profile import Profile
from hetero.units import SIZE
from tests.figures import figures
from tests.plan.synthetic import GiB

MS = 1e-3
ER, PR = Curve.linear(4e9), Curve.linear(2e9)  # MR = 1/ER + 1/PR = 0.75 ns per byte

# Backward order: C (3.5 ms), B (6), D (7), A (10).
WINDOWS = [
    tiering.Window(name="A", saved_bytes=2_000_000, fp_end_s=1 * MS, bp_start_s=10 * MS),
    tiering.Window(name="B", saved_bytes=8_000_000, fp_end_s=2 * MS, bp_start_s=6 * MS),
    tiering.Window(name="C", saved_bytes=1_000_000, fp_end_s=3 * MS, bp_start_s=3.5 * MS),
    tiering.Window(name="D", saved_bytes=4_000_000, fp_end_s=0.5 * MS, bp_start_s=7 * MS),
]


def moved(decisions) -> float:
    """Byte-seconds away from the fast tier (an upper bound: evicted from forward end to backward start)."""
    return sum(x.evict_bytes * (WINDOWS[x.layer].bp_start_s - WINDOWS[x.layer].fp_end_s) for x in decisions)


def by_name(decisions):
    return {WINDOWS[d.layer].name: d for d in decisions}


def test_paper_rule_worked_by_hand():
    """A: IT 9 ms >= 2 MB x MR 1.5 ms + ST 1 ms: whole, prefetched 1 ms before 10 ms (Eq. 6, 8).
    B: IT 4 ms < 8 MB x MR 6 ms + ST: partial (4 - 1) ms / MR = 4 MB, prefetch 2 ms before 6 ms (Eq. 7).
    C: IT 0.5 ms < ST: dropped.
    D: IT 6.5 ms: whole by Eq. 6, but its 2 ms prefetch would start at 5 ms while the prefetcher serves B until
    6 ms: cut to (7 - 6) ms x PR = 2 MB (Eq. 9-10); t_busy becomes 7 ms, and A's start at 9 ms is accepted."""
    d = by_name(tiering.schedule(WINDOWS, ER, PR, 1 * MS, 1, rule="paper"))
    assert (d["A"].outcome, d["A"].evict_bytes, d["A"].prefetch_at_s) == ("whole", 2_000_000, pytest.approx(9 * MS))
    assert (d["B"].outcome, d["B"].evict_bytes, d["B"].prefetch_at_s) == ("partial", 4_000_000, pytest.approx(4 * MS))
    assert (d["C"].outcome, d["C"].evict_bytes) == ("dropped", 0)
    assert (d["D"].outcome, d["D"].evict_bytes, d["D"].prefetch_at_s) == ("cut", 2_000_000, pytest.approx(6 * MS))
    assert [WINDOWS[d[n].prefetch_after].name for n in "ABD"] == ["D", "C", "B"]  # latest backward start <= trigger
    assert d["C"].prefetch_after is None
    assert figures(d["A"].why) == ['9ms', '1.5ms', '1ms', '6', '1.91MiB', '1ms']
    assert figures(d["B"].why)[:5] == ['4ms', '6ms', '7.63MiB', '1ms', '7']
    assert figures(d["C"].why) == ['500us', '750us', '977KiB', '1ms', '7']
    # busy until 6 ms, so 1.91MiB fits before 7 ms (Eq. 10)
    assert figures(d["D"].why) == ['6.5ms', '3ms', '1ms', '6', '6ms', '1.91MiB', '7ms', '10', '1.91MiB', '1ms']


def test_packed_rule_uses_the_idle_prefetcher_before_a_later_request():
    """Placed from the last backward layer: D keeps its whole 4 MB (prefetched 5-7 ms), and B ends its prefetch
    when D's begins (5 ms): IT 3 ms -> (3 - 1) ms / MR = 2.67 MB."""
    d = by_name(tiering.schedule(WINDOWS, ER, PR, 1 * MS, 1, rule="packed"))
    assert (d["D"].outcome, d["D"].evict_bytes, d["D"].prefetch_at_s) == ("whole", 4_000_000, pytest.approx(5 * MS))
    assert (d["B"].outcome, d["B"].evict_bytes) == ("partial", 2_666_666)
    assert figures(d["B"].why)[:3] == ['5ms', '6ms', '3ms']
    assert d["A"].evict_bytes == 2_000_000 and d["C"].evict_bytes == 0
    paper = tiering.schedule(WINDOWS, ER, PR, 1 * MS, 1, rule="paper")
    assert moved(d.values()) > moved(paper)


def test_the_eviction_queue_cuts_what_would_still_be_in_flight():
    """Three layers finish their forward at 1 ms; one writer at 1 GB/s evicts X, Y, then Z (2 MB = 2 ms each).
    Z's eviction starts at 5 ms and its backward is at 6 ms: only 0.5 MB can go out and come back in time."""
    rate = Curve.linear(1e9)
    windows = [tiering.Window(name=n, saved_bytes=2_000_000, fp_end_s=1 * MS, bp_start_s=t * MS)
               for n, t in (("X", 20), ("Y", 10), ("Z", 6))]
    d = tiering.schedule(windows, rate, rate, 0.0, 1, rule="paper")
    assert [x.evict_bytes for x in d] == [2_000_000, 2_000_000, 500_000]
    assert d[2].outcome == "queued" and d[2].prefetch_at_s == pytest.approx(5.5 * MS)
    # its eviction starts at 5 ms: 488KiB stays 0s before its prefetch, which takes 500us
    assert figures(d[2].why) == ['5ms', '4ms', '0s', '6', '5ms', '488KiB', '0s', '488KiB', '500us']


def test_pinned_entries_are_kept_and_hold_the_prefetcher():
    pinned = {3: tiering.Decision(layer=3, evict_bytes=4_000_000, prefetch_at_s=5 * MS, prefetch_after=1,
                                  outcome="pinned", why="mine")}
    d = by_name(tiering.schedule(WINDOWS, ER, PR, 1 * MS, 1, pinned=pinned, rule="paper"))
    assert (d["D"].evict_bytes, d["D"].why, WINDOWS[d["D"].prefetch_after].name) == (4_000_000, "mine", "B")
    assert d["A"].evict_bytes == 2_000_000


def test_small_tensors_are_left_alone_and_min_tensor_comes_from_the_curves():
    assert [WINDOWS[x.layer].name for x in tiering.schedule(WINDOWS, ER, PR, 1 * MS, 3_000_000)] == ["B", "D"]
    latency = Curve.of([type("P", (), {"size_bytes": s, "time_s": 100e-6 + s / 1e9})() for s in (4096, 65536, 2**20,
                                                                                                  2**24)])
    assert tiering.min_tensor_bytes(latency, latency) == 2**20  # 1 MiB: 91% of the peak rate; 64 KiB: 40%


def test_a_layer_moves_storage_by_storage_and_only_storages_reaching_min_tensor():
    """A layer saving 4 MB, 1 MB and 1 MB with min_tensor 1 MB moves all three, each paying the 100 us latency;
    with min_tensor 2 MB only the 4 MB one can move, so only it is planned (the runtime leaves the others)."""
    evict, prefetch = Curve.linear(4e9, 100e-6), Curve.linear(2e9, 100e-6)
    w = tiering.Window(name="L", saved_bytes=6_000_000, fp_end_s=0, bp_start_s=1.0,
                       storages=(4_000_000, 1_000_000, 1_000_000))
    assert w.time_s(prefetch, 6_000_000) == pytest.approx(3 * 100e-6 + 6_000_000 / 2e9)
    assert w.time_s(prefetch, 4_500_000) == pytest.approx(2 * 100e-6 + 4_500_000 / 2e9)  # 4 MB, then 0.5 of 1 MB
    assert w.within(prefetch, 2 * 100e-6 + 4_500_000 / 2e9, 6_000_000) == pytest.approx(4_500_000, abs=1)
    assert [d.evict_bytes for d in tiering.schedule([w], evict, prefetch, 1 * MS, 1_000_000)] == [6_000_000]
    assert [d.evict_bytes for d in tiering.schedule([w], evict, prefetch, 1 * MS, 2_000_000)] == [4_000_000]
    assert tiering.schedule([w], evict, prefetch, 1 * MS, 8_000_000) == []


def test_trigger_is_the_latest_layer_whose_backward_has_started():
    starts = [(1.0, 5), (2.0, 4), (2.0, 3), (4.0, 2)]
    assert tiering.trigger(starts, 0.5) is None
    assert tiering.trigger(starts, 2.0) == 3
    assert tiering.trigger(starts, 3.9) == 3
    assert tiering.trigger(starts, 9.0) == 2


def test_curves_through_a_gpu_add_the_copy_to_the_tier():
    from tests.plan.synthetic import gpu_profile

    profile = gpu_profile(2, seed=0, gpu_memory=GiB)
    evict, prefetch = tiering.curves(profile, "nvme0")
    d2h = Curve.of(profile.machine.gpu.d2h)
    nvme = Curve.of(profile.machine.tiers[1].write)
    assert evict.time_s(2**20) == pytest.approx(d2h.time_s(2**20) + nvme.time_s(2**20))
    assert tiering.curves(profile, "dram")[1].time_s(2**20) == Curve.of(profile.machine.gpu.h2d).time_s(2**20)


def test_tiering_forced_where_no_saved_storage_is_worth_a_transfer_is_left_out_saying_why(repo):
    """--tier-activations on a model whose every saved storage is under min_tensor (a small ViT's, an accelerate
    script's): no section that would hook every layer for nothing, and the reason with its figures."""
    profile = files.load(repo / "tests/plan/fixtures/handworked.profile.yaml", expect=Profile)
    layers = [dataclasses.replace(x, saved_bytes=min(x.saved_bytes, 3 << 10), saved_storages_bytes=[])
              for x in profile.layers]
    small = dataclasses.replace(profile, layers=layers)
    measured = plan(profile, PlanOptions(tier_activations=True)).activations  # the profile as measured
    assert any(e.evict_bytes for e in measured.schedule)
    p = plan(small, PlanOptions(tier_activations=True))
    assert p.activations is None
    # the threshold and the largest storage there is
    assert {SIZE.format_short(measured.min_tensor_bytes), "3KiB"} <= set(figures(p.omitted["activations"]))
