# `make test` and `make demo` work on a fresh machine with only Python >= 3.10 installed.
PYTHON ?= python3
VENV ?= .venv
# Installed into the venv only when no torch is importable, so pip never resolves an unpinned torch
# (a multi-GB CUDA download). Override for another build, e.g. TORCH_SPEC='torch==2.13.0+cu128'.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: test demo docs clean gpu-check

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

# Two workers, a test file each (module fixtures stay with their tests): 558 s of tests and 619 s with the venv
# from a fresh clone on the 2-core VM at 4e32306 (at 268a845, pip compiling: 591 s and 674 s); CI allows 10 minutes.
# The same suite at 4ff916c on a slower day (`import torch` 3.5 s): 680 s and 751 s; at 31f1af1 (1102 tests) 709 s
# and 790 s; at b761f3f (1104 tests) 670 s and 747 s, at e9403fb 695 s and 763 s, at c24d7f0 588 s and 649 s (quiet),
# at 5fdb81e (1105 tests) 532 s and 595 s.
# The suite is CPU-bound (1144 CPU-seconds at 4e32306; three workers took 726 s against two's 620 at 7ee1e2d): most
# of it is process starts, `import torch` in each and 2.2 s more where one builds a torch optimizer, which imports
# torch._dynamo.
# The 15 slowest tests are listed at the end, so that CI's log shows where the time goes.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15

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
