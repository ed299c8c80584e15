"""Pallas kernels, importable as `jaxllm.kernels`.

Each kernel lives in its own folder: `common.py` (what its backends share), one module per
backend (the pallas_calls), `ops.py` (custom_vjp and dispatch; a backend's module, with its
Pallas lowering, is imported only when a call uses it) and `reference.py` (pure JAX, the ground
truth of its tests). `reference.py` here holds the masks and masked scores that every jnp
attention of the project is built on. The model reaches attention only through
`jaxllm.model.attention.dot_product_attention`, whose `impl` argument
(`ModelConfig.attention_impl`) is where a kernel plugs in; generation reads its KV cache through
`decode_attention`. Of jaxllm itself, kernels import only `jaxllm.config`.
"""

from jaxllm.kernels.decode_attention import (
    KVCache,
    cache_bytes_per_token,
    decode_attention,
    decode_attention_reference,
    quantize_cache,
)
from jaxllm.kernels.flash_attention.ops import (
    BlockSizes,
    flash_attention,
    flash_attention_backward,
    flash_attention_with_lse,
)
from jaxllm.kernels.flash_attention.reference import (
    MASK_VALUE,
    flash_attention_reference,
    flash_attention_reference_with_lse,
)

__all__ = [
    "MASK_VALUE",
    "BlockSizes",
    "KVCache",
    "cache_bytes_per_token",
    "decode_attention",
    "decode_attention_reference",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_reference",
    "flash_attention_reference_with_lse",
    "flash_attention_with_lse",
    "quantize_cache",
]
