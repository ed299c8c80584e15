"""`ragged_all_to_all`: `jax.lax.ragged_all_to_all` with one slice per device where the
backend compiles it, and where it does not (XLA:CPU) the same exchange as a dense all-to-all of
slices padded to a static bound (`padded_ragged_all_to_all`), which is exact.

Either runs inside the named scope `ragged_all_to_all_rows{sent}_of{buffer}` (kept on its
transpose): `jaxllm.hlo_collectives` counts such ops as a ragged all-to-all of `sent` rows, the
rows a device sends, rather than the rows of the padded buffer or the receive buffer."""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCOPE = "ragged_all_to_all_rows"


def ragged_supported() -> bool:
    """Whether the default backend compiles `jax.lax.ragged_all_to_all` (XLA:CPU does not)."""
    return jax.default_backend() != "cpu"


def padded_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, rows
):
    """`jax.lax.ragged_all_to_all` (one slice per device) as a dense all-to-all: slice j of
    at most `rows` rows is padded to `rows` and sent to device j, which writes the first
    recv_sizes[i] rows from device i at the offset device i named for it."""
    r = jnp.arange(rows, dtype=input_offsets.dtype)
    src_NxR = input_offsets[:, None] + r[None, :]
    live_NxR = r[None, :] < send_sizes[:, None]
    send = jnp.take(operand, jnp.where(live_NxR, src_NxR, 0).reshape(-1), axis=0)
    live = live_NxR.reshape(-1, *(1,) * (operand.ndim - 1))
    send = jnp.where(live, send, jnp.zeros((), operand.dtype))
    recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # [n * rows, ...]
    offsets_N = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dst_NxR = offsets_N[:, None] + r[None, :]
    dst_NxR = jnp.where(r[None, :] < recv_sizes[:, None], dst_NxR, output.shape[0])
    return output.at[dst_NxR.reshape(-1)].set(recv, mode="drop")


def ragged_all_to_all(
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    *,
    axis_name,
    rows: int,
    sent: int,
    ragged: bool | None = None,
):
    """`jax.lax.ragged_all_to_all` over `axis_name` (same arguments, one slice per device),
    each slice at most `rows` rows and at most `sent` rows in all; `ragged` (default: whether
    the backend has it) picks the primitive or its padded form. Named for `hlo_collectives` by
    `sent` of the n * rows rows of a padded exchange."""
    ragged = ragged_supported() if ragged is None else ragged
    with jax.named_scope(f"{SCOPE}{sent}_of{jax.lax.axis_size(axis_name) * rows}"):
        args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
        if ragged:
            return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)
        return padded_ragged_all_to_all(*args, axis_name=axis_name, rows=rows)
