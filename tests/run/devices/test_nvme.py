from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from hetero.errors import HeteroError, Interrupted
from hetero.run.devices.nvme import NvmeStore

CHUNK = 64 << 10  # small chunks: multi-chunk files stay tiny and fast


def _files(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.fixture(params=["auto", "buffered"])
def store(request, tmp_path):
    with NvmeStore(tmp_path / "nvme", chunk_bytes=CHUNK, direct=request.param == "auto") as s:
        yield s


@pytest.mark.parametrize("dtype, numel", [(torch.float32, 100_003), (torch.bfloat16, 7), (torch.uint8, 0)])
def test_round_trip(store, dtype, numel):
    data = torch.randn(numel).to(dtype) if dtype != torch.uint8 else torch.zeros(numel, dtype=dtype)
    store.write_async("w", data).wait()
    out = torch.empty_like(data)
    handle = store.read_async("w", out)
    handle.wait()
    assert handle.done()
    assert torch.equal(out, data)
    assert "w" in store and store.stored_bytes == data.nbytes


def test_direct_io_is_used_where_the_file_system_allows_it(tmp_path):
    with NvmeStore(tmp_path) as s:
        assert s.direct  # ext4/xfs/tmpfs >= 6.6 all take O_DIRECT; a failure here means a regression in the probe


def test_falls_back_to_buffered_io_when_o_direct_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    with NvmeStore(tmp_path, chunk_bytes=CHUNK) as s:
        assert not s.direct and "buffered" in repr(s)
        data = torch.arange(50_000, dtype=torch.float32)
        s.write_async("k", data).wait()
        out = torch.zeros_like(data)
        s.read_async("k", out).wait()
        assert torch.equal(out, data)


def test_files_are_private_and_removed_at_close(tmp_path):
    directory = tmp_path / "a" / "b"
    s = NvmeStore(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for i in range(3):
        s.write_async(f"k{i}", torch.ones(1000)).wait()
    names = _files(directory)
    assert len(names) == 3
    assert all(stat.S_IMODE((directory / n).stat().st_mode) == 0o600 for n in names)
    s.close()
    assert not (tmp_path / "a").exists()  # it made both levels, so it removes both
    s.close()  # idempotent
    with pytest.raises(HeteroError, match="closed"):
        s.write_async("k", torch.ones(1))


def test_an_existing_directory_and_foreign_files_stay(tmp_path):
    (tmp_path / "theirs.txt").write_text("keep me")
    with NvmeStore(tmp_path) as s:
        s.write_async("k", torch.ones(10)).wait()
        s.write_async("k", torch.zeros(10)).wait()  # the replaced version's file goes at once
        assert len(_files(tmp_path)) == 2
    assert _files(tmp_path) == ["theirs.txt"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt, Interrupted])
def test_files_are_removed_when_an_exception_or_ctrl_c_leaves_the_with_block(tmp_path, error):
    with pytest.raises(error), NvmeStore(tmp_path / "nvme") as s:
        s.write_async("k", torch.ones(100_000))  # still in flight, perhaps, when the exception arrives
        raise error()
    assert not (tmp_path / "nvme").exists()


def test_files_are_removed_at_exit_after_an_unhandled_ctrl_c(tmp_path):
    directory = tmp_path / "nvme"
    script = (
        "import numpy as np\n"
        "from hetero.run.devices.nvme import NvmeStore\n"
        f"s = NvmeStore({str(directory)!r})\n"
        "s.write_async('k', np.ones(100_000)).wait()\n"
        "print(len(list(s.directory.iterdir())), flush=True)\n"
        "raise KeyboardInterrupt\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.stdout.strip() == "1", result.stderr
    assert "KeyboardInterrupt" in result.stderr
    assert not directory.exists()


def test_a_full_disk_is_a_clear_error_and_loses_nothing(store, monkeypatch):
    old = torch.arange(100_000, dtype=torch.float32)
    store.write_async("k", old).wait()
    files_before = _files(store.directory)
    new = torch.full((100_000,), 7.0)
    real_pwrite, calls = os.pwritev, []

    def fill_up(fd, buffers, offset):
        calls.append(offset)
        if len(calls) > 1:  # the first buffer lands: a half-written file must be cleaned up
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, buffers[:1], offset)

    monkeypatch.setattr(os, "pwritev", fill_up)
    with pytest.raises(HeteroError, match=rf"no space left in {store.directory} for 400000 bytes") as info:
        store.write_async("k", new).wait()
    assert info.value.hint.startswith("free space there")  # the store was named by no option: see tests/faults
    monkeypatch.undo()
    assert _files(store.directory) == files_before
    assert torch.all(new == 7.0)
    out = torch.empty_like(old)
    store.read_async("k", out).wait()
    assert torch.equal(out, old)


def test_a_read_waits_for_the_write_in_flight(store, monkeypatch):
    store.write_async("k", torch.zeros(100_000)).wait()
    release, real_pwrite = threading.Event(), os.pwritev

    def slow(fd, buffers, offset):
        assert release.wait(10)
        return real_pwrite(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", slow)
    new = torch.randn(100_000)
    write = store.write_async("k", new)
    out = torch.empty_like(new)
    read = store.read_async("k", out)
    time.sleep(0.05)
    assert not write.done() and not read.done()
    release.set()
    read.wait(10)
    assert write.done()
    assert torch.equal(out, new)


def test_delete_and_bad_requests(store):
    store.write_async("k", np.arange(10, dtype=np.float64)).wait()
    with pytest.raises(ValueError, match="80 bytes"):
        store.read_async("k", np.empty(9, dtype=np.float64)).wait()
    with pytest.raises(ValueError, match="contiguous"):
        store.write_async("t", torch.ones(4, 4).t())
    store.delete("k")
    assert "k" not in store and _files(store.directory) == []
    with pytest.raises(KeyError):
        store.read_async("k", np.empty(10))
    with pytest.raises(KeyError):
        store.delete("k")


def test_an_unwritable_place_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(HeteroError) as e:
        NvmeStore(tmp_path / "file" / "sub")
    assert str(tmp_path / "file" / "sub") in e.value.message and e.value.hint is not None


def test_a_full_disk_at_open_is_the_same_clear_error_and_leaves_no_directory(tmp_path, monkeypatch):
    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(HeteroError, match="no space left in"):
        NvmeStore(tmp_path / "nvme")
    assert _files(tmp_path) == []


@pytest.mark.parametrize("nbytes", [1, 100, 4096, 4096 * 3 + 17, 3 * (64 << 10) + 123])
@pytest.mark.parametrize("shift", [0, 64, 4095])
def test_any_offset_and_size_round_trips_through_the_direct_path(tmp_path, nbytes, shift):
    """Data lands at its source's offset within a block, so the aligned middle moves without the bounce buffer;
    reading into a buffer at another offset takes the bounce path and must give the same bytes."""
    src = _at_offset(nbytes, shift)
    src[:] = np.random.default_rng(nbytes + shift).integers(0, 256, nbytes, dtype=np.uint8)
    with NvmeStore(tmp_path / "s", chunk_bytes=64 << 10) as store:
        store.write_async("k", src).wait()
        for offset in (shift, (shift + 8) % 4096):
            out = _at_offset(nbytes, offset)
            store.read_async("k", out).wait()
            assert np.array_equal(out, src), (store.direct, offset)


def _at_offset(nbytes: int, offset: int) -> np.ndarray:
    raw = np.empty(nbytes + 2 * 4096, dtype=np.uint8)
    start = (-raw.ctypes.data % 4096) + offset
    return raw[start:start + nbytes]


def test_blocking_calls_do_their_io_on_the_calling_thread(store, monkeypatch):
    threads, real_pwrite, real_preadv = set(), os.pwritev, os.preadv

    def pwrite(fd, buffers, offset):
        threads.add(threading.current_thread())
        return real_pwrite(fd, buffers, offset)

    def preadv(fd, buffers, offset):
        threads.add(threading.current_thread())
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwrite)
    monkeypatch.setattr(os, "preadv", preadv)
    data = torch.randn(100_003)
    store.write("k", data)
    out = torch.empty_like(data)
    store.read("k", out)
    assert torch.equal(out, data)
    assert threads == {threading.current_thread()}
    store.delete("k")
    assert "k" not in store and _files(store.directory) == []


def test_a_blocking_read_waits_for_the_asynchronous_write_in_flight(store, monkeypatch):
    store.write("k", torch.zeros(100_000))
    release, real_pwrite = threading.Event(), os.pwritev

    def slow(fd, buffers, offset):
        assert release.wait(10)
        return real_pwrite(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", slow)
    new, out = torch.randn(100_000), torch.empty(100_000)
    write = store.write_async("k", new)
    reader = threading.Thread(target=store.read, args=("k", out))
    reader.start()
    time.sleep(0.05)
    assert reader.is_alive() and not write.done()
    release.set()
    reader.join(10)
    assert write.done() and torch.equal(out, new)


def test_a_full_disk_in_a_blocking_write_is_the_same_clear_error_and_loses_nothing(store, monkeypatch):
    old = torch.arange(100_000, dtype=torch.float32)
    store.write("k", old)

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(HeteroError, match="no space left"):
        store.write("k", torch.ones(100_000))
    monkeypatch.undo()
    out = torch.empty_like(old)
    store.read("k", out)
    assert torch.equal(out, old) and len(_files(store.directory)) == 1
