"""FlashAttention-2 in Pallas: `common.py` (what every backend shares: the static config, block
sizes and padding, block ranges, masks, scores, the backward preamble), one module per backend:
`mosaic_tpu.py` (forward / dq / dk-dv kernels for TPUs, the other sequence streamed on the
innermost grid axis with VMEM scratch accumulators), `triton.py` (the same kernels for Triton,
each program looping over the other sequence), `mosaic_gpu.py` and `mosaic_gpu_backward.py` (for
Hopper GPUs in the Mosaic GPU style: TMA, barriers, wgmma; `mosaic_gpu_ws.py` the
warp-specialised forward), then `ops.py` (custom_vjp, backend
dispatch; imports a backend's module only when a call uses it) and `reference.py` (pure JAX
ground truth, on `jaxllm.kernels.reference`)."""

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
