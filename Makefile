# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# pip (not uv/poetry) installs torch: it takes the CPU wheel on this machine's disk.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# transformers: the newest pyproject.toml's range allows (pip would keep an older one that
# satisfies it); `make test-transformers4` builds .venv-tf4 with the 4.x line
TRANSFORMERS ?= transformers>=4.57,<6
HF_TESTS := tests/sim/test_hf_capture.py tests/sim/test_plan_matrix.py tests/sim/test_pretrained.py \
	tests/sim/test_auto_parallelize.py tests/unit/test_checkpoint_offline.py tests/sim/test_predict.py

.PHONY: demo test test-nightly nightly test-hf test-transformers4 lint typecheck install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet --upgrade "$(TRANSFORMERS)"
	$(BIN)/pip install --quiet -e ".[dev,plot,metrics]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m plait.demo

# Unit and simulated-rank tests run in-process and use one core each (torch's intra-op threads
# gain nothing on their small tensors), so they run JOBS at a time (pytest-xdist), one torch
# thread a worker. The multi-process tests (tests/dist) each fill the cores with their own
# processes and wait on timeouts, so they run one at a time after.
JOBS ?= 2
PYTEST := $(BIN)/python -m pytest -q
IN_PROCESS := OMP_NUM_THREADS=1 $(PYTEST) -n $(JOBS) tests/unit tests/sim

test: $(STAMP)
	$(IN_PROCESS)
	$(PYTEST) tests/dist

# the larger matrix cases too (marked nightly; deselected from `make test`)
test-nightly: $(STAMP)
	PLAIT_NIGHTLY=1 $(IN_PROCESS)
	PLAIT_NIGHTLY=1 $(PYTEST) tests/dist

# the nightly cases alone (what .ci/run adds after `make test`)
nightly: $(STAMP)
	PLAIT_NIGHTLY=1 $(IN_PROCESS) -m nightly
	PLAIT_NIGHTLY=1 $(PYTEST) -m nightly tests/dist

# the tests that build Hugging Face models (nightly cases too), on this venv's transformers
test-hf: $(STAMP)
	PLAIT_NIGHTLY=1 $(BIN)/python -m pytest -q -k "hf or hugging" $(HF_TESTS)

# the same on the transformers 4.x line, in its own venv
test-transformers4:
	$(MAKE) VENV=.venv-tf4 TRANSFORMERS="transformers==4.57.6" test-hf

lint: $(STAMP)
	$(BIN)/ruff check plait tests bench examples
	$(BIN)/lint-imports
	$(MAKE) typecheck

# mypy on the package, the settings in pyproject.toml's [tool.mypy]
typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .venv-tf4 build *.egg-info
