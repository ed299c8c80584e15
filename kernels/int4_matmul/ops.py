"""`int4_matmul(x, codes, scales, zeros)`: x [M, K] times a weight stored as packed int4 codes
with per-group scales (layout in `reference.py`), without materialising the float weight.

Backends (`backend=`):
- `"triton"`: the Pallas Triton kernel (`triton.py`) for CUDA GPUs, and with `interpret=True`
  anywhere (the tests run it so on CPU). It takes what `triton_supported` accepts: N a multiple
  of block_n, K / 2 a multiple of block_k / 2, and block_k dividing the group size (every block
  of K inside one group). M is padded to block_m (16 rows at least, the smallest tensor-core
  tile), so a decode step at batch 1 is one padded tile.
- `"xla"`: `int4_matmul_reference` (dequantize, then one dot), which XLA fuses as it sees fit.
- `"auto"`: triton on a CUDA GPU when supported, xla otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxllm.kernels.int4_matmul.reference import int4_matmul_reference

BACKENDS = ("auto", "triton", "xla")


def _blocks(k: int, n: int, group: int) -> tuple[int, int, int] | None:
    """(block_m, block_n, block_k) for K = k, N = n, groups of `group` rows, or None."""
    block_n = next((b for b in (128, 64, 32, 16) if n % b == 0), None)
    block_k = next((b for b in (128, 64, 32) if k % b == 0 and group % b == 0), None)
    if block_n is None or block_k is None:
        return None
    return 16, block_n, block_k


def triton_supported(x_shape, codes_shape, scales_shape) -> bool:
    """Whether the Triton kernel takes these shapes (see the module docstring)."""
    k, n = codes_shape[0] * 2, codes_shape[1]
    return len(x_shape) == 2 and x_shape[1] == k and _blocks(k, n, k // scales_shape[0]) is not None


def int4_matmul(x_MxK, codes_PxN, scales_GxN, zeros_GxN=None, *, out_dtype=None,
                backend: str = "auto", interpret: bool = False) -> jax.Array:  # fmt: skip
    """x [M, K] @ W, W [K, N] given as uint8 codes [K / 2, N], scales [K / group, N] and (or
    None for symmetric codes) uint8 zero points like scales. Returns [M, N] in `out_dtype`
    (default x's dtype)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    out_dtype = out_dtype or x_MxK.dtype
    supported = triton_supported(x_MxK.shape, codes_PxN.shape, scales_GxN.shape)
    if backend == "auto":
        on_gpu = jax.default_backend() == "gpu"
        backend = "triton" if (on_gpu or interpret) and supported else "xla"
    if backend == "xla":
        return int4_matmul_reference(x_MxK, codes_PxN, scales_GxN, zeros_GxN, out_dtype)
    if not supported:
        raise ValueError(
            f"the Triton int4 matmul does not take x {x_MxK.shape}, codes {codes_PxN.shape}, "
            f"scales {scales_GxN.shape} (see triton_supported)"
        )
    from jaxllm.kernels.int4_matmul import triton

    m, k = x_MxK.shape
    group = k // scales_GxN.shape[0]
    block_m, block_n, block_k = _blocks(k, codes_PxN.shape[1], group)
    pad = -m % block_m
    x = jnp.pad(x_MxK, ((0, pad), (0, 0)))
    y = triton.forward(
        x[:, 0::2], x[:, 1::2], codes_PxN, scales_GxN, zeros_GxN,
        group=group, block_m=block_m, block_n=block_n, block_k=block_k,
        out_dtype=out_dtype, interpret=interpret,
    )  # fmt: skip
    return y[:m]
