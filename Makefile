# Two entry points do all set-up on a fresh machine with Python 3.11+:
#   make train   trains the default model on the built-in corpus (the main job)
#   make test    runs the test suite
# Both create .venv and install jaxllm into it (once; again when pyproject.toml changes).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: train test test-all bench lint clean

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

lint: $(STAMP)
	$(BIN)/ruff format --check jaxllm kernels tests scripts
	$(BIN)/ruff check jaxllm kernels tests scripts

bench: $(STAMP)
	$(BIN)/jaxllm bench train $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
