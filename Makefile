# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv (Python 3.12) on first use, with the
# tested set of packages.
# The first candidate that really runs Python 3.12 (a pyenv shim can exist and still refuse to run).
PYTHON312 ?= $(shell for c in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python /usr/bin/python3.12 \
	/usr/local/bin/python3.12; do $$c -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
	&& { echo $$c; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
# The tested set (constraints/tested.txt) pins every package `make demo` and `make test` install; `make test-latest`
# builds $(VENV_LATEST) anew each run with the newest versions pyproject.toml allows, so drift shows before users meet it.
CONSTRAINTS := constraints/tested.txt
VENV_LATEST := .venv-latest
PYTEST_ARGS ?=
# Test files spread over this many processes, a file's tests together (its module fixtures are built once).
TEST_WORKERS ?= 2

.PHONY: demo test test-latest mutate install install-test clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it or pass PYTHON312=/path/to/python3.12"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml $(CONSTRAINTS)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(VENV)/bin/ling-jax generate --preset toy --max-new-tokens 64

test: $(VENV)/.installed-test
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-latest:
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it or pass PYTHON312=/path/to/python3.12"; exit 1; }
	rm -rf $(VENV_LATEST)
	$(PYTHON312) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_LATEST)/bin/python -m pip install -q --upgrade -e ".[test]"
	$(VENV_LATEST)/bin/python -m pip freeze --exclude-editable | grep -iE '^(jax|flax|orbax-checkpoint|torch|transformers|fla-core|numpy|safetensors|tokenizers)=='
	JAX_PLATFORMS=cpu $(VENV_LATEST)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Single-line bugs applied one at a time in a scratch copy; each must make its tests fail (tests/mutations.py).
mutate: $(VENV)/.installed-test
	JAX_PLATFORMS=cpu $(PY) tests/mutations.py $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) $(VENV_LATEST) .pytest_cache
