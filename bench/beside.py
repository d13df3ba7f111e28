"""Workers beside compute on this machine: how much longer a disk read or write (through the runtime's NVMe store,
called from a worker thread) and an emulated AXDIMM update take while a GEMM loop runs on all cores, and how much
they slow the loop, against a thread streaming memory. What `hetero profile` measures into
`machine.tiers[].read_beside_compute` / `write_beside_compute` and `machine.axdimm.*_beside_compute`, at more sizes.

    .venv/bin/python bench/beside.py [--dir /tmp] [--disk-mib 1,4,16,64] [--update-params 1024,1048576]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.profile.timing import beside_compute, median_time  # noqa: E402
from hetero.profile.updates import update_job  # noqa: E402
from hetero.run.devices.axdimm import EmulatedAxdimm  # noqa: E402
from hetero.run.devices.nvme import NvmeStore  # noqa: E402
from hetero.run.states import AxdimmHome, ChannelDriver  # noqa: E402

MiB = 2**20


def row(table: Table, label: str, work) -> None:
    alone = median_time(work, repeats=9, min_s=0)
    b = beside_compute([work])
    table.add_row(label, f"{alone * 1e3:.3f}", f"{b.work_s * 1e3:.3f}", f"{b.work_s / alone:.2f}x",
                  f"{b.compute:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory of the disk tier")
    p.add_argument("--disk-mib", default="1,4,16,64", help="sizes of the disk reads and writes, in MiB")
    p.add_argument("--update-params", default="1024,1048576", help="sizes of the AXDIMM updates, in parameters")
    a = p.parse_args()
    table = Table(title="one worker beside a GEMM loop on all cores", title_justify="left")
    for col in ("worker", "call alone ms", "call beside ms", "call slower", "GEMM loop slower"):
        table.add_column(col, justify="right")
    src = torch.ones(8 * MiB)
    dst = torch.zeros_like(src)
    row(table, "memory copy 32MiB (streaming)", lambda: dst.copy_(src))
    with NvmeStore(Path(a.dir) / "hetero-bench-beside") as store:
        for mib in (int(n) for n in a.disk_mib.split(",")):
            data, out = torch.ones(mib * MiB, dtype=torch.uint8), torch.zeros(mib * MiB, dtype=torch.uint8)
            store.write_async("x", data).wait()
            row(table, f"disk read {mib}MiB", lambda: store.read_async("x", out).wait())
            row(table, f"disk write {mib}MiB", lambda: store.write_async("x", data).wait())
    with EmulatedAxdimm(channel_capacity_bytes=64 * MiB, channels=1) as device:
        driver = ChannelDriver(device, 0)
        try:
            for numel in (int(n) for n in a.update_params.split(",")):
                update = update_job(AxdimmHome(driver, torch.zeros(numel)), driver, numel)
                row(table, f"AXDIMM update {numel} params", update)
        finally:
            driver.close()
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
