"""State files that detect damage (issue 33, item 2): every NVMe record's crc32 is checked on read, so a file changed
or removed behind hetero's back ends the run with one line naming the file and the key (the parameter) it held,
and exit code 6, never a NaN with exit 0 or a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hetero.cli.main import main
from hetero.errors import DAMAGED, Damaged
from hetero.run.devices.nvme import NvmeStore
from hetero.schema import files
from tests.cli.test_run import net
from tests.profile import scripts
from tests.run.plans import optimizer_plan


@pytest.fixture
def store(tmp_path):
    # buffered: a key's data starts at byte 0 of its file, so the test knows which bytes it flips
    with NvmeStore.private(str(tmp_path), "states", "optimizer.nvme.path", direct=False) as s:
        yield s


def the_file(store: NvmeStore) -> Path:
    (path,) = [p for p in store.directory.iterdir() if p.suffix == ".bin"]
    return path


def test_four_flipped_bytes_are_found_on_read_naming_the_file_and_the_key(store):
    store.write("head.weight.0.m", np.arange(1000, dtype=np.float32))
    path = the_file(store)
    with open(path, "r+b") as f:
        f.seek(40)
        flipped = bytes(b ^ 0xFF for b in f.read(4))
        f.seek(40)
        f.write(flipped)
    with pytest.raises(Damaged) as e:
        store.read("head.weight.0.m", np.empty(1000, dtype=np.float32))
    assert e.value.exit_code == DAMAGED == 6
    assert str(path) in e.value.message and "head.weight.0.m" in e.value.message
    assert "checksum" in e.value.message and "\n" not in e.value.message
    assert e.value.message.startswith("optimizer.nvme.path: ")


@pytest.mark.parametrize("how", ["removed", "cut short"])
def test_a_removed_or_cut_file_is_the_same_error(store, how):
    store.write("k", np.ones(5000, dtype=np.float32))
    path = the_file(store)
    if how == "removed":
        path.unlink()
    else:
        os.truncate(path, 100)
    handle = store.read_async("k", np.empty(5000, dtype=np.float32))  # a worker thread's error reaches the waiter
    with pytest.raises(Damaged, match="which holds k"):
        handle.wait()


STEPS = """
import glob, os
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(6):
    loss = F.cross_entropy(model(torch.randn(8, 16)), torch.randint(4, (8,)))
    loss.backward()
    opt.step(); opt.zero_grad()
    if step == 1:  # someone else writes over the state files between two steps
        for name in glob.glob(os.path.join(sys.argv[1], "hetero-states-*", "*.bin")):
            data = open(name, "rb").read()
            open(name, "r+b").write(bytes(b ^ 0xFF for b in data))
print("final_loss", loss.item())
"""


def test_a_run_whose_state_files_are_overwritten_ends_with_exit_6_in_one_line(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    nvme = tmp_path / "nvme"
    files.save(optimizer_plan(net(), nvme=("head.weight", "body.0.weight"), nvme_path=str(nvme)), "plan.yaml")
    assert main(["run", "--skip-profile-check", scripts.write(tmp_path, STEPS), str(nvme)]) == 6
    out, err = capfd.readouterr()
    assert "final_loss" not in out and "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and "checksum mismatch" in errors[0], err
    assert ".weight." in errors[0] and "hetero-states-" in errors[0]
    assert not nvme.exists() or os.listdir(nvme) == []  # cleaned up all the same
