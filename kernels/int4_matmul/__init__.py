"""Weight-only int4 matmul: y = x @ dequantize(W), the weight read as packed 4-bit codes with
per-group scales (and zero points), the layout `jaxllm quantize` stores (docs/compression.md).
`reference.py` (pure JAX, the ground truth), `triton.py` (the Pallas Triton kernel for CUDA
GPUs), `ops.py` (dispatch)."""

from jaxllm.kernels.int4_matmul.ops import BACKENDS, int4_matmul, triton_supported
from jaxllm.kernels.int4_matmul.reference import dequantize_int4, int4_matmul_reference

__all__ = [
    "BACKENDS",
    "dequantize_int4",
    "int4_matmul",
    "int4_matmul_reference",
    "triton_supported",
]
