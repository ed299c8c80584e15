# Two entry points do all set-up on a fresh machine with Python 3.11+:
#   make train   trains the default model on the built-in corpus (the main job); installs only
#                jaxllm and what training needs
#   make test    runs the test suite; installs the test extra too (pytest, ruff, and the
#                reference libraries of the parity tests: torch, transformers, peft, trl)
# Both create .venv and install into it (once; again when pyproject.toml changes).
#   make test-newest   the suite again on Python 3.12 with the newest jax, flax, optax, orbax and
#                      grain (in .venv-newest; the tests that need torch run on the main line only)
#   make test-reference   the tests marked `reference` (GPTQ, AWQ and SmoothQuant against
#                         llm-compressor) on Python 3.11 in .venv-reference: llm-compressor pins
#                         transformers and compressed-tensors below the `test` extra's, so it
#                         has its own venv

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CORE   := $(VENV)/.installed-core
TESTS  := $(VENV)/.installed-test

# The newest line's interpreter: python3.12 on PATH, or one that pyenv holds without selecting it.
NEWEST_PYTHON ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),$(if $(shell $(p) -c 'import sys; print(sys.version_info[:2] == (3, 12))' 2>/dev/null | grep True),$(p))))
NEWEST_VENV   ?= .venv-newest

REFERENCE_PYTHON ?= python3.11
REFERENCE_VENV   ?= .venv-reference

.PHONY: train test test-all test-newest test-reference bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(CORE): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $(CORE)

$(TESTS): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(TESTS) $(CORE)

train: $(CORE)
	$(BIN)/jaxllm train $(ARGS)

test: $(TESTS)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: $(TESTS)
	$(BIN)/python -m pytest -m 'not gpu and not reference' $(PYTEST_ARGS)

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

test-reference:
	$(REFERENCE_PYTHON) -m venv $(REFERENCE_VENV)
	$(REFERENCE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(REFERENCE_VENV)/bin/python -m pip install --quiet -e '.[test-core,reference]'
	$(REFERENCE_VENV)/bin/python -m pytest -m reference tests/test_gptq_reference.py \
		tests/test_awq_smoothquant_reference.py -n 0 $(PYTEST_ARGS)

lint: $(TESTS)
	$(BIN)/ruff format --check jaxllm kernels tests scripts
	$(BIN)/ruff check jaxllm kernels tests scripts

bench: $(CORE)
	$(BIN)/jaxllm bench train $(ARGS)

clean:
	rm -rf $(VENV) $(NEWEST_VENV) $(REFERENCE_VENV) runs .pytest_cache
