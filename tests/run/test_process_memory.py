"""The memory cgroup limit the process runs under, read as the kernel writes it (cgroup v1 and v2)."""

import os
import tracemalloc

from hetero.run import process_memory


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    write(tmp_path / "cgroup", "9:name=systemd:/\n4:memory:/box/job\n0::/\n")
    folder = tmp_path / "fs/memory/box/job"
    write(folder / "memory.limit_in_bytes", "2147483648\n")
    write(folder / "memory.stat", "cache 0\nhierarchical_memory_limit 1073741824\n")  # the parent's is tighter
    read = lambda: process_memory.memory_limit_bytes(str(tmp_path / "cgroup"), str(tmp_path / "fs"))
    assert read() == 1 << 30
    write(folder / "memory.stat", "hierarchical_memory_limit 9223372036854771712\n")
    write(folder / "memory.limit_in_bytes", "9223372036854771712\n")
    assert read() is None


def test_cgroup_v2_takes_the_tightest_of_the_folder_and_its_parents(tmp_path):
    write(tmp_path / "cgroup", "0::/a/b\n")
    write(tmp_path / "fs/a/b/memory.max", "max\n")
    write(tmp_path / "fs/a/memory.max", "536870912\n")
    assert process_memory.memory_limit_bytes(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == 512 << 20
    write(tmp_path / "fs/a/memory.max", "max\n")
    assert process_memory.memory_limit_bytes(str(tmp_path / "cgroup"), str(tmp_path / "fs")) is None


def test_no_cgroup_file_means_no_limit(tmp_path):
    assert process_memory.memory_limit_bytes(str(tmp_path / "missing")) is None


def test_the_peak_is_what_a_limit_charges_the_high_water_mark_less_the_file_pages_mapped_when_it_rose(tmp_path):
    status = tmp_path / "status"
    peak = process_memory.Peak(str(status))
    write(status, "VmHWM:\t  300000 kB\nVmRSS:\t  300000 kB\nRssFile:\t   90000 kB\n")
    assert peak.read() == 210000 * 1024
    write(status, "VmHWM:\t  300000 kB\nVmRSS:\t  250000 kB\nRssFile:\t   30000 kB\n")  # file pages reclaimed since
    assert peak.read() == 210000 * 1024
    write(status, "VmHWM:\t  400000 kB\nVmRSS:\t  400000 kB\nRssFile:\t   30000 kB\n")
    assert peak.read() == 370000 * 1024


def test_resident_bytes_leave_out_file_pages():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    rss, file = (int(status[k].split()[0]) * 1024 for k in ("VmRSS", "RssFile"))
    assert file > 0 and 0 < process_memory.resident_bytes() <= rss - file + (64 << 20)


def test_oom_kills_sum_the_cgroup_and_every_cgroup_above_it(tmp_path):
    write(tmp_path / "cgroup", "4:memory:/box/job\n0::/\n")
    write(tmp_path / "fs/memory/box/job/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    write(tmp_path / "fs/memory/box/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert process_memory.oom_kills(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == 3
    write(tmp_path / "cgroup2", "0::/job\n")
    write(tmp_path / "fs2/job/memory.events", "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    assert process_memory.oom_kills(str(tmp_path / "cgroup2"), str(tmp_path / "fs2")) == 1


def test_no_oom_count_where_the_kernel_keeps_none(tmp_path):
    write(tmp_path / "cgroup", "4:memory:/job\n")
    write(tmp_path / "fs/memory/job/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\n")  # before 4.13
    assert process_memory.oom_kills(str(tmp_path / "cgroup"), str(tmp_path / "fs")) is None
    assert process_memory.oom_kills(str(tmp_path / "missing")) is None


def test_reading_the_status_allocates_nothing_per_read_and_a_forked_child_reads_its_own():
    process_memory.resident_bytes()  # the parent's reader is made at its first read
    tracemalloc.start()
    try:
        for _ in range(100):
            process_memory.resident_bytes()
            process_memory.dram_peak_bytes()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2048  # open() and a text buffer would take 8 KiB and more per read
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child's own status, not the parent's, though the parent read it first
        tracemalloc.start()
        process_memory.resident_bytes()  # the child makes its reader anew: its buffer maps memory of its own
        made = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        held = bytearray(64 << 20)
        held[::4096] = b"x" * len(held[::4096])
        os.write(write, f"{made} {process_memory.resident_bytes()}".encode())
        os._exit(0)
    os.waitpid(child, 0)
    made, resident = (int(v) for v in os.read(read, 100).split())
    assert made < 4096  # a 16 KiB buffer from malloc's heap would show here
    assert resident > process_memory.resident_bytes() + (48 << 20)
