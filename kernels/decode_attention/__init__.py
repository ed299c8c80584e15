"""Decode attention over a (quantized, paged) KV cache: `quant.py` (int8 / KIVI int4 and int2
math and the `KVCache` pytree), `common.py` (the split-K block math the kernels share),
`mosaic_tpu.py`, `mosaic_gpu.py` and `triton.py` (the Pallas kernels of each backend), `ops.py`
(dispatch, residual and split merge; imports a backend's module only when a call uses it), `reference.py`
(pure JAX ground truth, on `jaxllm.kernels.reference`)."""

from jaxllm.kernels.decode_attention.ops import decode_attention
from jaxllm.kernels.decode_attention.quant import (
    KVCache,
    cache_bytes_per_token,
    dequantize_int4_keys,
    dequantize_int4_values,
    dequantize_int8,
    dequantize_kivi_keys,
    dequantize_kivi_values,
    pack_codes,
    pack_int4,
    quantize_cache,
    quantize_int4_keys,
    quantize_int4_values,
    quantize_int8,
    quantize_kivi_keys,
    quantize_kivi_values,
    unpack_codes,
    unpack_int4,
)
from jaxllm.kernels.decode_attention.reference import decode_attention_reference, dequantize_cache

__all__ = [
    "KVCache",
    "cache_bytes_per_token",
    "decode_attention",
    "decode_attention_reference",
    "dequantize_cache",
    "dequantize_int4_keys",
    "dequantize_int4_values",
    "dequantize_int8",
    "dequantize_kivi_keys",
    "dequantize_kivi_values",
    "pack_codes",
    "pack_int4",
    "quantize_cache",
    "quantize_int4_keys",
    "quantize_int4_values",
    "quantize_int8",
    "quantize_kivi_keys",
    "quantize_kivi_values",
    "unpack_codes",
    "unpack_int4",
]
