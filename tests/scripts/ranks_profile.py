"""`hetero profile` of a script on every rank of a torchrun job, as `hetero profile --nproc-per-node N` runs it in
its workers (1 warm-up and 2 measured steps, the links between the ranks measured), with the bundled CPU profile's
machine instead of a measured one (measuring disks and memory takes tens of seconds and says nothing about the
script):

    python -m torch.distributed.run --standalone --nproc-per-node 2 ranks_profile.py PROFILE SCRIPT [ARGS]
"""

import dataclasses
import sys
from pathlib import Path

from hetero.profile import peers
from hetero.profile.profiler import ProfileOptions, assemble, measure_script
from hetero.schema import files
from hetero.schema.profile import Profile

REPO = Path(__file__).resolve().parents[2]

output, script, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
run = measure_script(script, args, ProfileOptions(steps=2, warmup=1))
links = peers.measure(run.device)
if peers.rank() == 0:
    bundled = files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile).machine
    tiers = [dataclasses.replace(t, path=str(output.parent)) if t.path else t for t in bundled.tiers]
    files.save(assemble(run, dataclasses.replace(bundled, tiers=tiers, peers=links)), output)
