"""Public-style training scripts through `hetero profile`, `hetero plan` and `hetero run`, against plain PyTorch.

Every script in `public/` takes `OUT [STEPS]` and saves `{"losses": [...], "state": {name: tensor}}` to OUT. The
profile measures the script for real; only the machine part is the bundled CPU profile's (measuring disks and
memory takes tens of seconds and says nothing about the script). Plans are either solved by `hetero plan` or
forced by hand so that hetero's mechanisms really run (the default plan on a machine without a GPU may be plain).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from hetero.cli.main import main
from hetero.harness.script import run_script
from hetero.profile.profiler import ProfileOptions, assemble, measure_script
from hetero.schema import files
from hetero.schema.plan import (
    ActivationPlan,
    AllocatorPlan,
    Budget,
    Eviction,
    OptimizerPlan,
    Plan,
    PlannedModel,
    Predicted,
    Source,
    StatePlacement,
)
from hetero.schema.profile import Profile

REPO = Path(__file__).resolve().parents[2]
PUBLIC = Path(__file__).resolve().parent / "public"
STEPS = "8"


def script(name: str) -> str:
    return str(PUBLIC / f"{name}.py")


def profile(name: str, workdir: Path, model: str | None = None, args: tuple[str, ...] = ()) -> Path:
    """`hetero profile` of the script (1 warm-up and 2 measured steps) on the bundled machine; the profile's path."""
    run = measure_script(script(name), [str(workdir / "profiled.pt"), STEPS, *args],
                         ProfileOptions(steps=2, warmup=1, model_name=model))
    bundled = files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile).machine
    tiers = [dataclasses.replace(t, path=str(workdir)) if t.path else t for t in bundled.tiers]
    path = workdir / "profile.yaml"
    files.save(assemble(run, dataclasses.replace(bundled, tiers=tiers)), path)
    return path


def plan(profile_path: Path, *flags: str) -> Plan:
    """`hetero plan` beside the profile, with `flags`; the plan written."""
    out = profile_path.parent / "plan.yaml"
    assert main(["plan", "--profile", str(profile_path), "-o", str(out), *flags]) == 0
    return files.load(out, expect=Plan)


def forced(profile_path: Path, *, optimizer: str | None = "host", tiering: bool = True,
           budget_bytes: int | None = None, overlap: bool | None = None) -> Path:
    """A plan made by hand, the way a user edits one: every optimizer state on `optimizer` (host, or the emulated
    AXDIMM), its updates overlapped with backward where `hetero plan` would (or as `overlap` says), every layer's
    saved activations evicted to disk (the smallest tensors too), and with `budget_bytes` a DRAM budget kept by
    returning freed memory from the start (and watched)."""
    prof = files.load(profile_path, expect=Profile)
    t = prof.training
    names = [n for layer in prof.layers for n in layer.param_names()]
    states = [StatePlacement(param=n, tier=optimizer, channel=i % 2 if optimizer == "axdimm" else None)
              for i, n in enumerate(names)]
    opt = OptimizerPlan(kind=t.optimizer, device=optimizer, backend="emulated" if optimizer == "axdimm" else None,
                        channels=2 if optimizer == "axdimm" else None,
                        overlap_backward=not t.edits_grads and not t.updates_wait if overlap is None else overlap,
                        micro_batches=t.grad_accumulation, states=states) if optimizer else None
    layers = [x for x in prof.layers if x.saved_bytes > 0]
    schedule = [Eviction(layer=x.name, evict_bytes=x.saved_bytes, prefetch_at_s=0.0,
                         prefetch_after=layers[i + 1].name if i + 1 < len(layers) else None)
                for i, x in enumerate(layers)]
    acts = ActivationPlan(fast="dram", slow="nvme0", slow_path=str(profile_path.parent), stay_time_s=0.0,
                          min_tensor_bytes=0, schedule=schedule) if tiering else None
    out = profile_path.parent / "forced.yaml"
    files.save(Plan(source=Source(profile=profile_path.name, profile_sha256=files.content_sha256(prof),
                                  model_fingerprint=prof.model.fingerprint,
                                  models=[PlannedModel(name=m.name, fingerprint=m.fingerprint)
                                          for m in prof.model.models]),
                    budget=Budget(gpu_memory_bytes=None, dram_budget_bytes=budget_bytes, reserve=1.0), layers=[],
                    optimizer=opt, activations=acts, routing=None, predicted=Predicted(iteration_s=0.0, peak_bytes={}),
                    omitted={"layers": "test", "routing": "test"} | ({} if opt else {"optimizer": "test"}) |
                            ({} if acts else {"activations": "test"}),
                    allocator=AllocatorPlan(mmap_threshold_bytes=AllocatorPlan.RETURNING,
                                            trim_threshold_bytes=AllocatorPlan.RETURNING) if budget_bytes else None),
               out)
    return out


def run(name: str, plan_path: Path, out: Path, *flags: str, args: tuple[str, ...] = ()) -> tuple[int, dict | None]:
    """`hetero run` of the script under the plan: its exit code and what it saved."""
    code = main(["run", "--plan", str(plan_path), *flags, script(name), str(out), STEPS, *args])
    return code, torch.load(out, weights_only=False) if out.is_file() else None


def plain(name: str, out: Path, args: tuple[str, ...] = ()) -> dict:
    """The script under plain PyTorch, in this process, as `python script.py OUT STEPS` runs it."""
    assert run_script(script(name), [str(out), STEPS, *args]).exit_code == 0
    return torch.load(out, weights_only=False)


def assert_trains_as_plain(result: dict, reference: dict) -> None:
    """Losses and final weights equal to plain PyTorch's (hetero's host Adam is torch's fused AdamW: ~1 ULP a step
    from the default implementation, well inside assert_close's float32 tolerance)."""
    assert len(result["losses"]) == len(reference["losses"]) == int(STEPS) * (len(reference["losses"]) // int(STEPS))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]))
    assert result["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        torch.testing.assert_close(result["state"][key], value, msg=lambda m, key=key: f"{key}: {m}")


def ranks(name: str, *jobs: str, cwd: Path) -> str:
    """`jobs` (tests/scripts/ranks.py) one after the other in one torchrun job of 2 ranks; its stderr. Each job gets
    a free port for its process group."""
    ports = []
    sockets = [socket.socket() for _ in jobs]
    for s in sockets:  # held together, so that no two jobs get one port
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(Path(cwd) / "torchrun-logs"),  # not the temp directory, which torchrun never cleans
                           str(Path(__file__).parent / "ranks.py"), script(name), STEPS,
                           *(f"{job}={port}" for job, port in zip(jobs, ports))],
                          cwd=cwd, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr
