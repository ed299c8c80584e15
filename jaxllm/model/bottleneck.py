"""Bottleneck adapters (Houlsby et al. 2019, arXiv:1902.00751) in every block of the model.

The output h_BxLxD of each of a block's two sublayers (the attention after its output
projection, the MLP or MoE layer after its down projection), before it joins the residual
stream (and before a sandwich block's post-norm and the residual dropout), becomes

    h + act(h W_down + b_down) W_up + b_up,     W_down [D, M], W_up [M, D], M = peft.adapter_size

W_down starts Kaiming-uniform (bound 1 / sqrt(D), as LoRA's A), W_up and both biases at zero,
so step 0 is exactly the base model, and the first steps move W_up first. The four tensors of a
site are `lora.AdapterParam`s of the block (`attn_adapter_down`, `attn_adapter_down_bias`,
`attn_adapter_up`, `attn_adapter_up_bias`; the same for `mlp`), with the block's leading
`layers` dims, so a stacked (scanned) block's adapters are stacked too and a pipeline stage
holds its layers' adapters. `embed` follows the model's weights; `adapter` (M) is replicated.

Unlike LoRA's s A B they are layers of their own, nonlinear: they merge into no weight
(`lora.merged_params` refuses them), and Hugging Face PEFT has no such adapter to export to.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ConfigError, PeftConfig
from jaxllm.model import lora

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,
    "tanh": jnp.tanh,
}


def _stacked_shape(block: nnx.Module) -> tuple[int, ...]:
    """The leading `layers` dims every parameter of `block` has (() for an unstacked one)."""
    for _, module in nnx.iter_modules(block):
        for var in vars(module).values():
            if isinstance(var, nnx.Param):
                axes = tuple(var.get_metadata().get("axes", ()))
                n = 0
                while n < len(axes) and axes[n] == "layers":
                    n += 1
                return tuple(var.shape[:n])
    return ()


def attach(model: nnx.Module, peft: PeftConfig, key: jax.Array) -> None:
    """Adds a bottleneck adapter after each sublayer of every block of `model` (a block names
    its sublayers in `ADAPTER_SITES`), in place: W_down from `key`, W_up and the biases zeros.
    ConfigError for a model without such blocks."""
    cfg = model.cfg
    d, m, dtype = cfg.d_model, peft.adapter_size, jnp.dtype(cfg.param_dtype)
    blocks = [b for _, b in nnx.iter_modules(model) if getattr(type(b), "ADAPTER_SITES", None)]
    if not blocks:
        raise ConfigError(
            f"peft.method=adapter adds adapters to the blocks of decoder and encoder models; "
            f"model.kind={cfg.kind} has none it can adapt yet. Use peft.method=lora."
        )
    bound = 1.0 / math.sqrt(d)  # kaiming_uniform_(a=sqrt(5)) over fan-in D, as LoRA's A
    for i, block in enumerate(blocks):
        lead = _stacked_shape(block)
        lead_axes = ("layers",) * len(lead)
        for j, site in enumerate(type(block).ADAPTER_SITES):
            sub = jax.random.fold_in(key, i * 16 + j)
            down = jax.random.uniform(sub, (*lead, d, m), dtype, -bound, bound)
            params = {
                "down": (down, ("embed", "adapter")),
                "down_bias": (jnp.zeros((*lead, m), dtype), ("adapter",)),
                "up": (jnp.zeros((*lead, m, d), dtype), ("adapter", "embed")),
                "up_bias": (jnp.zeros((*lead, d), dtype), ("embed",)),
            }
            for name, (value, axes) in params.items():
                setattr(
                    block,
                    f"{site}_adapter_{name}",
                    lora.AdapterParam(value, axes=(*lead_axes, *axes)),
                )
        block.adapter_activation = peft.adapter_activation
        block.adapter_dropout = float(peft.dropout)
    model.lora_dropout = float(peft.dropout)  # the model then draws per-layer dropout keys


def apply(block: nnx.Module, site: str, h_BxLxD: jax.Array) -> jax.Array:
    """The sublayer output `h_BxLxD` of `block`'s `site` through its adapter, h + up(act(down(
    h))), in h's dtype with float32 accumulation; h unchanged when the block has none. In
    training (`lora.dropout_keys`) with peft.dropout, the adapter's input is dropped out."""
    down = getattr(block, f"{site}_adapter_down", None)
    if down is None:
        return h_BxLxD
    dtype, f32 = h_BxLxD.dtype, jnp.float32
    x_BxLxD = h_BxLxD
    key = lora.next_key() if block.adapter_dropout else None
    if key is not None:
        keep = jax.random.bernoulli(key, 1.0 - block.adapter_dropout, x_BxLxD.shape)
        x_BxLxD = jnp.where(keep, x_BxLxD / (1.0 - block.adapter_dropout), 0).astype(dtype)
    b_down = getattr(block, f"{site}_adapter_down_bias")[...].astype(f32)
    z_BxLxM = jnp.einsum(
        "bld,dm->blm", x_BxLxD, down[...].astype(dtype), preferred_element_type=f32
    )
    z_BxLxM = ACTIVATIONS[block.adapter_activation](z_BxLxM + b_down[None, None]).astype(dtype)
    up = getattr(block, f"{site}_adapter_up")[...].astype(dtype)
    b_up = getattr(block, f"{site}_adapter_up_bias")[...].astype(f32)
    out_BxLxD = jnp.einsum("blm,md->bld", z_BxLxM, up, preferred_element_type=f32)
    return (h_BxLxD.astype(f32) + out_BxLxD + b_up[None, None]).astype(dtype)
