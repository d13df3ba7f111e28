"""How fast `hetero plan` is on a 1000-layer GPU model, and how close MemFerry's search gets to the optimum.

    .venv/bin/python bench/plan.py                  # plan() and the whole `hetero plan` command, 1000 layers
    .venv/bin/python bench/plan.py --layers 5000
    .venv/bin/python bench/plan.py --gaps           # heuristics vs the exhaustive optimum on small random models

The profile is synthetic (tests/plan/synthetic.py): layers from 64 KiB to 128 MiB of parameters, DHA timings, PCIe
curves, a DRAM and an NVMe tier. Timings vary from run to run on a shared machine: the best of several is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.cli.main import main as cli  # noqa: E402
from hetero.plan.solve import PlanOptions, plan  # noqa: E402
from hetero.schema import files  # noqa: E402
from tests.plan.synthetic import gap_study, gpu_profile  # noqa: E402


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def speed(layers: int, repeats: int) -> None:
    profile = gpu_profile(layers, seed=1)
    solver = timed(lambda: plan(profile, PlanOptions()), repeats)
    with tempfile.TemporaryDirectory() as tmp:
        source, target = Path(tmp, "profile.yaml"), Path(tmp, "plan.yaml")
        files.save(profile, source)
        args = ["plan", "--profile", str(source), "-o", str(target)]
        with contextlib.redirect_stdout(io.StringIO()):
            command = timed(lambda: cli(args), repeats)
    print(f"plan() on {layers} layers: best {min(solver):.3f} s, median {statistics.median(solver):.3f} s "
          f"({repeats} runs)")
    print(f"`hetero plan` on {layers} layers (load profile, plan, write plan): best {min(command):.3f} s, "
          f"median {statistics.median(command):.3f} s")


def gaps() -> None:
    print("MemFerry on random small models, against the exhaustive optimum (simulated iteration time):")
    print("layers  modes          budget   instances  paper worse  paper worst gap  ours worse  ours worst gap")
    for layers, instances, forward_only, fraction in ((4, 200, False, None), (6, 200, False, None),
                                                      (8, 40, False, None), (12, 20, True, None),
                                                      (6, 100, False, 0.75), (6, 100, False, 0.5)):
        s = gap_study(instances, layers, seed=1000, forward_only=forward_only, budget_fraction=fraction)
        modes = "gfgb/dha" if forward_only else "gfgb/dha/dfgb"
        budget = "device" if fraction is None else f"{fraction:.0%} of opt"
        paper = (f"{s['paper_worse']:>11}  {s['paper_worst']:>15.2%}" if fraction is None else f"{'-':>11}  {'-':>15}")
        print(f"{layers:>6}  {modes:<13}  {budget:<10} {s['instances']:>7}  {paper}  {s['ours_worse']:>10}  "
              f"{s['ours_worst']:>14.2%}")
    print("paper: Alg. 1 + greedy DFGB (Alg. 1 alone where only gfgb/dha are allowed); ours: + local search from "
          "three starts and the budget family. Budgeted rows: the GPU budget is a fraction of the memory the "
          "unconstrained optimum uses (instances where nothing fits are left out).")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gaps", action="store_true", help="compare with the exhaustive optimum (about a minute)")
    args = parser.parse_args()
    gaps() if args.gaps else speed(args.layers, args.repeats)
