# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv (Python 3.12) on first use.
PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || echo $(HOME)/.pyenv/versions/3.12.1/bin/python)
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test install install-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(VENV)/bin/ling-jax generate --preset toy --max-new-tokens 64

test: $(VENV)/.installed-test
	JAX_PLATFORMS=cpu $(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
