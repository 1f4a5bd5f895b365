# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# pip (not uv/poetry) installs torch: it takes the CPU wheel on this machine's disk.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-nightly lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m plait.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# the larger matrix cases too (marked nightly; deselected from `make test`)
test-nightly: $(STAMP)
	PLAIT_NIGHTLY=1 $(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check plait tests bench examples
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info
