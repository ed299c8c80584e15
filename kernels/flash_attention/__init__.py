"""FlashAttention-2 in Pallas: `kernel.py` (pallas_calls), `ops.py` (custom_vjp, dispatch),
`reference.py` (pure JAX ground truth)."""

from jaxllm.kernels.flash_attention.ops import BlockSizes, flash_attention
from jaxllm.kernels.flash_attention.reference import flash_attention_reference

__all__ = ["BlockSizes", "flash_attention", "flash_attention_reference"]
