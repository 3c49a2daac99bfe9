# One command to run, one to test; each sets up .venv on first use.
# TORCH pins the torch build: torch==2.13.0 is a CPU wheel on the dev/CI machines and the
# regular (CUDA) wheel on PyPI elsewhere; override with e.g. `make TORCH=torch==2.11.0 test`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: run test lint setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

run: setup
	$(BIN)/radixlora serve

test: setup
	$(BIN)/ruff check radixlora kernels frontend tests scripts
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV)
