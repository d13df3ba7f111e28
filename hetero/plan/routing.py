"""How gradient synchronization between data-parallel ranks is routed (COARSE §III-E/F).

From the measured transfer-time curve to each peer: the latency peer (fastest small transfer), the bandwidth peer
(highest rate), the size S where their curves cross (smaller tensors take the latency path), the shard size S' (the
smallest measured size reaching 90% of the bandwidth path's full rate; large tensors are cut into such shards and
pipelined) and the dual-synchronization split m that minimizes the paper's estimate
T_train = max(T_FP + T_BP + T_sync(GPU), T_FP + T_sync(proxy)), with each side moving 2(p-1)/p of its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.plan.model import Curve
from hetero.schema.profile import Profile
from hetero.units import RATE, SIZE, short_time

FULL_RATE = 0.9  # COARSE's "full bandwidth", as a fraction of the best rate measured


@dataclass(kw_only=True, slots=True)
class Link:
    peer: int
    curve: Curve

    @property
    def latency_s(self) -> float:
        return self.curve.times[0]


@dataclass(kw_only=True, slots=True)
class Route:
    threshold_bytes: int
    latency_peer: int
    bandwidth_peer: int
    shard_bytes: int
    dual_sync_bytes: int  # the first layers' bytes, synchronized directly and first: COARSE's n - m
    train_s: float  # T_train at the chosen m
    why: str


def links(profile: Profile) -> tuple[list[Link], int]:
    """This rank's links (the lowest sending rank's, as profiled) and the number of ranks."""
    peers = profile.machine.peers
    if not peers:
        return [], 1
    me = min(p.src for p in peers)
    ranks = len({p.src for p in peers} | {p.dst for p in peers})
    return [Link(peer=p.dst, curve=Curve.of(p.transfer, f"peer {p.dst} transfer")) for p in peers
            if p.src == me and p.transfer], ranks


def route(links: list[Link], ranks: int, grad_bytes: int, forward_s: float, backward_s: float) -> Route:
    lat = min(links, key=lambda k: (k.latency_s, k.peer))
    bw = min(links, key=lambda k: (-k.curve.peak_rate, k.peer))
    threshold = 0 if lat.peer == bw.peer else crossing(lat.curve, bw.curve)
    shard = shard_size(bw.curve)
    m, train = dual_sync(ranks, grad_bytes, forward_s, backward_s, bw.curve.peak_rate, lat.curve.peak_rate)
    path = (f"rank {lat.peer} is best at every size" if lat.peer == bw.peer else
            f"rank {lat.peer} (latency {short_time(lat.latency_s)}) and rank {bw.peer} "
            f"({RATE.format_short(bw.curve.peak_rate)}) take {short_time(lat.curve.time_s(threshold))} at "
            f"{SIZE.format_short(threshold)}")
    why = (f"{path}; shard {SIZE.format_short(shard)}: smallest size at >= {FULL_RATE:.0%} of "
           f"{RATE.format_short(bw.curve.peak_rate)}; m {SIZE.format_short(m)} of {SIZE.format_short(grad_bytes)} "
           f"(synced during backward) minimizes T_train = {short_time(train)} over {ranks} ranks, so the first "
           f"{SIZE.format_short(grad_bytes - m)} go first")
    return Route(threshold_bytes=threshold, latency_peer=lat.peer, bandwidth_peer=bw.peer, shard_bytes=shard,
                 dual_sync_bytes=grad_bytes - m, train_s=train, why=why)


def crossing(lat: Curve, bw: Curve) -> int:
    """The size S where T_lat(S) = T_bw(S): curves are linear between their joint breakpoints, and beyond the
    last one both continue at their last rates."""
    diff = lambda s: lat.time_s(s) - bw.time_s(s)  # noqa: E731 (<= 0 while the latency path is faster)
    points = sorted(set(lat.sizes) | set(bw.sizes))
    if diff(points[0]) >= 0:
        return points[0]
    for a, b in zip(points, points[1:]):
        if diff(b) >= 0:
            return int(a + (b - a) * -diff(a) / (diff(b) - diff(a)))
    far = points[-1] * 2
    slope = (diff(far) - diff(points[-1])) / (far - points[-1])
    return int(points[-1] - diff(points[-1]) / slope) if slope > 0 else points[-1]


def shard_size(curve: Curve) -> int:
    full = curve.peak_rate
    return next(s for s in curve.sizes if curve.rate(s) >= FULL_RATE * full)


def dual_sync(ranks: int, n_bytes: int, forward_s: float, backward_s: float, proxy_bytes_per_s: float,
              gpu_bytes_per_s: float) -> tuple[int, float]:
    """m in [0, n] minimizing T_train: the GPU side falls and the proxy side rises with m, so the optimum is where
    they meet, or an end of the range."""
    ring = 2 * (ranks - 1) / ranks
    if ring == 0 or n_bytes == 0:
        return 0, forward_s + backward_s
    meet = (backward_s + ring * n_bytes / gpu_bytes_per_s) / (ring / proxy_bytes_per_s + ring / gpu_bytes_per_s)
    m = min(max(meet, 0.0), n_bytes)
    cost = lambda k: train_time(ranks, n_bytes, k, forward_s, backward_s, proxy_bytes_per_s, gpu_bytes_per_s)  # noqa
    best = min((int(m), min(int(m) + 1, n_bytes)), key=lambda k: (cost(k), k))  # whole bytes either side
    return best, cost(best)


def train_time(ranks: int, n: int, m: int, forward_s: float, backward_s: float, proxy_bytes_per_s: float,
               gpu_bytes_per_s: float) -> float:
    ring = 2 * (ranks - 1) / ranks
    return max(forward_s + backward_s + ring * (n - m) / gpu_bytes_per_s, forward_s + ring * m / proxy_bytes_per_s)


def sync_time_s(size: int, ranks: int, threshold: int, shard: int, lat: Curve, bw: Curve) -> float:
    """One tensor's all-reduce: small ones on the latency path, large ones as shards on the bandwidth path."""
    if size <= threshold:
        return ring_allreduce_s(size, ranks, lat)
    shards = -(-size // max(shard, 1))
    return shards * ring_allreduce_s(size / shards, ranks, bw)


def ring_allreduce_s(size: float, ranks: int, curve: Curve) -> float:
    """A ring all-reduce is 2(p-1) steps, each moving 1/p of the tensor over one link: each step pays the link's
    measured time for that size, its latency included, not one transfer per all-reduce."""
    return 2 * (ranks - 1) * curve.time_s(size / ranks) if ranks > 1 else 0.0


