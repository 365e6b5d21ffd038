# Set-up and entry points. `make test` and `make demo` are all a fresh machine needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megarl-installed
PYTEST_ARGS ?=

.PHONY: install test demo clean

# Installs once; reinstalls only when setup.py changes. torch==2.13.0 is the CPU build on
# these machines; asking for it first keeps pip from pulling a multi-GB CUDA build.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

demo: install
	$(PY) -m megarl.demo

clean:
	rm -rf $(VENV) build src/*.egg-info outputs
