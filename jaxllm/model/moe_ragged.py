"""Dropless experts with a ragged all-to-all dispatch (`mesh.dropless_dispatch=ragged_all_to_all`):
each device sends each of its tokens once to every device holding one of the token's chosen
experts, and nowhere else, instead of gathering every token of the expert group.

Per device under shard_map (`jaxllm.parallel.per_shard_dropless`), with n devices over
`expert`, E_n = E / n experts each, T local tokens:

1. the (token, device) pairs a token's top-k reach are sorted by device; a token goes to at
   most min(n, k, M) devices (M: DeepSeek-V2/V3's device limit, from group-limited routing), so
   the send buffer holds S = T * min(n, k, M) rows;
2. counts per device are exchanged (all-to-all), then the rows, their expert ids local to the
   receiver and their combine weights by `jax.lax.ragged_all_to_all`; the receiver puts the
   rows of source i at i * T (a source sends at most T rows to one device);
3. the receiver runs its experts on what it got (`moe_experts.grouped_experts`: sorted by
   local expert, grouped matmuls, weighted sum of each row's choices that are its own);
4. the weighted partial outputs go back the same way and each token sums its rows.

Backends without a ragged all-to-all (XLA:CPU) run the same exchange as a padded all-to-all of
T rows per device pair (`jaxllm.parallel.ragged_all_to_all`), which is exact and moves as many
bytes as the all-gather dispatcher.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm import parallel
from jaxllm.model.moe_experts import grouped_experts, swiglu


def max_devices_per_token(n: int, top_k: int, groups: tuple[int, int] = (1, 1)) -> int:
    """How many of n expert devices one token's top_k assignments can reach: with
    group-limited routing (groups: num_groups, groups_per_token) whose groups align with
    devices, at most the devices of its groups."""
    bound = min(n, top_k)
    groups, keep = groups
    if groups > 1 and groups % n == 0:  # whole groups per device
        bound = min(bound, keep)
    elif groups > 1 and n % groups == 0:  # each group spans n / groups devices
        bound = min(bound, keep * (n // groups))
    return bound


def ragged_experts_local(
    x_BxLxD,
    expert_BxLxX,
    weight_BxLxX,
    gate_ExDxF,
    up_ExDxF,
    down_ExFxD,
    *,
    expert_axis,
    tensor_axis,
    dtype,
    groups: tuple[int, int] = (1, 1),
    ragged: bool | None = None,
    fp8=None,
    act=swiglu,
):
    """Per device under shard_map over `expert_axis` (see the module docstring). `groups`
    (num_groups, groups_per_token) bounds the devices one token's experts sit on; `ragged`
    (default: whether the backend has it) picks `jax.lax.ragged_all_to_all` or its padded
    form (`jaxllm.parallel.ragged_all_to_all`)."""
    b, l, d = x_BxLxD.shape
    t, k = b * l, expert_BxLxX.shape[-1]
    x_TxD = x_BxLxD.reshape(t, d)
    expert_TxX, weight_TxX = expert_BxLxX.reshape(t, k), weight_BxLxX.reshape(t, k)
    n, e_n = jax.lax.axis_size(expert_axis), gate_ExDxF.shape[0]
    me = jax.lax.axis_index(expert_axis)
    s = t * max_devices_per_token(n, k, groups)
    exchange = functools.partial(
        parallel.ragged_all_to_all, axis_name=expert_axis, rows=t, sent=s, ragged=ragged
    )

    # 1. (token, device) pairs, sorted by device; only pairs a token's experts reach are live
    device_TxX = expert_TxX // e_n
    dev_N = jnp.arange(n, dtype=device_TxX.dtype)
    to_TxXxN = device_TxX[:, :, None] == dev_N[None, None, :]
    live_TxN = jnp.any(to_TxXxN, axis=1)
    key_P = jnp.where(live_TxN, dev_N[None, :], n).reshape(t * n)
    order_S = jnp.argsort(key_P, stable=True)[:s]
    token_S, device_S = order_S // n, order_S % n
    live_S = key_P[order_S] < n
    send_N = jnp.sum(live_TxN, axis=0, dtype=jnp.int32)
    in_off_N = jnp.cumsum(send_N) - send_N
    recv_N = jax.lax.all_to_all(send_N, expert_axis, 0, 0, tiled=True)
    out_off_N = jnp.full((n,), me * t, jnp.int32)  # source i's rows land at i * T

    # 2. rows, local expert ids (e_n: not the receiver's) and weights to the receivers
    mine_SxX = device_TxX[token_S] == device_S[:, None]
    mine_SxX = mine_SxX & live_S[:, None]
    local_SxX = jnp.where(mine_SxX, expert_TxX[token_S] - device_S[:, None] * e_n, e_n)
    w_SxX = jnp.where(mine_SxX, weight_TxX[token_S], 0)
    rows_SxD = jnp.where(live_S[:, None], x_TxD[token_S], 0)
    sizes = (in_off_N, send_N, out_off_N, recv_N)
    r = n * t
    x_RxD = exchange(rows_SxD, jnp.zeros((r, d), rows_SxD.dtype), *sizes)
    local_RxX = exchange(local_SxX, jnp.full((r, k), e_n, local_SxX.dtype), *sizes)
    w_RxX = exchange(w_SxX, jnp.zeros((r, k), w_SxX.dtype), *sizes)

    # 3. this device's experts on what it received, each row's choices weighted and summed
    y_RxD = grouped_experts(
        x_RxD, local_RxX, w_RxX, gate_ExDxF, up_ExDxF, down_ExFxD, dtype, fp8, tensor_axis, act
    )
    if tensor_axis is not None:
        y_RxD = jax.lax.psum(y_RxD, tensor_axis)

    # 4. back to the senders, into the slots their rows left from; each token sums its rows
    back_off_N = jax.lax.all_to_all(in_off_N, expert_axis, 0, 0, tiled=True)
    src_off_N = jnp.arange(n, dtype=jnp.int32) * t
    y_SxD = exchange(
        y_RxD, jnp.zeros((s, y_RxD.shape[-1]), y_RxD.dtype), src_off_N, recv_N, back_off_N, send_N
    )
    token_S = jnp.where(live_S, token_S, t)
    out_TxD = jnp.zeros((t, y_SxD.shape[-1]), jnp.float32).at[token_S].add(y_SxD, mode="drop")
    return out_TxD.astype(dtype).reshape(b, l, -1)
