"""Scratch GPU diagnostics for one device call (not committed): where the GPU memory of two failing cases goes.

A: the shadow test's plans (tests/run/test_shadow.py): count, anchored prediction, measured allocated/reserved, and
   for host-grads the live blocks at the allocated peak grouped by the first non-torch frame.
B: the held-out LM's half-budget plan run without its cap: peaks and composition at the allocated and reserved peaks.
"""

from __future__ import annotations

import collections
import os
import pickle
import sys
import tempfile
import traceback
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp())
MiB = 2**20


def key(ev, depth=2):
    frames = [f for f in ev.get("frames", []) if "/torch/" not in f["filename"] and "<" not in f["filename"]]
    short = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames[:depth]]
    return " < ".join(short) or "?"


def analyse(snap, label, top=30) -> str:
    events = snap["device_traces"][0]
    cur = peak = at = 0
    res = peak_res = at_res = 0
    for i, ev in enumerate(events):
        a = ev["action"]
        if a == "alloc":
            cur += ev["size"]
            if cur > peak:
                peak, at = cur, i
        elif a == "free_completed":
            cur -= ev["size"]
        elif a in ("segment_alloc", "segment_map"):
            res += ev["size"]
            if res > peak_res:
                peak_res, at_res = res, i
        elif a in ("segment_free", "segment_unmap"):
            res -= ev["size"]
    lines = [f"== {label}: {len(events)} events; allocated peak {peak / MiB:.1f} MiB (event {at}), "
             f"reserved peak {peak_res / MiB:.1f} MiB (event {at_res}) [trace-relative]"]
    for name, stop in (("allocated", at), ("reserved", at_res)):
        live, segs = {}, {}
        for ev in events[:stop + 1]:
            a = ev["action"]
            if a == "alloc":
                live[ev["addr"]] = ev
            elif a == "free_completed":
                live.pop(ev["addr"], None)
            elif a in ("segment_alloc", "segment_map"):
                segs[ev["addr"]] = ev
            elif a in ("segment_free", "segment_unmap"):
                segs.pop(ev["addr"], None)
        by = collections.Counter()
        for ev in live.values():
            by[key(ev)] += ev["size"]
        per_stream = collections.Counter()
        for ev in live.values():
            per_stream[ev.get("stream", 0)] += ev["size"]
        seg_stream = collections.Counter()
        for ev in segs.values():
            seg_stream[ev.get("stream", 0)] += ev["size"]
        lines.append(f"-- at the {name} peak: live {sum(e['size'] for e in live.values()) / MiB:.1f} MiB in "
                     f"{len(live)} blocks; segments {sum(e['size'] for e in segs.values()) / MiB:.1f} MiB")
        lines.append("   allocated by stream: " + ", ".join(f"{s}: {b / MiB:.1f}" for s, b in per_stream.items()))
        lines.append("   segments by stream:  " + ", ".join(f"{s}: {b / MiB:.1f}" for s, b in seg_stream.items()))
        for k, b in by.most_common(top):
            lines.append(f"   {b / MiB:8.2f} MiB  {k}")
        if name == "allocated":
            recent = [key(ev, 3) + f" {ev['action']} {ev['size'] / MiB:.2f}" for ev in events[max(0, stop - 12):stop + 1]]
            lines.append("   last events before the peak:\n     " + "\n     ".join(recent))
    return "\n".join(lines)


def record():
    torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")


def part_a() -> None:
    import gc
    sys.path.insert(0, str(Path.cwd()))
    from hetero.plan.model import GPU
    from hetero.plan.solve import PlanOptions, plan, predict, predicted_of
    from hetero.profile.profiler import ProfileOptions, profile_script
    from hetero.run.runtime import Runtime
    from hetero.schema.plan import LayerPlan
    from tests.run.test_shadow import (EXAMPLE, GPU_ARGS, GPU_CONFIG, GPU_PLANS, MODES, _cublas_workspaces,
                                       compare, gpt, train)

    prof = profile_script(str(EXAMPLE), GPU_ARGS, ProfileOptions(steps=3, warmup=2, nvme_dir=tempfile.mkdtemp()))
    m = prof.memory
    print(f"A profile: plain allocated {m.gpu_allocated_peak_bytes / MiB:.1f} MiB reserved "
          f"{m.gpu_reserved_peak_bytes / MiB:.1f} MiB", flush=True)
    for config in ["host-grads", "mixed-host-grads", "all-dha", "mixed", "all-gfgb", "all-dfgb", "planned"]:
        planned = plan(prof, PlanOptions(optimizer_device="host", reserve=1.0))
        planned.activations = None
        planned.omitted["activations"] = "test"
        if GPU_PLANS[config] is not None:
            mode, grad = GPU_PLANS[config]
            planned.layers = [LayerPlan(name=e.name, mode=MODES[i % 3] if mode == "mixed" else mode, grad=grad)
                              for i, e in enumerate(planned.layers)]
        result = predict(prof, planned)
        anchored = predicted_of(prof, planned, result)
        gc.collect()
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated()
        ref_model = gpt(**GPU_CONFIG).cuda()
        ref = train(ref_model, device="cuda", size=8)
        ref_model.cpu()
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        base_res = torch.cuda.memory_reserved()
        model = gpt(**GPU_CONFIG).cuda()
        peaks, res, held = [], [], []

        def measure(step):
            if step == 0:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            peaks.append(torch.cuda.max_memory_allocated())
            res.append(torch.cuda.max_memory_reserved())
            held.append(torch.cuda.memory_allocated())

        with Runtime(planned, script=__file__):
            out = train(model, device="cuda", size=8, after_backward=measure)
        ok = "equal"
        try:
            compare(model, ref_model, out, ref)
        except AssertionError:
            ok = "differ"
        gpu_items = {k: round(v / MiB, 1) for k, v in anchored.gpu.items()}
        gpu_items |= {"-" + k: round(v / MiB, 1) for k, v in anchored.gpu_saved.items()}
        print(f"A {config}: count {result.peak_bytes[GPU] / MiB:.1f} MiB (act {result.act_peak_bytes / MiB:.1f}), "
              f"anchored {anchored.peak_bytes[GPU] / MiB:.1f} MiB {gpu_items}; measured allocated "
              f"{max(peaks[1:]) / MiB:.1f} MiB (minus base {(max(peaks[1:]) - base) / MiB:.1f}; base {base / MiB:.1f}, "
              f"left by the previous config {left / MiB:.1f}), reserved {max(res[1:]) / MiB:.1f} MiB (base "
              f"{base_res / MiB:.1f}); held after backward {sorted({round(h / MiB, 1) for h in held[1:]})}; {ok}",
              flush=True)
        del model, ref_model
        gc.collect()
        torch.cuda.empty_cache()
        print(f"A {config}: after the run and gc: allocated {torch.cuda.memory_allocated() / MiB:.1f} MiB, reserved "
              f"{torch.cuda.memory_reserved() / MiB:.1f} MiB", flush=True)


def part_b(plan_path: str, script_args: list[str]) -> None:
    """Run `hetero run` in this process with the history recorded."""
    record()
    sys.argv = ["hetero", "run", "--plan", plan_path, *script_args]
    import runpy
    try:
        runpy.run_module("hetero", run_name="__main__")
    except SystemExit as e:
        print(f"B exit {e.code}", flush=True)
    print(f"B peaks: allocated {torch.cuda.max_memory_allocated() / MiB:.1f} MiB, reserved "
          f"{torch.cuda.max_memory_reserved() / MiB:.1f} MiB", flush=True)
    snap = torch.cuda.memory._snapshot()
    with open(OUT / "b-snapshot.pickle", "wb") as f:
        pickle.dump(snap, f)
    print(analyse(snap, "B " + plan_path), flush=True)


if __name__ == "__main__":
    which = sys.argv[1]
    try:
        if which == "a":
            part_a()
        else:
            part_b(sys.argv[2], sys.argv[3:])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
