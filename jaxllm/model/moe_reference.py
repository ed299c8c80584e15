"""The MoE layer's reference: every expert on every token (`jaxllm.model.moe`'s dispatch modes
must equal it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_reference(x_BxLxD, combine_BxLxE, gate_ExDxF, up_ExDxF, down_ExFxD, dtype):
    """Every expert on every token, mixed by `combine_BxLxE` (zero where an expert was not
    chosen or the assignment was dropped): what both dispatch modes must equal."""
    gate_BxLxExF = jnp.einsum("bld,edf->blef", x_BxLxD.astype(dtype), gate_ExDxF.astype(dtype))
    up_BxLxExF = jnp.einsum("bld,edf->blef", x_BxLxD.astype(dtype), up_ExDxF.astype(dtype))
    y_BxLxExD = jnp.einsum(
        "blef,efd->bled", jax.nn.silu(gate_BxLxExF) * up_BxLxExF, down_ExFxD.astype(dtype)
    )
    out = jnp.einsum("ble,bled->bld", combine_BxLxE, y_BxLxExD, preferred_element_type=jnp.float32)
    return out.astype(dtype)
