"""COARSE's routing on curves with known answers: crossing size S, shard size S', dual-sync split m."""

import pytest

from hetero.plan import routing
from hetero.plan.solve import ONE_PROCESS, PlanOptions, plan
from hetero.schema.profile import CurvePoint
from tests.figures import figures
from tests.plan.synthetic import SIZES, gpu_profile


def line(rate: float, latency: float) -> routing.Curve:
    return routing.Curve.of([CurvePoint(size_bytes=s, time_s=latency + s / rate) for s in SIZES])


LAT = line(5e9, 5e-6)  # rank 1: 5 us latency, 5 GB/s
BW = line(20e9, 20e-6)  # rank 2: 20 us latency, 20 GB/s


def test_threshold_is_where_the_two_paths_take_equal_time():
    """5 us + S / 5 GB/s = 20 us + S / 20 GB/s  =>  S = 15 us / (0.15 ns/B) = 100,000 bytes."""
    assert routing.crossing(LAT, BW) == pytest.approx(100_000, abs=1)
    assert routing.crossing(BW, LAT) == SIZES[0]  # the "latency" path is slower from the start


def test_shard_is_the_smallest_measured_size_at_90_percent_of_full_bandwidth():
    """BW's rate: 1 MiB reaches 72% of its best (19.98 GB/s at 256 MiB), 16 MiB 97.7%."""
    assert routing.shard_size(BW) == 16 * 2**20


def test_dual_sync_m_minimizes_t_train():
    """Two ranks (ring factor 1), n = 100 MB, T_FP 10 ms, T_BP 2 ms, proxies 20 GB/s, GPUs 5 GB/s:
    12 ms + (n - m)/5 GB/s = 10 ms + m/20 GB/s  =>  m = 88 MB, T_train = 14.4 ms."""
    m, t = routing.dual_sync(2, 100_000_000, 10e-3, 2e-3, 20e9, 5e9)
    assert m == pytest.approx(88_000_000, abs=1)
    assert t == pytest.approx(14.4e-3)
    brute = min(routing.train_time(2, 100_000_000, k * 1_000_000, 10e-3, 2e-3, 20e9, 5e9) for k in range(101))
    assert t <= brute + 1e-12
    assert routing.dual_sync(2, 100_000_000, 10e-3, 50e-3, 20e9, 5e9)[0] == 100_000_000  # hidden behind BP: all


def test_route_picks_the_latency_and_bandwidth_peers():
    links = [routing.Link(peer=1, curve=LAT), routing.Link(peer=2, curve=BW), routing.Link(peer=3, curve=line(8e9,
                                                                                                            9e-6))]
    r = routing.route(links, 4, 100_000_000, 10e-3, 2e-3)
    assert (r.latency_peer, r.bandwidth_peer, r.shard_bytes) == (1, 2, 16 * 2**20)
    assert r.threshold_bytes == pytest.approx(100_000, abs=1)
    assert figures(r.why)[:7] == ['1', '5.82us', '2', '20GB/s', '25us', '97.7KiB', '16MiB']
    same = routing.route([routing.Link(peer=1, curve=BW)], 2, 1000, 1e-3, 1e-3)
    assert (same.threshold_bytes, same.latency_peer, same.bandwidth_peer) == (0, 1, 1)
    assert figures(same.why)[0] == "1"  # one rank for every size: no crossing to cite


def test_plans_route_only_multi_process_profiles():
    one = plan(gpu_profile(3, seed=1), PlanOptions())
    assert one.routing is None
    assert one.omitted["routing"] == ONE_PROCESS
    many = plan(gpu_profile(3, seed=1, peers=3), PlanOptions())
    assert (many.routing.latency_peer, many.routing.bandwidth_peer) == (1, 2)
    assert "routing" not in many.omitted
    assert many.predicted.iteration_s > one.predicted.iteration_s  # synchronization is on the timeline


def test_a_ring_all_reduce_is_2_p_minus_1_steps_of_a_pth():
    """4 ranks, 8 MB at 5 us + S/5 GB/s per step: 6 steps of 2 MB = 6 x (5 us + 400 us) = 2.43 ms."""
    assert routing.ring_allreduce_s(8e6, 4, LAT) == pytest.approx(6 * (5e-6 + 2e6 / 5e9))
    assert routing.ring_allreduce_s(8e6, 1, LAT) == 0.0


def test_the_plan_prioritises_the_first_layers_bytes_n_minus_m():
    """COARSE sends m bytes (the last layers', synced during backward) to the proxies; the first n - m go first."""
    links = [routing.Link(peer=1, curve=LAT), routing.Link(peer=2, curve=BW)]
    m, _ = routing.dual_sync(2, 100_000_000, 10e-3, 2e-3, BW.peak_rate, LAT.peak_rate)
    route = routing.route(links, 2, 100_000_000, 10e-3, 2e-3)
    assert route.dual_sync_bytes == 100_000_000 - m
