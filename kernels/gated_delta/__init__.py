"""The sequential part of the chunked gated delta rule (`jaxllm.model.delta_rule.chunked`): the
state passed from chunk to chunk. `reference.py` (pure JAX, a `lax.scan`), `pallas.py` (one
Pallas program per (batch, value head) looping over the chunks with the state in registers /
VMEM), `ops.py` (custom_vjp: the kernel forward, the reference's gradients backward)."""

from jaxllm.kernels.gated_delta.ops import chunk_scan
from jaxllm.kernels.gated_delta.reference import chunk_scan_reference

__all__ = ["chunk_scan", "chunk_scan_reference"]
