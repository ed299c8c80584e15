"""FlashAttention-2 in Pallas: `mosaic_tpu.py` (forward / dq / dk-dv kernels for TPUs, the other
sequence streamed on the innermost grid axis with VMEM scratch accumulators), `kernel.py` (the
same kernels for Triton, each program looping over the other sequence), `mosaic_gpu.py` (for
Hopper GPUs in the Mosaic GPU style: TMA, barriers, wgmma), `ops.py` (custom_vjp, backend
dispatch), `reference.py` (pure JAX ground truth)."""

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
