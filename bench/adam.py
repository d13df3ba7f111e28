"""Adam(W) step throughput on this CPU: hetero's kernel beside torch's fused and foreach AdamW and DeepSpeed's CPU
Adam (when importable), in one run on the same sizes, against the memory-bandwidth bound of 28 bytes per parameter.

    .venv/bin/python bench/adam.py [--sizes 10M,100M] [--repeats 7] [--axdimm] [--bandwidth-size 64M]

DeepSpeed is optional and never installed into the project's venv; to include it, e.g.
    pip install --target /tmp/ds --no-deps deepspeed && pip install --target /tmp/ds einops hjson msgpack ninja \
        psutil py-cpuinfo tqdm
    PYTHONPATH=/tmp/ds PATH=/tmp/ds/bin:$PATH .venv/bin/python bench/adam.py     (its first run JIT-builds ~1-2 min)

Every buffer is touched before timing (first touch is slow in VMs), each contender is warmed up, and contenders
take turns within each repeat so drift in a shared machine hits all of them alike; medians are printed.
`--axdimm` also times the emulated AXDIMM's two channels with kernel compute serialized and concurrent.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hetero.kernels.adam import AdamKernel, Hyperparameters
from hetero.units import COUNT

BYTES_PER_PARAM = 28  # reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq (fp32)
HP = Hyperparameters(lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True)


def _touched(n: int) -> torch.Tensor:
    return torch.randn(n)  # randn writes every page


def _hetero(n: int, bf16_copy: bool = False) -> Callable[[], None]:
    p, g, m, v = (_touched(n) for _ in range(4))
    m.zero_(), v.zero_()
    low = torch.zeros(n, dtype=torch.bfloat16) if bf16_copy else None
    kernel, step = AdamKernel(), [0]

    def run() -> None:
        step[0] += 1
        kernel(p, g, m, v, hyperparameters=HP, step=step[0])
        if low is not None:  # a second pass over the weights: what fusing a low-precision write could save at most
            low.copy_(p)
    return run


def _torch_optimizer(n: int, **kw) -> Callable[[], None]:
    p = torch.nn.Parameter(_touched(n))
    p.grad = _touched(n)
    opt = torch.optim.AdamW([p], lr=HP.lr, weight_decay=HP.weight_decay, **kw)
    return opt.step


def _deepspeed(n: int) -> Callable[[], None] | str:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # ImportError, or its JIT build failing: report it, run the rest
        return f"not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    p = torch.nn.Parameter(_touched(n))
    p.grad = _touched(n)
    opt = DeepSpeedCPUAdam([p], lr=HP.lr, weight_decay=HP.weight_decay, adamw_mode=True)
    return opt.step


CONTENDERS: dict[str, Callable[[int], Callable[[], None] | str]] = {
    "hetero AdamKernel": _hetero,
    "torch AdamW fused": lambda n: _torch_optimizer(n, fused=True),
    "torch AdamW foreach": lambda n: _torch_optimizer(n, foreach=True),
    "deepspeed DeepSpeedCPUAdam": _deepspeed,
    "hetero + separate bf16 copy": lambda n: _hetero(n, bf16_copy=True),
}


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bandwidth(n: int, repeats: int) -> dict[str, float]:
    """Bytes/s of in-place streaming ops over n floats, each its best repeat: the rates Adam's pattern (read four
    streams, rewrite three in place) can hope for. The largest is the bound."""
    a, b, c = _touched(n), _touched(n), _touched(n)
    patterns = {"a.mul_(s)": (lambda: a.mul_(1.0), 8), "a.add_(b)": (lambda: a.add_(b), 12),
                "a.addcmul_(b, c)": (lambda: a.addcmul_(b, c), 16)}
    rates = {}
    for name, (op, nbytes) in patterns.items():
        op()
        rates[name] = nbytes * n / min(_time(op) for _ in range(repeats))
    return rates


def bench_size(n: int, repeats: int, bound: float) -> None:
    steps, notes = {}, {}
    for name, make in CONTENDERS.items():
        made = make(n)
        if isinstance(made, str):
            notes[name] = made
            continue
        made(), made()  # warm-up: lazy state allocation, JIT, thread pools
        steps[name] = made
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(_time(step))
    rates = {name: n / statistics.median(t) / 1e6 for name, t in times.items()}
    fused = rates["torch AdamW fused"]
    print(f"\n{COUNT.format_short(n)} params, median of {repeats}:")
    print(f"  {'':30} {'M params/s':>10} {'x fused':>8} {'% bound':>8}")
    for name, rate in rates.items():
        print(f"  {name:30} {rate:10.0f} {rate / fused:8.2f} {100 * rate / bound:7.0f}%")
    for name, note in notes.items():
        print(f"  {name:30} skipped: {note}")


def bench_axdimm(n: int, repeats: int) -> None:
    """Both channels' kernels launched together; compute serialized vs concurrent, taking turns per repeat."""
    from hetero.run.devices.axdimm import EmulatedAxdimm

    half = n // 2
    devices, bufs = {}, {}
    for serialize in (True, False):
        dev = EmulatedAxdimm(channel_capacity_bytes=4 * 4 * half + 4096, channels=2, serialize_compute=serialize)
        bufs[serialize] = [[dev.malloc(4 * half, c) for _ in range(4)] for c in range(2)]
        for c in range(2):
            dev.set_arbiter(c, "acceleration")
        devices[serialize] = dev
    firsts: dict[bool, list[float]] = {True: [], False: []}
    totals: dict[bool, list[float]] = {True: [], False: []}
    for step in range(1, repeats + 3):
        for serialize, dev in devices.items():
            start = time.perf_counter()
            handles = [dev.run_adam_async(*bufs[serialize][c], hyperparameters=HP, step=step, channel=c)
                       for c in range(2)]
            while not any(h.done() for h in handles):
                time.sleep(0.0002)
            first = time.perf_counter() - start
            for h in handles:
                h.wait()
            if step > 2:  # the first two are warm-up
                firsts[serialize].append(first)
                totals[serialize].append(time.perf_counter() - start)
    for dev in devices.values():
        dev.close()
    print(f"\nemulated AXDIMM, 2 channels x {COUNT.format_short(half)} params, median of {repeats}:")
    for serialize in devices:
        total, first = statistics.median(totals[serialize]), statistics.median(firsts[serialize])
        print(f"  serialize_compute={serialize!s:5}  both channels {n / total / 1e6:6.0f} M params/s, "
              f"first channel done after {first * 1e3:6.1f} ms, both after {total * 1e3:6.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M", help="parameter counts, e.g. 10M,100M")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--axdimm", action="store_true", help="also time the emulated AXDIMM's channels")
    parser.add_argument("--bandwidth-size", default="64M", help="floats the bandwidth is measured over (at least the "
                        "largest size), far beyond the caches")
    args = parser.parse_args()
    sizes = [int(COUNT.parse(s)) for s in args.sizes.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bw_size = max(*sizes, int(COUNT.parse(args.bandwidth_size)))
    rates = bandwidth(bw_size, args.repeats)
    bw = max(rates.values())
    bound = bw / BYTES_PER_PARAM / 1e6
    shown = ", ".join(f"{name} {rate / 1e9:.1f}" for name, rate in rates.items())
    print(f"memory bandwidth over {COUNT.format_short(bw_size)} floats (GB/s, best of {args.repeats}): {shown}")
    print(f"-> Adam bound {bound:.0f} M params/s at {bw / 1e9:.1f} GB/s and {BYTES_PER_PARAM} bytes/param "
          "(over 100% means the fused loop streams memory better than these simple ops)")
    for n in sizes:
        bench_size(n, args.repeats, bound)
        if args.axdimm:
            bench_axdimm(n, args.repeats)


if __name__ == "__main__":
    main()
