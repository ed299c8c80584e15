"""`chunk_scan`: the inter-chunk recurrence of the chunked gated delta rule through the Pallas
kernel (`pallas.py`; `interpret=True` runs it anywhere, as the tests do on CPU), with a
custom VJP whose backward pass is the reference's (`reference.py`, recomputed: the forward
saves only its inputs)."""

from __future__ import annotations

import functools

import jax
from jaxllm.kernels.gated_delta.reference import chunk_scan_reference


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def chunk_scan(u0, w, attn, q, k, decay, s0, interpret: bool = False):
    """(o [B, H, N, C, V], final state [B, H, K, V]); arguments as `chunk_scan_reference`."""
    from jaxllm.kernels.gated_delta import pallas

    return pallas.forward(u0, w, attn, q, k, decay, s0, interpret=interpret)


def _forward(u0, w, attn, q, k, decay, s0, interpret):
    return chunk_scan(u0, w, attn, q, k, decay, s0, interpret), (u0, w, attn, q, k, decay, s0)


def _backward(interpret, saved, cotangents):
    del interpret
    _, vjp = jax.vjp(chunk_scan_reference, *saved)
    return vjp(cotangents)


chunk_scan.defvjp(_forward, _backward)
