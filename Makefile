# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv (Python 3.12) on first use.
# The first candidate that really runs Python 3.12 (a pyenv shim can exist and still refuse to run).
PYTHON312 ?= $(shell for c in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python /usr/bin/python3.12 \
	/usr/local/bin/python3.12; do $$c -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
	&& { echo $$c; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Test files spread over this many processes, a file's tests together (its module fixtures are built once).
TEST_WORKERS ?= 2

.PHONY: demo test mutate install install-test clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it or pass PYTHON312=/path/to/python3.12"; exit 1; }
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
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Single-line bugs applied one at a time in a scratch copy; each must make its tests fail (tests/mutations.py).
mutate: $(VENV)/.installed-test
	JAX_PLATFORMS=cpu $(PY) tests/mutations.py $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
