"""Pallas kernels, importable as `jaxllm.kernels`.

Each kernel lives in its own folder with `kernel.py` (the pallas_call), `ops.py` (custom_vjp and
dispatch) and `reference.py` (pure JAX, the ground truth of its tests). The model reaches
attention only through `jaxllm.model.attention.dot_product_attention`, whose `impl` argument
(`ModelConfig.attention_impl`) is where a kernel plugs in; generation reads its KV cache through
`decode_attention`.
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
