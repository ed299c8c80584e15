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

DoRA (Liu et al. 2024, arXiv:2402.09353; `peft.dora`) adds a magnitude m [*out]
(`q_proj_lora_magnitude`, axes the weight's output ones) and uses m * (W + s A B) / ||W + s A B||,
the norm over the input dims and treated as a constant, as Hugging Face PEFT's DoRA layer.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ConfigError, PeftConfig
from jaxllm.config.peft import ALL_LINEAR, LORA_TARGETS, VISION, VISION_TARGETS
from jaxllm.model import coded, fake_quant, fp8_delayed, nf4, quantized
from jaxllm.model.peft_parts import BESIDE, SAVED, picked_layers

# The trained parts of an adapted weight `name`: `name` + each (the magnitude under DoRA only).
SUFFIXES = ("_lora_a", "_lora_b", "_lora_magnitude")


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
    masked: bool = False  # peft.keep_zeros: the update is s (A B) * [base != 0]
    magnitude: jax.Array | None = None  # peft.dora: m [*lead, *out]


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
        tower = _in_tower(path)
        for name, var in list(vars(module).items()):
            if not isinstance(var, nnx.Param) or isinstance(var, LoRAParam):
                continue
            axes = tuple(var.get_metadata().get("axes", ()))
            if not peft.targeted(name, "expert" in axes, tower) or var.ndim < 2:
                continue
            if tower:
                found |= {VISION + name, VISION + ALL_LINEAR}
            else:
                found |= {name, "experts"} if "expert" in axes else {name}
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
            if peft.layers_to_transform:  # A = B = 0 elsewhere: a fixed point of training
                a = a * picked_layers(path, axes, shape, peft.layers_to_transform, a.ndim, a.dtype)
            a_axes = (*axes[: lead + n_in], "lora_rank")
            b_axes = (*axes[:lead], "lora_rank", *axes[lead + n_in :])
            setattr(module, f"{name}_lora_a", LoRAParam(a, axes=a_axes))
            setattr(module, f"{name}_lora_b", LoRAParam(b, axes=b_axes))
            setattr(module, f"{name}_lora_scale", float(peft.scale))
            setattr(module, f"{name}_lora_dropout", float(peft.dropout))
            setattr(module, f"{name}_lora_masked", bool(peft.keep_zeros))
            if peft.dora:  # m starts at the base's norms (`fit_magnitudes` for a loaded base)
                m = weight_norm(var[...], lead, n_in).astype(var.dtype)
                m_axes = (*axes[:lead], *axes[lead + n_in :])
                setattr(module, f"{name}_lora_magnitude", LoRAParam(m, axes=m_axes))
    missing = [t for t in peft.targets if t not in found and t != ALL_LINEAR]
    if ALL_LINEAR in peft.targets and not found - {
        VISION + n for n in (*VISION_TARGETS, ALL_LINEAR)
    }:
        missing.append(ALL_LINEAR)
    if missing or not found:
        raise ConfigError(
            f"peft.targets: {', '.join(missing) or ALL_LINEAR} matches no weight of this model; "
            f"it has {', '.join(sorted(targetable(model)))}."
        )
    model.lora_dropout = float(peft.dropout)  # the model then draws per-layer dropout keys
    for name in peft.modules_to_save:
        module, leaf = model, SAVED[name][-1]
        for step in SAVED[name][:-1]:
            module = getattr(module, step, None)
        var = getattr(module, leaf, None) if module is not None else None
        if not isinstance(var, nnx.Param):
            tied = " (its embeddings are tied: name embed_tokens, which trains both)"
            raise ConfigError(
                f"peft.modules_to_save: this model has no {name}"
                f"{tied if name == 'lm_head' else ''}."
            )
        setattr(module, leaf, SavedParam(var.get_value(), **var.get_metadata()))
        beside = getattr(model, BESIDE.get(name, ""), None)
        if isinstance(beside, nnx.Param):  # the score head's bias trains with it
            setattr(model, BESIDE[name], SavedParam(beside.get_value(), **beside.get_metadata()))


# The dropout key of the block being traced (`dropout_keys`), and how many adapters drew from it.
_KEYS: contextvars.ContextVar = contextvars.ContextVar("lora_dropout_keys", default=None)


@contextlib.contextmanager
def dropout_keys(key: jax.Array | None):
    """Within this context (one block's trace) adapters with dropout draw their masks from
    `key`, each its own fold of it; None (evaluation, generation) drops nothing."""
    token = _KEYS.set(None if key is None else [key, 0])
    try:
        yield
    finally:
        _KEYS.reset(token)


def next_key() -> jax.Array | None:
    """The dropout key of the next adapter in the block being traced; None outside training."""
    state = _KEYS.get()
    if state is None:
        return None
    state[1] += 1
    return jax.random.fold_in(state[0], state[1])


def _in_tower(path) -> bool:
    """Whether the module at `path` is in the vision tower (`model.vision`)."""
    return bool(path) and path[0] == "visual"


def targetable(model: nnx.Module) -> set[str]:
    """The names `peft.targets` can give for this model's weights."""
    names = set()
    for path, module in nnx.iter_modules(model):
        for name, var in vars(module).items():
            if _in_tower(path):
                if isinstance(var, nnx.Param) and name in VISION_TARGETS:
                    names.add(VISION + name)
                continue
            if isinstance(var, nnx.Param) and name in LORA_TARGETS:
                axes = var.get_metadata().get("axes", ())
                names.add("experts" if "expert" in axes else name)
                names.add(name)
    return names


def kernel(module: nnx.Module, name: str):
    """The weight `name` of `module` as `layers.matmul` takes it: its value (an array or an
    `NF4Tensor`), or a `LoRAKernel` when it has an adapter; with an fp8 amax history beside
    it (`model.fp8_scaling=delayed`), a `fp8_delayed.DelayedKernel` (as the adapter's base)."""
    base = fp8_delayed.wrap(module, name, getattr(module, name).get_value())
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return base
    rate = getattr(module, f"{name}_lora_dropout")
    return LoRAKernel(
        base,
        a[...],
        getattr(module, f"{name}_lora_b")[...],
        getattr(module, f"{name}_lora_scale"),
        rate,
        next_key() if rate else None,
        getattr(module, f"{name}_lora_masked", False),
        m[...] if (m := getattr(module, f"{name}_lora_magnitude", None)) is not None else None,
    )


def weight_norm(w: jax.Array, lead: int, n_in: int) -> jax.Array:
    """DoRA's ||W||: the float32 norm of each output of w [*lead, *in, *out] over its `n_in`
    input dims (PEFT's norm of each row of a torch [out, in] weight)."""
    w = w.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(w * w, axis=tuple(range(lead, lead + n_in))))


def dora_weight(w: jax.Array, m: jax.Array, lead: int, n_in: int) -> jax.Array:
    """DoRA's m * w / ||w|| for the adapted weight w = W + s A B [*lead, *in, *out] and the
    magnitude m [*lead, *out], in float32; the norm taken as a constant (PEFT detaches it:
    gradients flow through m and w only)."""
    g = m.astype(jnp.float32) / jax.lax.stop_gradient(weight_norm(w, lead, n_in))
    g = g.reshape(*g.shape[:lead], *(1,) * n_in, *g.shape[lead:])
    return w.astype(jnp.float32) * g


def fit_magnitudes(params: dict, frozen: dict) -> dict:
    """`params` with every DoRA magnitude set to the norms of its frozen base weight (the
    adapters' B being zero): what a fresh DoRA starts from on a loaded base."""

    def walk(p: dict, f: dict) -> dict:
        out = {}
        for k, v in p.items():
            if isinstance(v, dict):
                out[k] = walk(v, f.get(k, {}))
            elif k.endswith("_lora_magnitude"):
                name = k.removesuffix("_lora_magnitude")
                n_in = in_dims(name)
                lead = p[f"{name}_lora_a"].ndim - 1 - n_in
                out[k] = weight_norm(as_array(f[name], jnp.float32), lead, n_in).astype(v.dtype)
            else:
                out[k] = v
        return out

    return walk(params, frozen)


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
    base = as_array(k.base, dtype)
    n_in = in_dims(name)
    d = delta(k.a, k.b, k.scale, n_in, dtype)
    if k.magnitude is not None:  # DoRA
        return dora_weight(base + d, k.magnitude, k.a.ndim - 1 - n_in, n_in).astype(dtype)
    return base + (jnp.where(base != 0, d, 0).astype(dtype) if k.masked else d)


def as_array(w, dtype) -> jax.Array:
    """A stored weight in the compute `dtype`: cast, or dequantized from NF4 (each stacked
    layer's on its own), from integer codes (`quantized.QuantizedTensor`) or from the float and
    int8 kinds (`coded.CodedTensor`) of `jaxllm quantize`."""
    if isinstance(w, quantized.QuantizedTensor):
        return quantized.dequantize(w, dtype)
    if isinstance(w, coded.CodedTensor):
        return coded.decode(w, dtype)
    if isinstance(w, fp8_delayed.DelayedKernel):  # the weight; its history is the seam's
        return as_array(w.w, dtype)
    if isinstance(w, fake_quant.FakeQuantKernel):  # QAT: the weight (its input is the seam's)
        w = w.w
    if not isinstance(w, nf4.NF4Tensor):
        return w.astype(dtype)
    stacked = w.codes.ndim - nf4.kept_ndim(w.shape) - 1
    return _stacked(lambda q: nf4.dequantize(q, dtype), stacked)(w)


def merged_params(graphdef, params, frozen, model_state=None) -> dict:
    """The plain model's parameters (the structure of `build(cfg)` without peft) with every
    adapter merged into its weight, W + s A B, and NF4 / quantized weights dequantized (a
    QLoRA base, LoRA on a `jaxllm quantize` run), in the base's
    parameter dtype: what a merged export writes."""
    model = nnx.merge(graphdef, *(s for s in (params, frozen, model_state) if s))
    if nnx.state(model, AdapterParam):
        raise ConfigError(
            "bottleneck adapters (peft.method=adapter) are layers of their own, nonlinear: "
            "they merge into no weight."
        )
    for _, module in list(nnx.iter_modules(model)):
        for name, var in list(vars(module).items()):
            if not isinstance(var, nnx.Param) or isinstance(var, LoRAParam):
                continue
            value = var.get_value()
            dtype = value.dtype
            packed = isinstance(
                value, (nf4.NF4Tensor, quantized.QuantizedTensor, coded.CodedTensor)
            )
            if hasattr(module, f"{name}_lora_a") or packed:
                var.set_value(dense(module, name, jnp.float32).astype(dtype))
            for suffix in (*SUFFIXES, "_lora_scale", "_lora_dropout", "_lora_masked"):
                if hasattr(module, name + suffix):
                    delattr(module, name + suffix)
    if hasattr(model, "lora_dropout"):
        del model.lora_dropout
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


# QLoRA stores these base weights in NF4 (every linear layer's, as the paper; the embeddings,
# norms and LM head stay in param_dtype).
QUANTIZED = frozenset(LORA_TARGETS) - {"lm_head", "experts"}


def _layers(axes: tuple) -> int:
    """How many leading dims are stacked layers (each quantized on its own)."""
    n = 0
    while n < len(axes) and axes[n] == "layers":
        n += 1
    return n


def _quantized(name: str, axes: tuple, shape) -> bool:
    return name in QUANTIZED and len(shape) - _layers(axes) >= 2


def _stacked(fn, n: int):
    for _ in range(n):
        fn = jax.vmap(fn)
    return fn


def freeze(params: dict, axes: dict, peft: PeftConfig | None) -> dict:
    """The base parameters as the train state keeps them frozen under `peft`: as they are, or
    under QLoRA with every linear weight in NF4 (`nf4.NF4Tensor`, one per stacked layer)."""
    if peft is None or peft.method == "none":
        return params
    params = _only(params, axes)  # without what trains in full (peft.modules_to_save)
    if peft.method != "qlora":
        return params
    return _map_named(
        lambda name, x, ax: (
            _stacked(nf4.quantize, _layers(ax))(x) if _quantized(name, ax, x.shape) else x
        ),
        params,
        axes,
    )


def frozen_axes(abstract: dict, axes: dict, peft: PeftConfig | None) -> dict:
    """Logical axes of `freeze(abstract, axes, peft)`: an NF4 weight's codes keep the stacked
    dims and the leading dims `nf4_axes` keeps, its scales only the stacked dims."""
    if peft is None or peft.method != "qlora":
        return axes

    def one(name, x, ax):
        if not _quantized(name, ax, x.shape):
            return ax
        n = _layers(ax)
        codes = (*ax[:n], *nf4.nf4_axes(ax[n:], x.shape[n:]))
        q = jax.eval_shape(nf4.quantize, jax.ShapeDtypeStruct(x.shape[n:], x.dtype))
        return nf4.NF4Tensor(codes, codes, (*ax[:n], None), ax[:n], q.shape, q.dtype)

    return _map_named(one, abstract, axes)


def _only(params: dict, axes: dict) -> dict:
    """The entries of `params` that `axes` has."""
    return {
        k: _only(v, axes[k]) if isinstance(v, dict) else v for k, v in params.items() if k in axes
    }


def _map_named(fn, params: dict, axes: dict) -> dict:
    """{name: fn(name, leaf, its axes)} over a nested dict of parameters."""
    return {
        k: _map_named(fn, v, axes[k]) if isinstance(v, dict) else fn(k, v, tuple(axes[k]))
        for k, v in params.items()
    }


def trainable(peft: PeftConfig | None):
    """The nnx filter of what trains under `peft`: every parameter (none), the LoRA factors,
    the bottleneck adapters or the soft prompt (with LoRA, the `peft.modules_to_save` weights
    too); PPO's value head (`ValueParam`) trains beside
    any of them."""
    if peft is None or peft.method == "none":
        return nnx.Param
    if peft.method == "prompt":
        return nnx.Any(PromptParam, ValueParam)
    if peft.method == "adapter":
        return nnx.Any(AdapterParam, ValueParam)
    return nnx.Any(LoRAParam, ValueParam, SavedParam)


class SavedParam(nnx.Param):
    """A whole weight that trains beside the LoRA adapters (`peft.modules_to_save`)."""


class ValueParam(nnx.Param):
    """PPO's value head (`model.value_head`): new to the model, so it trains under peft too."""


class PromptParam(nnx.Param):
    """Soft-prompt embeddings: what trains under peft.method=prompt."""


class AdapterParam(nnx.Param):
    """A bottleneck adapter's weight or bias (`jaxllm.model.bottleneck`): what trains under
    peft.method=adapter."""


def peft_key(init_key: jax.Array) -> jax.Array:
    """The stream of a model's init key that its adapters or soft prompt draw from."""
    return jax.random.fold_in(init_key, 0x10AA)


def prompt_token_ids(key: jax.Array, n: int, vocab_size: int) -> jax.Array:
    """The vocabulary tokens whose embeddings a soft prompt of `n` virtual tokens starts from
    (Hugging Face PEFT's sampled-vocabulary initialisation)."""
    return jax.random.randint(key, (n,), 0, vocab_size)


def virtual_ids(n: int) -> list[int]:
    """The token ids that stand for a soft prompt's n virtual tokens in an input: -1 .. -n."""
    return [-(i + 1) for i in range(n)]
