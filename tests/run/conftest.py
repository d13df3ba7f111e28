import pytest
import torch

from hetero.kernels import dha
from tests.standin import StandInDevice, StandInDevices, strict_parameters


@pytest.fixture
def stand_ins(monkeypatch) -> StandInDevices:
    """The stand-in `cuda:0` and `cuda:1` in place of the GPUs, for every GPU code path; parameters may not change
    device while they are in use."""
    devices = StandInDevices()
    monkeypatch.setattr(dha, "devices", devices)
    with strict_parameters(devices):
        yield devices


@pytest.fixture
def stand_in(stand_ins) -> StandInDevice:
    """cuda:0, where a model that was not moved anywhere is."""
    return stand_ins.all[0]


@pytest.fixture
def one_thread():
    """Tiny matrices: a second OpenMP thread only adds spinning (and the suite may share the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
