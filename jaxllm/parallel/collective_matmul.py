"""Collective matmul (Wang et al. 2023, "Overlap communication with dependent computation via
decomposition in large deep learning models"; the JAX shard_map tutorial's "collective
matmul"): the all-gather over `tensor` that Megatron-SP puts before a column-parallel matmul
(`mesh.tensor_sequence_parallel`) decomposed into mesh.tensor - 1 ring steps
(collective-permutes), each overlapped with the partial matmul of the length chunk a device
already holds. The result equals all-gather-then-matmul exactly: every output element is the
same dot product. Switched on by `mesh.overlap=[collective_matmul]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxllm import sharding


def collective_matmul_active(x: jax.Array) -> bool:
    """Whether the active settings ask for collective matmul and `x` [B, L, D] splits for it:
    rows over the batch axes, length over `sequence` x `tensor` (a decode step's single token
    keeps the plain matmul)."""
    parallel = sharding.current()
    mesh = parallel.mesh
    if mesh is None or "collective_matmul" not in parallel.overlap:
        return False
    t = mesh.shape.get("tensor", 1)
    rows = 1
    for a in sharding.RULES["batch"]:
        rows *= mesh.shape.get(a, 1)
    return t > 1 and x.shape[0] % rows == 0 and x.shape[1] % (t * mesh.shape["sequence"]) == 0


def _ring_matmul(x_BxCxD: jax.Array, ws_DxF: list[jax.Array], dtype) -> list[jax.Array]:
    """Per device: its length chunk of x and its column block of each w -> [B, T*C, F/T] per
    w, the matmuls of the whole (sequence shard's) length: the chunks go one step round the
    ring while the previous one multiplies every w."""
    t = jax.lax.axis_size("tensor")
    i = jax.lax.axis_index("tensor")
    b, c = x_BxCxD.shape[:2]
    ring = [(j, (j - 1) % t) for j in range(t)]  # device j sends its chunk to j - 1
    outs_BxLxF = [jnp.zeros((b, t * c, w.shape[1]), dtype) for w in ws_DxF]
    chunk = x_BxCxD
    for step in range(t):  # at `step`, device i holds chunk (i + step) % t
        nxt = jax.lax.ppermute(chunk, "tensor", ring) if step < t - 1 else None
        start = ((i + step) % t) * c
        for k, w in enumerate(ws_DxF):
            y = jnp.einsum("bcd,df->bcf", chunk, w, preferred_element_type=dtype).astype(dtype)
            outs_BxLxF[k] = jax.lax.dynamic_update_slice_in_dim(outs_BxLxF[k], y, start, 1)
        chunk = nxt
    return outs_BxLxF


def collective_matmul(x_BxLxD: jax.Array, ws_DxF, dtype) -> list[jax.Array]:
    """[x [B, L, D] @ w [D, F] for w in `ws_DxF`] in `dtype`, one ring of x's chunks for
    all of them; L split over `sequence` x `tensor` on the way in, each F over `tensor` on the
    way out (`collective_matmul_active` must hold)."""
    mesh = sharding.current().mesh
    batch = sharding.spec(("batch",))[0]
    x_spec = PartitionSpec(batch, ("sequence", "tensor"), None)
    ws_DxF = [w.astype(dtype) for w in ws_DxF]
    return jax.shard_map(
        lambda x, ws: _ring_matmul(x, ws, dtype),
        mesh=sharding.shard_map_mesh(mesh),
        in_specs=(x_spec, [PartitionSpec(None, "tensor")] * len(ws_DxF)),
        out_specs=[PartitionSpec(batch, "sequence", "tensor")] * len(ws_DxF),
    )(x_BxLxD.astype(dtype), ws_DxF)
