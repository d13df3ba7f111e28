import pytest

from hetero.kernels import dha
from hetero.kernels.standin import StandInDevice, StandInDevices


@pytest.fixture
def stand_ins(monkeypatch) -> StandInDevices:
    """The stand-in `cuda:0` and `cuda:1` in place of the GPUs, for every GPU code path."""
    devices = StandInDevices()
    monkeypatch.setattr(dha, "devices", devices)
    return devices


@pytest.fixture
def stand_in(stand_ins) -> StandInDevice:
    """cuda:0, where a model that was not moved anywhere is."""
    return stand_ins.all[0]
