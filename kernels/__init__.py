"""Pallas kernels, importable as `jaxllm.kernels`.

Each kernel lives in its own folder with `kernel.py` (the pallas_call), `ops.py` (custom_vjp and
dispatch) and `reference.py` (pure JAX, the ground truth of its tests). The model reaches
attention only through `jaxllm.model.attention.dot_product_attention`, whose `impl` argument
(`ModelConfig.attention_impl`) is where a kernel plugs in.
"""

from jaxllm.kernels.flash_attention.ops import BlockSizes, flash_attention
from jaxllm.kernels.flash_attention.reference import flash_attention_reference

__all__ = ["BlockSizes", "flash_attention", "flash_attention_reference"]
