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

# SGLang's frontend language, for tests/test_sglang_frontend.py only: the sglang package
# without its server's dependencies, plus the few that `import sglang` needs.
SGLANG_FRONTEND := sglang==0.5.23 pybase64==1.5.1 pillow==13.0.0 requests==2.34.2 \
	urllib3==2.8.0 charset-normalizer==3.5.3 ipython==9.18.1 traitlets==5.16.1 \
	aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0 yarl==1.25.1 propcache==0.5.4 \
	aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0

$(VENV)/.sglang-frontend: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps $(SGLANG_FRONTEND)
	touch $@

run: setup
	$(BIN)/radixlora serve

test: setup $(VENV)/.sglang-frontend
	$(BIN)/ruff check radixlora kernels frontend tests scripts
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV)
