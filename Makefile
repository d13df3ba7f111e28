# `make test` and `make demo` work on a fresh machine with only Python >= 3.10 installed.
PYTHON ?= python3
VENV ?= .venv
# Installed into the venv only when no torch is importable, so pip never resolves an unpinned torch
# (a multi-GB CUDA download). Override for another build, e.g. TORCH_SPEC='torch==2.13.0+cu128'.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: test test-fast demo docs clean gpu-check

# Where the system Python already imports torch (GPU machines), the venv sees it and keeps it. pip compiles what it
# installs on one core; compileall on every core makes the same 7600 .pyc files, the venv in 64 s instead of 91 on
# the 2-core VM. It fails only on files written for a later Python (torch's py312_intrinsics.py), as pip skips them.
$(VENV)/.installed: pyproject.toml
	if $(PYTHON) -c 'import torch' 2>/dev/null; then $(PYTHON) -m venv --system-site-packages $(VENV); \
	else $(PYTHON) -m venv $(VENV); fi
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/python -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --no-compile -e '.[test]'
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $@

# Two workers (the suite is CPU-bound), a whole file each (`--dist loadfile`): module fixtures stay with their tests.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15

# The development loop: the suite less the tests marked `slow` (pyproject.toml), those over ~5 s each: memory
# cgroups, torchrun jobs, bench and trainer runs, trial processes. `make test` (and CI) runs them all.
test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not slow"

demo: $(VENV)/.installed
	$(BIN)/python examples/demo.py

# Every GPU test and benchmark within 8 minutes on one H100, results into docs/gpu-results.md and $$OUT (or a temp
# folder); refuses (exit 2) without CUDA or, with a hint, where $(PYTHON) has no torch. No install: the GPU machine's
# own python3 and torch, offline.
gpu-check:
	PYTHONPATH=. $(PYTHON) bench/gpu_all.py

docs: $(VENV)/.installed
	$(BIN)/python -m hetero.docs docs/plan-format.md

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
