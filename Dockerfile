# NVIDIA GPU image: `jaxllm train` and the test suite, installed as `make train` / `make test`
# install them plus the jax CUDA extra (tests/test_containers.py checks that the lines match).
# The jax[cuda13] wheels bring CUDA 13 and cuDNN themselves; the host needs an NVIDIA driver that
# supports CUDA 13 (580 or newer) and the NVIDIA container toolkit.
#
#   docker build -t jaxllm:cuda .
#   docker run --rm --gpus all -v "$PWD/runs:/app/runs" jaxllm:cuda          # the default run
#   docker run --rm --gpus all jaxllm:cuda jaxllm train CONFIG.yaml mesh=fsdp ...
#   docker run --rm --gpus all jaxllm:cuda python -m pytest -n 2             # the test suite
FROM nvidia/cuda:13.0.1-base-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH

# Ubuntu 24.04's Python is 3.12 (the line `make test-newest` checks); pip installs into a venv.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /app
# What `pip install -e .` reads: the metadata (pyproject names README.md as the readme), the
# package and the kernels (installed as jaxllm.kernels); configs and tests for runs and the suite.
COPY pyproject.toml README.md ./
COPY jaxllm ./jaxllm
COPY kernels ./kernels
COPY configs ./configs
COPY tests ./tests

# The Makefile's install lines (`make train`, then `make test`), the second with jax's CUDA
# extra resolved together with jaxllm's own pins.
RUN python -m pip install --quiet --upgrade pip \
 && python -m pip install --quiet -e . \
 && python -m pip install --quiet -e '.[test]' 'jax[cuda13]'

CMD ["jaxllm", "train"]
