# One command to run, one to test; each sets up .venv on first use.
# TORCH pins the torch build: torch==2.13.0 is a CPU wheel on the dev/CI machines and the
# regular (CUDA) wheel on PyPI elsewhere; override with e.g. `make TORCH=torch==2.11.0 test`.
# LOCK (constraints.txt) pins every other package the tests install, so that a release elsewhere
# cannot change what `make test` runs; `make test-latest` runs the suite against the newest
# releases instead and `make lock` rewrites the lock from them (commit it on its own).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
LOCK ?= constraints.txt
BIN := $(VENV)/bin
LATEST := .venv-latest

# A CUDA build of torch pins its own triton: the lock's triton only serves builds without one
# (the CPU wheel), so every other step reads the lock without it.
CONSTRAINTS := $(VENV)/constraints.txt
PIP_SHOWN := $(if $(LOCK),PIP_CONSTRAINT=$(CONSTRAINTS) )$(BIN)/pip install --progress-bar on
PIP_LOCKED := $(PIP_SHOWN) -q
TRITON_LOCKED := $(if $(LOCK),-c $(LOCK) )"triton; platform_system == 'Linux'"

.PHONY: run test test-latest lock setup clean

setup: $(VENV)/.installed

# What serving needs (make run): torch, Triton and the package's own dependencies, with pip's
# progress shown, since a first install downloads torch.
$(VENV)/.serving: pyproject.toml $(LOCK)
	@echo "setting up $(VENV): $(TORCH), then radixlora's dependencies"
	$(PYTHON) -m venv $(VENV)
	$(if $(LOCK),grep -v '^triton==' $(LOCK) > $(CONSTRAINTS),rm -f $(CONSTRAINTS))
	$(PIP_LOCKED) --upgrade pip setuptools
	$(PIP_SHOWN) "$(TORCH)"
	$(BIN)/python -c 'import triton' 2>/dev/null || $(BIN)/pip install $(TRITON_LOCKED)
	$(PIP_SHOWN) -e .
	touch $@

# The test extras on top (make test): transformers, PEFT, bitsandbytes, the clients...
$(VENV)/.installed: $(VENV)/.serving
	$(PIP_LOCKED) -e ".[test]"
	touch $@

# SGLang's frontend language, for tests/test_sglang_frontend.py only: the sglang package
# without its server's dependencies, plus the few that `import sglang` needs (versions: LOCK).
SGLANG_FRONTEND := sglang pybase64 pillow requests urllib3 charset-normalizer ipython \
	traitlets aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist

$(VENV)/.sglang-frontend: $(VENV)/.installed
	$(PIP_LOCKED) --no-deps $(SGLANG_FRONTEND)
	touch $@

run: $(VENV)/.serving
	$(BIN)/radixlora serve

# Prometheus' promtool, for tests/test_alert_rules.py: taken from Debian's prometheus package
# (pinned), where apt-get can download it; elsewhere the test says how to get it.
PROMETHEUS_DEB ?= prometheus=2.42.0+ds-5+deb12u1

$(BIN)/promtool: | $(VENV)/.installed
	@tmp=$$(mktemp -d) && ( cd $$tmp && apt-get download -q $(PROMETHEUS_DEB) >/dev/null 2>&1 \
	  && dpkg-deb -x prometheus_*.deb x && cp x/usr/bin/promtool $(abspath $(BIN))/promtool ) \
	  || echo "promtool not installed (Debian's apt-get download $(PROMETHEUS_DEB) failed)"; \
	  rm -rf $$tmp

test: setup $(VENV)/.sglang-frontend $(BIN)/promtool
	$(BIN)/ruff check radixlora kernels frontend tests scripts
	$(BIN)/pytest -q -n auto --maxprocesses=2

# The suite in a fresh environment of the newest releases (torch is still TORCH); `make lock`
# then pins what that environment holds.
test-latest:
	rm -rf $(LATEST)
	$(MAKE) VENV=$(LATEST) LOCK= test

lock:
	test -f $(LATEST)/.sglang-frontend || $(MAKE) VENV=$(LATEST) LOCK= $(LATEST)/.sglang-frontend
	{ echo "# make lock, $$(date -u +%F): the releases the suite passed with (torch: TORCH)"; \
	  $(LATEST)/bin/pip freeze --all --exclude-editable | grep -v '^torch=='; } > $(LOCK)

clean:
	rm -rf $(VENV) $(LATEST)
