"""Where a training process's memory goes: run a script (as `python SCRIPT ARGS` would) and report, per phase,
the peak resident memory and what glibc's allocator holds, plus CPU time and page faults per step.

    .venv/bin/python bench/allocator.py SCRIPT [ARGS]                        # plain PyTorch
    .venv/bin/hetero run --plan PLAN bench/allocator.py SCRIPT [ARGS]        # the same under a plan
    MALLOC_MMAP_THRESHOLD_=131072 .venv/bin/python bench/allocator.py ...    # with an allocator setting

RSS is sampled every 2 ms by a thread; `mallinfo2` (glibc) is read at every forward end (the first
`loss.backward()` call of a step): bytes in use, bytes free inside the heap, bytes mapped on their own. CPU time
(user + system) and minor faults are per optimizer step, after the second. Linux and glibc only.
"""

import ctypes
import os
import resource
import runpy
import statistics
import sys
import threading
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1e6


class Watch:
    def __init__(self):
        self.phase, self.rss_peak, self.heap, self.steps = "start", {}, [], []
        self.running = True
        threading.Thread(target=self._sample, daemon=True).start()
        backward = torch.Tensor.backward

        def watched(tensor, *args, **kwargs):
            if self.phase != "backward":
                info = LIBC.mallinfo2()
                self.heap.append((info.uordblks, info.fordblks, info.hblkhd))
            self.phase = "backward"
            return backward(tensor, *args, **kwargs)

        torch.Tensor.backward = watched
        register_optimizer_step_pre_hook(lambda *a: setattr(self, "phase", "step"))
        register_optimizer_step_post_hook(self._step_end)

    def _sample(self) -> None:
        with open("/proc/self/statm") as statm:
            while self.running:
                statm.seek(0)
                rss = int(statm.read().split()[1]) * PAGE
                self.rss_peak[self.phase] = max(self.rss_peak.get(self.phase, 0), rss)
                time.sleep(0.002)

    def _step_end(self, *args) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.steps.append((usage.ru_utime + usage.ru_stime, usage.ru_minflt))
        self.phase = "forward"

    def report(self) -> str:
        self.running = False
        cpu = [b[0] - a[0] for a, b in zip(self.steps[1:], self.steps[2:])]
        faults = [b[1] - a[1] for a, b in zip(self.steps[1:], self.steps[2:])]
        peaks = ", ".join(f"{k} {v / MB:.0f}" for k, v in self.rss_peak.items())
        heap = "; ".join(f"in use {u / MB:.0f}, free {f / MB:.0f}, mapped {m / MB:.0f}" for u, f, m in self.heap)
        out = [f"peak RSS by phase (MB): {peaks}", f"heap at each forward end (MB): {heap}"]
        if cpu:
            out.append(f"per step after the second: CPU {statistics.median(cpu) * 1e3:.0f} ms, "
                       f"{statistics.median(faults):.0f} minor faults (medians of {len(cpu)})")
        return "\n".join(f"allocator: {line}" for line in out)


def main() -> None:
    watch = Watch()
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        print(watch.report(), file=sys.stderr)


if __name__ == "__main__":
    main()
