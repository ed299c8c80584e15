"""The routed experts of `jaxllm.model.moe`: each expert's gated MLP run on capacity buffers
(`expert_mlp`, `capacity_experts_local`) or as grouped matmuls over sorted assignments
(`grouped_experts`, `dropless_experts_local`), the dense reference both must equal, and the
calibration statistics of the expert weights.

The gate is `act(gate, up)`: SwiGLU (silu(gate) * up; Mixtral, DeepSeek) or gpt-oss's clamped
SwiGLU (`clamped_swiglu`, as transformers' `GptOssExperts._apply_gate`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.model import coded, lora
from jaxllm.model.layers import matmul, ragged_matmul


def swiglu(gate, up):
    """silu(gate) * up (Shazeer 2020, arXiv:2002.05202)."""
    return jax.nn.silu(gate) * up


def clamped_swiglu(gate, up, *, alpha: float, limit: float):
    """gpt-oss's expert gate: gate clipped from above and up on both sides at `limit`, then
    (up + 1) * gate * sigmoid(alpha * gate) (OpenAI 2025, gpt-oss model card)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


def expert_activation(cfg):
    """The `act(gate, up)` of a `MoEConfig`."""
    if cfg.activation == "swiglu":
        return swiglu
    return functools.partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)


def expert_mlp(
    x_BxExCxD, gate_ExDxF, up_ExDxF, down_ExFxD, dtype, fp8=None, axis_name=None, act=swiglu
):
    """Each expert's gated MLP (`act`) on its own buffer rows (hidden units split over
    `axis_name`)."""
    gate_BxExCxF = matmul("gecd,edf->gecf", x_BxExCxD, gate_ExDxF, dtype, fp8=fp8)
    up_BxExCxF = matmul("gecd,edf->gecf", x_BxExCxD, up_ExDxF, dtype, fp8=fp8)
    h_BxExCxF = act(gate_BxExCxF, up_BxExCxF)
    return matmul("gecf,efd->gecd", h_BxExCxF, down_ExFxD, dtype, fp8=fp8, axis_name=axis_name)


def capacity_experts_local(
    buf_BxExCxD,
    gate_ExDxF,
    up_ExDxF,
    down_ExFxD,
    *,
    expert_axis,
    tensor_axis,
    dtype,
    fp8=None,
    act=swiglu,
):
    """Per device under shard_map: sends each expert's buffer rows to the device holding the
    expert (all-to-all over `expert_axis`: [B, E, C, D] -> [n * B, E / n, C, D]), runs the
    local experts (hidden units split over `tensor_axis`), and sends the results back."""
    x_BxExCxD = jax.lax.all_to_all(buf_BxExCxD, expert_axis, 1, 0, tiled=True)
    y_BxExCxD = expert_mlp(
        x_BxExCxD, gate_ExDxF, up_ExDxF, down_ExFxD, dtype, fp8, tensor_axis, act
    )
    y_BxExCxD = jax.lax.psum(y_BxExCxD, tensor_axis)
    return jax.lax.all_to_all(y_BxExCxD, expert_axis, 0, 1, tiled=True)


def grouped_experts(
    x_TxD,
    expert_TxX,
    weight_TxX,
    gate_ExDxF,
    up_ExDxF,
    down_ExFxD,
    dtype,
    fp8=None,
    axis=None,
    act=swiglu,
):
    """Dropless experts on one device: assignments sorted by expert, grouped matmuls, unsorted
    and combined. `expert_TxX` indexes the E experts given; assignments outside [0, E) belong
    to other devices' experts and contribute nothing here. Hidden units split over `axis`."""
    e = gate_ExDxF.shape[0]
    t, x = expert_TxX.shape
    expert_A = expert_TxX.reshape(t * x)
    mine_A = (expert_A >= 0) & (expert_A < e)
    key_A = jnp.where(mine_A, expert_A, e)  # others sort last, outside every group
    order_A = jnp.argsort(key_A, stable=True)
    inverse_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(t * x, dtype=order_A.dtype))
    sizes_E = jnp.sum(jax.nn.one_hot(key_A, e, dtype=jnp.int32), axis=0)
    xs_AxD = jnp.take(x_TxD, order_A // x, axis=0).astype(dtype)

    def grouped(lhs, rhs, axis_name=None):
        return ragged_matmul(lhs, rhs, sizes_E, dtype, fp8=fp8, axis_name=axis_name)

    h_AxF = act(grouped(xs_AxD, gate_ExDxF), grouped(xs_AxD, up_ExDxF))
    y_AxD = jnp.take(grouped(h_AxF, down_ExFxD, axis), inverse_A, axis=0)
    y_AxD = jnp.where(mine_A[:, None], y_AxD, 0)
    out_TxD = jnp.einsum(
        "tx,txd->td",
        weight_TxX.astype(dtype),
        y_AxD.reshape(t, x, -1),
        preferred_element_type=jnp.float32,
    )
    return out_TxD.astype(dtype)


def dropless_experts_local(
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
    fp8=None,
    act=swiglu,
):
    """Per device (under shard_map, or alone when both axes are None): with experts split over
    `expert_axis`, gathers the tokens of the expert group, runs this device's experts on the
    assignments that chose them, and reduce-scatters the partial outputs back."""
    first = 0
    if expert_axis is not None:
        gather = functools.partial(jax.lax.all_gather, axis_name=expert_axis, axis=0, tiled=True)
        x_BxLxD, expert_BxLxX, weight_BxLxX = map(gather, (x_BxLxD, expert_BxLxX, weight_BxLxX))
        first = jax.lax.axis_index(expert_axis) * gate_ExDxF.shape[0]
    b, l, d = x_BxLxD.shape
    out_TxD = grouped_experts(
        x_BxLxD.reshape(b * l, d),
        expert_BxLxX.reshape(b * l, -1) - first,
        weight_BxLxX.reshape(b * l, -1),
        gate_ExDxF,
        up_ExDxF,
        down_ExFxD,
        dtype,
        fp8,
        tensor_axis,
        act,
    )
    out_BxLxD = out_TxD.reshape(b, l, -1)  # D: the input may carry a bias column
    if expert_axis is not None:
        out_BxLxD = jax.lax.psum_scatter(out_BxLxD, expert_axis, scatter_dimension=0, tiled=True)
    if tensor_axis is not None:
        out_BxLxD = jax.lax.psum(out_BxLxD, tensor_axis)
    return out_BxLxD


def dense_reference(x_BxLxD, combine_BxLxE, gate_ExDxF, up_ExDxF, down_ExFxD, dtype, act=swiglu):
    """Every expert on every token, mixed by `combine_BxLxE` (zero where an expert was not
    chosen or the assignment was dropped): what both dispatch modes must equal."""
    gate_BxLxExF = jnp.einsum("bld,edf->blef", x_BxLxD.astype(dtype), gate_ExDxF.astype(dtype))
    up_BxLxExF = jnp.einsum("bld,edf->blef", x_BxLxD.astype(dtype), up_ExDxF.astype(dtype))
    y_BxLxExD = jnp.einsum(
        "blef,efd->bled", act(gate_BxLxExF, up_BxLxExF), down_ExFxD.astype(dtype)
    )
    out = jnp.einsum("ble,bled->bld", combine_BxLxE, y_BxLxExD, preferred_element_type=jnp.float32)
    return out.astype(dtype)


def record_experts(recorder, layer, x_BxLxD, combine_BxLxE, act=swiglu) -> None:
    """Calibration statistics (`tap`) of the experts' weights that `recorder` names: each
    expert's inputs are the tokens routed to it (capacity drops aside), and its down
    projection's the SwiGLU of those."""
    names = [recorder.claim(getattr(layer, n).get_value()) for n in EXPERT_WEIGHTS]
    if not any(names):
        return
    f32 = jnp.float32
    gate, up, _ = (lora.dense(layer, n, f32) for n in EXPERT_WEIGHTS)
    x_TxD = x_BxLxD.reshape(-1, x_BxLxD.shape[-1]).astype(f32)
    chosen_ExT = (combine_BxLxE.reshape(-1, combine_BxLxE.shape[-1]) > 0).T.astype(f32)
    if recorder.mask_T is not None:
        chosen_ExT = chosen_ExT * recorder.mask_T.astype(f32)[None, :]
    x_ExDxT = jnp.broadcast_to(x_TxD.T, (gate.shape[0], *x_TxD.T.shape))
    h_ExFxT = act(jnp.einsum("td,edf->eft", x_TxD, gate), jnp.einsum("td,edf->eft", x_TxD, up))
    for name, rows in zip(names, (x_ExDxT, x_ExDxT, h_ExFxT)):
        if name is not None:  # what is kept whole: the layer's input, for all experts
            recorder.add(name, rows, chosen_ExT, raw=x_TxD.T if rows is x_ExDxT else None)


EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def expert_weight(layer, name: str, dtype):
    """A routed expert stack as the dispatch takes it: W8A8 codes as stored (its matmuls
    quantize each token's row), anything else one array (`lora.dense`: an adapter merged in)."""
    w = getattr(layer, name).get_value()
    if coded.w8a8(w) and not hasattr(layer, f"{name}_lora_a"):
        return w
    return lora.dense(layer, name, dtype)
