from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; skip them, with the reason, where there is none."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def cpu_tests_leave_cuda_alone(request):
    """A test not marked `gpu` runs on the CPU wherever CUDA exists, and never starts CUDA: a context per pytest
    process costs GPU memory and seconds, and a CPU test that reaches the GPU checks what it does not name."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    import torch

    before = torch.cuda.is_initialized()
    yield
    if not before and torch.cuda.is_initialized():
        pytest.fail("this CPU test started CUDA: keep it on the CPU (--device cpu, cuda_hidden) or mark it `gpu`")


@pytest.fixture
def cuda_hidden(monkeypatch):
    """torch.cuda.is_available() is False for this test, for what torch itself would start CUDA for where it exists
    (torch.compile saves the CUDA RNG state; a GPU's name is asked of the GPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def without_malloc_runs():
    """`hetero profile` on a CPU runs the script twice more, each time in a fresh process (seconds each), for its peak
    and step with freed memory returned (hetero.profile.returned). Tests of something else leave those runs out;
    tests/profile/test_returned.py and tests/cli/test_profile.py check them."""
    from hetero.profile import returned

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(returned, "measure", lambda script, args, warmup: None)
        yield


@pytest.fixture
def repo() -> Path:
    return REPO
