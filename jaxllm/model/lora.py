"""LoRA adapters (Hu et al. 2021, arXiv:2106.09685) on the model's weights.

An adapted weight W of shape [*in, *out] gains two factors, A [*in, r] and B [r, *out], and the
layer computes x W + s (x A) B with s = alpha / r (alpha / sqrt(r) with rank-stabilised
scaling). A starts random (Kaiming-uniform, as Hugging Face PEFT) and B at zero, so step 0
equals the base model. The factors are `LoRAParam`s attached next to their weight
(`q_proj_lora_a`, `q_proj_lora_b`), with the weight's logical axes on the dims they share with
it and `lora_rank` (replicated) on r: they shard under fsdp / tensor / expert like W, and a
stacked (scanned) weight's factors are stacked too.

`kernel(module, name)` is what model code reads a weight through: the array itself, or a
`LoRAKernel` that `layers.matmul` turns into the two paths. Routed experts (whose weights travel
through the expert dispatch) and MLA's absorbed decode read `dense(...)`: the merged W + s A B.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import PeftConfig


class LoRAParam(nnx.Param):
    """A LoRA factor: what trains under peft.method=lora|qlora."""


class LoRAKernel(NamedTuple):
    """A weight with its adapter: base [*lead, *in, *out] (an array, or an `NF4Tensor` under
    QLoRA), a [*lead, *in, r], b [*lead, r, *out], the output scale and the input dropout."""

    base: Any
    a: jax.Array
    b: jax.Array
    scale: float
    dropout: float = 0.0
    key: jax.Array | None = None


def in_dims(name: str) -> int:
    """How many dims of the weight `name` (after the stacked and expert dims) it contracts:
    the output projection takes (heads, head_dim), every other weight one dim."""
    return 2 if name == "o_proj" else 1


def _lead(axes: tuple) -> int:
    """Leading dims every factor keeps whole: stacked layers and the expert dim."""
    n = 0
    while n < len(axes) and axes[n] in ("layers", "expert"):
        n += 1
    return n


def attach(model: nnx.Module, peft: PeftConfig, key: jax.Array) -> None:
    """Adds the adapters `peft` asks for to `model` in place (A from `key`, B zeros), next to
    every weight whose name it targets. Nothing for peft.method none / prompt."""
    if not peft.lora:
        return
    found = set()
    for path, module in list(nnx.iter_modules(model)):
        for name, var in list(vars(module).items()):
            if not isinstance(var, nnx.Param) or isinstance(var, LoRAParam):
                continue
            axes = tuple(var.get_metadata().get("axes", ()))
            if not peft.targeted(name, "expert" in axes) or var.ndim < 2:
                continue
            found.add(name)
            lead, n_in = _lead(axes), in_dims(name)
            shape = var.shape
            ins, outs = shape[lead : lead + n_in], shape[lead + n_in :]
            fan_in = math.prod(ins)
            key, sub = jax.random.split(jax.random.fold_in(key, len(found)))
            bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)), as PEFT
            a = jax.random.uniform(
                sub, (*shape[: lead + n_in], peft.rank), var.dtype, -bound, bound
            )
            b = jnp.zeros((*shape[:lead], peft.rank, *outs), var.dtype)
            a_axes = (*axes[: lead + n_in], "lora_rank")
            b_axes = (*axes[:lead], "lora_rank", *axes[lead + n_in :])
            setattr(module, f"{name}_lora_a", LoRAParam(a, axes=a_axes))
            setattr(module, f"{name}_lora_b", LoRAParam(b, axes=b_axes))
            setattr(module, f"{name}_lora_scale", float(peft.scale))
            setattr(module, f"{name}_lora_dropout", float(peft.dropout))
    if not found:
        raise ValueError(f"peft.targets {list(peft.targets)} match no weight of this model")


def kernel(module: nnx.Module, name: str, key: jax.Array | None = None):
    """The weight `name` of `module` as `layers.matmul` takes it: its value (an array or an
    `NF4Tensor`), or a `LoRAKernel` when it has an adapter (`key`: the adapter's dropout)."""
    base = getattr(module, name).get_value()
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return base
    return LoRAKernel(
        base,
        a[...],
        getattr(module, f"{name}_lora_b")[...],
        getattr(module, f"{name}_lora_scale"),
        getattr(module, f"{name}_lora_dropout"),
        key,
    )


def delta(a: jax.Array, b: jax.Array, scale: float, n_in: int, dtype) -> jax.Array:
    """s A B as a weight: a [*lead, *in, r], b [*lead, r, *out] -> [*lead, *in, *out], where
    `in` is the last `n_in` dims before r."""
    lead = a.ndim - 1 - n_in
    ins, outs = a.shape[lead:-1], b.shape[lead + 1 :]
    a2 = a.reshape(*a.shape[:lead], math.prod(ins), a.shape[-1]).astype(dtype)
    b2 = b.reshape(*b.shape[: lead + 1], math.prod(outs)).astype(dtype)
    w = jnp.matmul(a2, b2, preferred_element_type=jnp.float32) * scale
    return w.reshape(*a.shape[:lead], *ins, *outs).astype(dtype)


def dense(module: nnx.Module, name: str, dtype) -> jax.Array:
    """The weight `name` of `module` as one array: dequantized to `dtype` (QLoRA) and with its
    adapter merged in (W + s A B), for code that needs the weight itself; a plain weight as
    stored."""
    k = kernel(module, name)
    if not isinstance(k, LoRAKernel):
        return k if isinstance(k, jax.Array) else as_array(k, dtype)
    return as_array(k.base, dtype) + delta(k.a, k.b, k.scale, in_dims(name), dtype)


def as_array(w, dtype) -> jax.Array:
    """A stored weight in the compute `dtype`: cast, or dequantized from NF4."""
    dequantize = getattr(w, "dequantize", None)
    return w.astype(dtype) if dequantize is None else dequantize(dtype)


def trainable(peft: PeftConfig | None):
    """The nnx filter of what trains under `peft`: every parameter (none), the LoRA factors,
    or the soft prompt."""
    if peft is None or peft.method == "none":
        return nnx.Param
    if peft.method == "prompt":
        return PromptParam
    return LoRAParam


class PromptParam(nnx.Param):
    """Soft-prompt embeddings: what trains under peft.method=prompt."""
