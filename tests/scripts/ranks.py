"""Several jobs on every rank of one torchrun job, one after the other, each with a process group of its own (a fresh
port each: torchrun's rendezvous is started once), so that a test pays for torchrun and its workers' imports once:

    python -m torch.distributed.run --standalone --nproc-per-node 2 ranks.py SCRIPT STEPS JOB:PORT...

JOB is `plain=OUT` (the script as `torchrun SCRIPT OUT STEPS` runs it), `profile=PROFILE` (`hetero profile
--nproc-per-node N` as its workers measure the script, 1 warm-up and 2 measured steps, the links between the ranks
measured, with the bundled CPU profile's machine: measuring disks and memory takes tens of seconds and says nothing
about the script) or `run=PLAN=OUT` (`hetero run --nproc-per-node N --plan PLAN` as its workers run the script).
"""

import dataclasses
import os
import sys
from pathlib import Path

import torch.distributed as dist

from hetero.harness.script import run_script
from hetero.launch.launcher import run_here
from hetero.profile import peers
from hetero.profile.profiler import ProfileOptions, assemble, measure_script
from hetero.schema import files
from hetero.schema.profile import Profile

REPO = Path(__file__).resolve().parents[2]


def profile(script: str, args: list[str], output: Path) -> None:
    run = measure_script(script, args, ProfileOptions(steps=2, warmup=1))
    links = peers.measure(run.device)
    if peers.rank() == 0:
        bundled = files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile).machine
        tiers = [dataclasses.replace(t, path=str(output.parent)) if t.path else t for t in bundled.tiers]
        files.save(assemble(run, dataclasses.replace(bundled, tiers=tiers, peers=links)), output)


def main(script: str, steps: str, jobs: list[str]) -> int:
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # each job's rank 0 serves its own store
    for job in jobs:
        what, *paths, port = job.split("=")
        os.environ["MASTER_PORT"] = port
        if what == "plain":
            code = run_script(script, [paths[0], steps]).exit_code
        elif what == "profile":
            profile(script, [str(Path(paths[0]).parent / "profiled.pt"), steps], Path(paths[0]))
            code = 0
        else:
            code = run_here(script, [paths[1], steps], Path(paths[0]), False, leader=peers.rank() == 0).exit_code
        if dist.is_initialized():  # a job stopped before the script destroyed its group
            dist.destroy_process_group()
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
