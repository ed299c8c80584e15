"""The int4 weight-only matmul as a Pallas Triton kernel (CUDA GPUs).

Decode is memory-bound: at batch 1 a step reads every weight once, so reading 4-bit codes
instead of 16-bit weights can approach 4x less time where the dequantization hides under the
loads (the Marlin / Machete idea). Grid (M / block_m, N / block_n): each program owns one
[block_m, block_n] tile of y and walks K in blocks of block_k rows, loading the block's packed
bytes [block_k / 2, block_n] once, splitting them into the even rows (low nibbles) and the odd
rows (high nibbles), scaling each by the block's one group scale row (block_k divides the group
size, so a block never spans groups), and taking two dots against x's even and odd columns
(`ops.py` splits x into those beforehand: x is small at decode, and this keeps the kernel free
of an interleaving reshape). Accumulation in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _kernel(xe_ref, xo_ref, codes_ref, scales_ref, *rest, block_k, group, symmetric):
    if symmetric:
        (y_ref,) = rest
        zeros_ref = None
    else:
        zeros_ref, y_ref = rest
    bm, bn = y_ref.shape
    n = pl.program_id(1)
    cols = pl.ds(n * bn, bn)
    half = block_k // 2

    def body(kb, acc):
        rows = pl.ds(kb * half, half)
        c = codes_ref[rows, cols].astype(jnp.int32)
        g = pl.ds(lax.div(kb * block_k, group), 1)
        s = scales_ref[g, cols].astype(jnp.float32)
        z = 8.0 if zeros_ref is None else zeros_ref[g, cols].astype(jnp.float32)
        lo = ((c & 0xF).astype(jnp.float32) - z) * s
        hi = ((c >> 4).astype(jnp.float32) - z) * s
        xe, xo = xe_ref[:, rows], xo_ref[:, rows]
        acc += jnp.dot(xe, lo.astype(xe.dtype), preferred_element_type=jnp.float32)
        return acc + jnp.dot(xo, hi.astype(xo.dtype), preferred_element_type=jnp.float32)

    k_blocks = codes_ref.shape[0] // half
    acc = lax.fori_loop(0, k_blocks, body, jnp.zeros((bm, bn), jnp.float32))
    y_ref[...] = acc.astype(y_ref.dtype)


def forward(xe, xo, codes, scales, zeros, *, group, block_m, block_n, block_k, out_dtype,
            interpret=False):  # fmt: skip
    """y [M, N] from x's even / odd columns [M, K / 2] (M a multiple of block_m)."""
    m, n = xe.shape[0], codes.shape[1]
    row = pl.BlockSpec((block_m, xe.shape[1]), lambda i, j: (i, 0))
    whole = pl.no_block_spec
    operands = (xe, xo, codes, scales) + (() if zeros is None else (zeros,))
    kernel = functools.partial(_kernel, block_k=block_k, group=group, symmetric=zeros is None)
    return pl.pallas_call(
        kernel,
        grid=(m // block_m, n // block_n),
        in_specs=[row, row] + [whole] * (len(operands) - 2),
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="int4_matmul",
    )(*operands)
