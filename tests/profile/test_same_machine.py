"""`hetero profile --machine FILE`: an earlier profile's machine section, taken only where it was measured, with what
describes the present read again."""

import dataclasses
import tempfile

import pytest
import torch

from hetero.errors import USAGE, HeteroError
from hetero.profile import machine, same_machine
from hetero.profile.tier_steps import DiskBeside
from hetero.run import process_memory
from hetero.run.devices import workdir
from hetero.schema import files
from hetero.schema.profile import CurvePoint, Gpu, NumaNode, Peer
from tests.conftest import REPO


@pytest.fixture
def here():
    """The bundled CPU profile's machine, as if measured on this one (its host, processor, cores, NUMA nodes) with
    its disk tier in the temp directory."""
    known = files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml").machine
    disk = next(t for t in known.tiers if t.kind == "nvme")
    tiers = [dataclasses.replace(t, path=tempfile.gettempdir()) if t is disk else t for t in known.tiers]
    return dataclasses.replace(known, host=workdir.host(), cpu=dataclasses.replace(
        known.cpu, model=machine.cpu_model(), cores=machine.cores()), numa=machine.numa_nodes(), tiers=tiers)


def test_a_machine_measured_here_is_taken(here, tmp_path):
    assert same_machine.differences(here, str(tmp_path / "disk")) == []


@pytest.mark.parametrize("field, value, named", [
    ("host", "0badcafe", "host 0badcafe, here "),
    ("cores", 4096, "cores 4096, here "),
    ("model", "Zilog Z80", "processor Zilog Z80, here "),
    ("numa", [NumaNode(node=0, memory_bytes=2**30), NumaNode(node=1, memory_bytes=2**30)], "NUMA nodes [0, 1], "),
])
def test_another_machine_is_refused_naming_what_differs(here, tmp_path, field, value, named):
    other = dataclasses.replace(here, cpu=dataclasses.replace(here.cpu, **{field: value})) \
        if field in ("cores", "model") else dataclasses.replace(here, **{field: value})
    differ = same_machine.differences(other, None)
    assert len(differ) == 1 and differ[0].startswith(named), differ
    path = tmp_path / "other.profile.yaml"
    files.save(dataclasses.replace(files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml"), machine=other), path)
    with pytest.raises(HeteroError) as e:
        same_machine.load(str(path), None)
    assert e.value.exit_code == USAGE and "measured on another machine: " + named in e.value.message


def test_a_profile_that_records_no_host_cannot_be_checked_and_is_refused(here):
    assert same_machine.differences(dataclasses.replace(here, host=None), None) == [
        "it records no host (written before profiles recorded one)"]


def test_a_disk_tier_on_another_filesystem_is_refused(here):
    elsewhere = [dataclasses.replace(t, path="/proc/gone") if t.kind == "nvme" else t for t in here.tiers]
    differ = same_machine.differences(dataclasses.replace(here, tiers=elsewhere), None)
    assert differ == [f"its disk tier was measured in /proc/gone, on another filesystem than {tempfile.gettempdir()}"]


def test_what_was_measured_is_kept_and_the_present_read_again(here, tmp_path):
    stale = dataclasses.replace(here, memory_limit_bytes=123, peers=[], tiers=[
        dataclasses.replace(t, capacity_bytes=1) for t in here.tiers])
    peers = [Peer(src=0, dst=1, backend="gloo", transfer=[CurvePoint(size_bytes=2**20, time_s=1e-3)])]
    now = same_machine.reuse(stale, torch.device("cpu"), str(tmp_path / "disk"), peers, None)
    assert now.cpu == here.cpu and now.axdimm.adam_params_per_s == here.axdimm.adam_params_per_s
    assert now.peers == peers and now.memory_limit_bytes == process_memory.memory_limit_bytes()
    dram, disk = now.tiers
    assert dram.read == here.tiers[0].read and dram.capacity_bytes > 2**20
    assert disk.path == str(tmp_path / "disk") and disk.capacity_bytes > 2**20
    assert disk.read == here.tiers[1].read and disk.read_beside_compute == here.tiers[1].read_beside_compute
    assert now.axdimm.channel_capacity_bytes == machine.emulated_channel_capacity(here.axdimm.channels)


def test_the_disk_timed_beside_this_scripts_training_replaces_the_earlier_figures(here, tmp_path):
    timed = DiskBeside(read=[CurvePoint(size_bytes=2**20, time_s=0.5)], write=[CurvePoint(size_bytes=2**20,
                                                                                         time_s=0.25)], stretch=0.5)
    disk = same_machine.reuse(here, torch.device("cpu"), None, [], timed).tiers[1]
    cpu = machine.beside_training(here.cpu.background_slowdown, timed)
    assert (disk.read_cpu, disk.write_cpu, disk.read_beside_compute, disk.write_beside_compute) == cpu
    assert disk.path == tempfile.gettempdir()


def test_a_machine_measured_beside_a_gpu_is_refused_for_a_model_on_the_cpu(here):
    gpu = Gpu(name="H100", uuid="GPU-1", memory_bytes=80 * 2**30, pcie=None, h2d=[], d2h=[],
              dha_read_bytes_per_s=None, dha_write_bytes_per_s=None)
    with pytest.raises(HeteroError) as e:
        same_machine.reuse(dataclasses.replace(here, gpu=gpu), torch.device("cpu"), None, [], None)
    assert e.value.exit_code == USAGE and "measured beside GPU H100" in e.value.message


def test_the_last_machine_measured_on_this_host_is_remembered_for_the_next_profile(here, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu = torch.device("cpu")
    assert same_machine.remembered(None, cpu) is None  # nothing kept yet
    profile = files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml")
    same_machine.remember(dataclasses.replace(profile, machine=here))
    assert same_machine.cache_path().parent == tmp_path / "cache" / "hetero"
    assert same_machine.remembered(None, cpu) == here
    same_machine.remember(dataclasses.replace(profile, machine=dataclasses.replace(here, host="0badcafe")))
    assert same_machine.remembered(None, cpu) is None  # another host's: measured again
    same_machine.cache_path().write_text("not: a profile\n")
    assert same_machine.remembered(None, cpu) is None  # damaged: measured again


def test_a_machine_remembered_before_the_measurement_recorded_more_is_measured_again(here, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu = torch.device("cpu")
    same_machine.remember(dataclasses.replace(files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml"), machine=here))
    assert same_machine.remembered(None, cpu) == here
    monkeypatch.setattr(machine, "RECORD", machine.RECORD + 1)  # a hetero whose machine record holds more
    assert same_machine.remembered(None, cpu) is None
    older = list(same_machine.cache_path().parent.iterdir())
    same_machine.remember(dataclasses.replace(files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml"), machine=here))
    assert list(same_machine.cache_path().parent.iterdir()) == [same_machine.cache_path()]  # the older one removed
    assert older and same_machine.cache_path() not in older
