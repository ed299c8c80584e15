"""FlashAttention-2 in Pallas: `kernel.py` (pallas_calls in the grid style, for Mosaic TPU and
Triton), `mosaic_gpu.py` (the same forward / dq / dk-dv kernels for Hopper GPUs in the Mosaic GPU
style: TMA, barriers, wgmma), `ops.py` (custom_vjp, backend dispatch), `reference.py` (pure JAX
ground truth)."""

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
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_reference",
    "flash_attention_reference_with_lse",
    "flash_attention_with_lse",
]
