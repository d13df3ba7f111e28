"""The memory cgroup limit the process runs under, read as the kernel writes it (cgroup v1 and v2)."""

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
