"""jaxllm: train LLMs in JAX, from a laptop CPU to a sharded pod, with one codebase."""

from __future__ import annotations

from jaxllm.config.errors import JaxllmWarning  # defined at the bottom floor, named here
from jaxllm.load import load_model

__version__ = "0.1.0"


__all__ = ["JaxllmWarning", "__version__", "load_model"]
