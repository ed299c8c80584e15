# Two entry points do all set-up on a fresh machine with Python 3.11+:
#   make train   trains the default model on the built-in corpus (the main job)
#   make test    runs the test suite
# Both create .venv and install jaxllm into it (once; again when pyproject.toml changes).
#   make test-newest   the suite again on Python 3.12 with the newest jax, flax, optax, orbax and
#                      grain (in .venv-newest; the tests that need torch run on the main line only)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# The newest line's interpreter: python3.12 on PATH, or one that pyenv holds without selecting it.
NEWEST_PYTHON ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),$(if $(shell $(p) -c 'import sys; print(sys.version_info[:2] == (3, 12))' 2>/dev/null | grep True),$(p))))
NEWEST_VENV   ?= .venv-newest

.PHONY: train test test-all test-newest bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/jaxllm train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -m 'not gpu' $(PYTEST_ARGS)

test-newest:
ifeq ($(NEWEST_PYTHON),)
	@echo "test-newest: skipped, no python3.12 on this machine (on PATH or under ~/.pyenv/versions)"
else
	$(NEWEST_PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[test-core]'
	$(NEWEST_VENV)/bin/python -c 'import jax, flax, optax, orbax.checkpoint, grain; print("newest line:", "jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__)'
	$(NEWEST_VENV)/bin/python -m pytest --without-torch $(PYTEST_ARGS)
endif

lint: $(STAMP)
	$(BIN)/ruff format --check jaxllm kernels tests scripts
	$(BIN)/ruff check jaxllm kernels tests scripts

bench: $(STAMP)
	$(BIN)/jaxllm bench train $(ARGS)

clean:
	rm -rf $(VENV) $(NEWEST_VENV) runs .pytest_cache
