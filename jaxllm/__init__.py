"""jaxllm: train LLMs in JAX, from a laptop CPU to a sharded pod, with one codebase.

The pieces research code imports, all from here:

    jaxllm.load_model(path)                     a trained run or a Hugging Face directory
    jaxllm.config                               Config, ModelConfig, load, from_dict, ...
    jaxllm.Transformer, Attention, MLP, MoE     the model and its layers (Flax NNX)
    jaxllm.ModelOutput, AttentionOutput         what the model and attention layers return
    jaxllm.train_step, eval_step, TrainState    the pure steps
    jaxllm.Objective, ObjectiveOutput,          what a step minimises
    jaxllm.next_token
    jaxllm.make_mesh, Parallel                  the device mesh and the parallel settings
    jaxllm.flash_attention, decode_attention    the Pallas kernels
    jaxllm.infer, jaxllm.optim, ...             every subpackage, as an attribute too

`import jaxllm` itself stays light (no jax until a piece is used), so the command line can
install its signal handlers before anything heavy loads.
"""

from __future__ import annotations

import importlib
import importlib.util

from jaxllm.config.errors import JaxllmWarning  # defined at the bottom floor, named here

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first use)
_PIECES = {
    "load_model": "jaxllm.load",
    "Transformer": "jaxllm.model",
    "Attention": "jaxllm.model",
    "MLP": "jaxllm.model",
    "MoE": "jaxllm.model",
    "abstract_model": "jaxllm.model",
    "ModelOutput": "jaxllm.model",
    "AttentionOutput": "jaxllm.model",
    "TrainState": "jaxllm.train",
    "train_step": "jaxllm.train",
    "eval_step": "jaxllm.train",
    "init_state": "jaxllm.train",
    "Objective": "jaxllm.objectives",
    "ObjectiveOutput": "jaxllm.objectives",
    "next_token": "jaxllm.objectives",
    "make_mesh": "jaxllm.sharding",
    "Parallel": "jaxllm.sharding",
    "flash_attention": "jaxllm.kernels",
    "decode_attention": "jaxllm.kernels",
}
_MODULES = (
    "config",
    "model",
    "objectives",
    "train",
    "sharding",
    "kernels",
    "load",
    "checkpoint",
    "data",
)


def __getattr__(name: str):
    if name in _PIECES:
        value = getattr(importlib.import_module(_PIECES[name]), name)
    elif name in _MODULES or (
        not name.startswith("_") and importlib.util.find_spec(f"jaxllm.{name}") is not None
    ):  # `jaxllm.infer.generate` after a bare `import jaxllm`, as for any package's attribute
        value = importlib.import_module(f"jaxllm.{name}")
    else:
        raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PIECES, *_MODULES})


__all__ = ["JaxllmWarning", "__version__", *_PIECES]
