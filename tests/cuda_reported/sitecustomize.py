"""Put this folder first on PYTHONPATH and every Python process that imports torch (subprocesses too: they inherit
PYTHONPATH) is told that one CUDA device exists, as on a GPU machine: `torch.cuda.is_available()` is True and
`torch.cuda.device_count()` is 1. Nothing else changes, so on a machine without CUDA anything that really starts
CUDA still raises: code that only asks whether CUDA exists must still choose the CPU where it was told to.

With HETERO_CUDA_LOG set to a file, a process that ends with CUDA initialized appends its command line to it (on a
real GPU machine nothing would raise: the log is what shows a CPU test started CUDA)."""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import os
import sys


def _report_cuda() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        with open(os.environ["HETERO_CUDA_LOG"], "a") as log:
            log.write(" ".join(sys.argv) + "\n")


def _patch(torch) -> None:
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    if os.environ.get("HETERO_CUDA_LOG"):
        atexit.register(_report_cuda)


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds `torch` as usual and patches it once its module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterTorch())
