"""Basic layers: the one matmul helper, RMSNorm / LayerNorm, token embedding. Positions
(RoPE, ALiBi) live in `positions.py`."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxllm.model import coded, fake_quant, fp8_blockwise, fp8_delayed, lora, tap
from jaxllm.model import fp8 as fp8_ops

WIDENING_DOT = "widening_dot"  # the name of `widening_einsum`'s output, for remat policies


def param(rngs: nnx.Rngs, init, shape: Sequence[int], axes: tuple[str, ...], dtype) -> nnx.Param:
    """A parameter tagged with its logical axis names (read by `jaxllm.sharding`)."""
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), axes=axes)


def matmul(
    spec: str,
    x: jax.Array,
    kernel: jax.Array,
    dtype,
    out_dtype=None,
    *,
    fp8: str | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """Every weight matmul of the model goes through here: `einsum(spec, x, kernel)` with both
    operands in the compute `dtype`, or with `fp8` (the scaling: `current`, `fp8.py`, or
    `blockwise`, `fp8_blockwise.py`; `delayed` with a `fp8_delayed.DelayedKernel`) in e4m3 with
    float32 accumulation. The output is in `out_dtype` (default `dtype`). The kernel may
    be an array, an `NF4Tensor`, a `quantized.QuantizedTensor` or a weight-only
    `coded.CodedTensor` (dequantized here, inside the jitted computation, where XLA fuses it
    into the dot), a `coded.CodedTensor` with quantized activations (an int8 or fp8 dot,
    `coded.matmul`), a `fake_quant.FakeQuantKernel` (QAT: the activations rounded first) or a
    `lora.LoRAKernel` (x W + s (x A) B, whose base may be any of them). `axis_name` (under
    `shard_map`): the mesh axis the contracted dims are split over, for a W8A8 kernel's
    per-token scales. A bfloat16 matmul with a float32 output (the LM head's logits) keeps
    its gradient matmuls in bfloat16 too (`widening_einsum`)."""
    out_dtype = out_dtype or dtype
    if (recorder := tap.active()) is not None:  # calibration (`tap`)
        recorder.see(spec, x, kernel)
    if isinstance(kernel, lora.LoRAKernel):
        y = matmul(spec, x, kernel.base, dtype, out_dtype, fp8=fp8, axis_name=axis_name)
        if kernel.magnitude is not None:
            return _dora(spec, x, kernel, y, dtype, out_dtype, fp8, axis_name)
        return y + _lora_path(spec, x, kernel, dtype).astype(out_dtype)
    history = None
    if isinstance(kernel, fp8_delayed.DelayedKernel):  # model.fp8_scaling=delayed
        kernel, history = kernel.w, kernel.history
    if isinstance(kernel, coded.CodedTensor) and kernel.act != "none":  # W8A8 kinds
        return coded.matmul(spec, x, kernel, dtype, out_dtype, axis_name)
    if isinstance(kernel, fake_quant.FakeQuantKernel):  # QAT of the activations
        x, kernel = fake_quant.activations(spec, x, kernel), kernel.w
    x, kernel = x.astype(dtype), lora.as_array(kernel, dtype)
    if fp8 == "blockwise":
        return fp8_blockwise.einsum(spec, x, kernel, dtype, out_dtype)
    if fp8 and history is not None:
        return fp8_delayed.einsum(spec, x, kernel, history, dtype, out_dtype)
    if fp8:  # current scaling (a delayed model's weights without a history too)
        return fp8_ops.einsum(spec, x, kernel, dtype, out_dtype)
    if jnp.dtype(dtype) == jnp.bfloat16 and jnp.dtype(out_dtype) == jnp.float32:
        if _transposable(spec):
            return widening_einsum(spec, x, kernel)
    return jnp.einsum(spec, x, kernel, preferred_element_type=out_dtype).astype(out_dtype)


def widening_einsum(spec: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """`einsum(spec, x, kernel)` of bfloat16 operands into float32, whose backward casts the
    float32 output cotangent to bfloat16 before its two matmuls (float32 accumulation). Plain
    autodiff would meet the float32 cotangent with the bfloat16 operands and run both gradient
    matmuls in float32: at the LM head, with its [*, V] operands, over a fifth of a 1B model's
    step on an H100/H200. bfloat16 has float32's exponent range, so the cast rounds the
    cotangent (as the output gradient of any bfloat16 matmul is rounded) and never flushes it.
    The output is named `WIDENING_DOT` (`jax.ad_checkpoint.checkpoint_name`): a remat policy
    that saves dots sees a custom_vjp, not a dot, and saves it by that name (remat `dots`)."""
    return checkpoint_name(_widening(spec, x, kernel), WIDENING_DOT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _widening(spec: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, kernel, preferred_element_type=jnp.float32)


def _transposable(spec: str) -> bool:
    """Whether each operand's letters are the other's and the output's (no ellipsis): the
    gradient matmuls are then einsums of the same letters."""
    ins, out = spec.split("->")
    xs, ks = ins.split(",")
    return "." not in spec and set(xs) <= set(out + ks) and set(ks) <= set(xs + out)


def _widening_fwd(spec, x, kernel):
    return _widening(spec, x, kernel), (x, kernel)


def _widening_bwd(spec, res, g):
    x, kernel = res
    ins, out = spec.split("->")
    xs, ks = ins.split(",")
    g = g.astype(x.dtype)
    dx = jnp.einsum(f"{out},{ks}->{xs}", g, kernel, preferred_element_type=jnp.float32)
    dk = jnp.einsum(f"{xs},{out}->{ks}", x, g, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dk.astype(kernel.dtype)


_widening.defvjp(_widening_fwd, _widening_bwd)

# remat `dots`: every dot's output, and `widening_einsum`'s by its name
dots_saveable = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable,
    jax.checkpoint_policies.save_only_these_names(WIDENING_DOT),
)


def _specs(spec: str) -> tuple[str, str, str, str, str, str, str]:
    """(x's, the kernel's, the output's, A's, x A's, B's, the kept (non-contracted) kernel
    dims') einsum letters for `matmul`'s spec."""
    ins, rest = spec.split("->")
    xs, ks = ins.split(",")
    r = next(c for c in "rzyxwvu" if c not in spec)
    contracted = [c for c in ks if c in xs and c not in rest]
    outs = [c for c in ks if c not in xs]
    lead = [c for c in ks if c in xs and c in rest]
    a_spec = ks[: len(ks) - len(outs)] + r
    h_spec = "".join(c for c in xs if c not in contracted) + r
    b_spec = "".join(lead) + r + "".join(outs)
    return xs, ks, rest, a_spec, h_spec, b_spec, "".join(c for c in ks if c not in contracted)


def _dropped(x: jax.Array, k: lora.LoRAKernel, dtype) -> jax.Array:
    """The adapters' input: x with the kernel's dropout (training only)."""
    x = x.astype(dtype)
    if k.dropout and k.key is not None:
        keep = jax.random.bernoulli(k.key, 1.0 - k.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - k.dropout), 0).astype(dtype)
    return x


def _dora(spec, x, k: lora.LoRAKernel, y, dtype, out_dtype, fp8, axis_name) -> jax.Array:
    """DoRA as PEFT computes it: y + (g - 1) (x' W) + g s (x' A) B with x' = dropout(x) and
    g = m / ||W + s A B|| per output (the norm a constant), i.e. x (g (W + s A B)) without
    dropout. The norm sums over the contracted dims, across `axis_name` when they are split."""
    _, ks, rest, a_spec, _, b_spec, g_spec = _specs(spec)
    a, b = k.a.astype(jnp.float32), k.b.astype(jnp.float32)
    w = lora.as_array(k.base, jnp.float32) + jnp.einsum(f"{a_spec},{b_spec}->{ks}", a, b) * k.scale
    squares = jnp.einsum(f"{ks},{ks}->{g_spec}", w, w)
    if axis_name is not None:
        squares = jax.lax.psum(squares, axis_name)
    g = k.magnitude.astype(jnp.float32) / jax.lax.stop_gradient(jnp.sqrt(squares))
    xd, yd = _dropped(x, k, dtype), y
    if k.dropout and k.key is not None:  # PEFT's base_result is then x' W
        base = fp8_delayed.no_record(k.base)  # the amaxes are the first product's
        yd = matmul(spec, xd, base, dtype, out_dtype, fp8=fp8, axis_name=axis_name)
    up = _lora_path(spec, xd, k._replace(dropout=0.0, key=None), dtype).astype(jnp.float32)
    scaled = jnp.einsum(f"{rest},{g_spec}->{rest}", yd.astype(jnp.float32) + up, g)
    return (y.astype(jnp.float32) - yd.astype(jnp.float32) + scaled).astype(out_dtype)


def _lora_path(spec: str, x: jax.Array, k: lora.LoRAKernel, dtype) -> jax.Array:
    """s (dropout(x) A) B for `matmul`'s spec: A takes the kernel's leading and contracted
    dims plus the rank, B the leading dims, the rank and the kernel's output dims; with
    `k.masked`, s dropout(x) ((A B) * [W != 0])."""
    xs, ks, rest, a_spec, h_spec, b_spec, _ = _specs(spec)
    x = _dropped(x, k, dtype)
    if k.masked:  # peft.keep_zeros: the update (A B) * [W != 0] as a dense weight
        d = jnp.einsum(f"{a_spec},{b_spec}->{ks}", k.a.astype(dtype), k.b.astype(dtype))
        d = jnp.where(lora.as_array(k.base, dtype) != 0, d, 0)
        return jnp.einsum(spec, x, d) * jnp.asarray(k.scale, dtype)
    h = jnp.einsum(f"{xs},{a_spec}->{h_spec}", x, k.a.astype(dtype))
    y = jnp.einsum(f"{h_spec},{b_spec}->{rest}", h, k.b.astype(dtype))
    return y * jnp.asarray(k.scale, dtype)


def ragged_matmul(
    x_AxD: jax.Array,
    kernel_ExDxF: jax.Array,
    sizes_E: jax.Array,
    dtype,
    *,
    fp8: str | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """The grouped matmul of dropless MoE experts (`jax.lax.ragged_dot`: the first sizes_E[0]
    rows times kernel 0, and so on), in `dtype` or fp8 as `matmul`; of a W8A8 expert stack
    (`coded.w8a8`) with each row quantized, an int8 or fp8 ragged dot (`coded.ragged_matmul`;
    `axis_name` as `matmul`'s)."""
    if coded.w8a8(kernel_ExDxF):
        return coded.ragged_matmul(x_AxD, kernel_ExDxF, sizes_E, dtype, axis_name)
    x_AxD, kernel_ExDxF = x_AxD.astype(dtype), kernel_ExDxF.astype(dtype)
    if fp8 == "blockwise":  # refused by the config too
        raise ValueError("blockwise fp8 scaling has no grouped (dropless) matmul")
    if fp8:
        return fp8_ops.ragged_dot(x_AxD, kernel_ExDxF, sizes_E, dtype)
    return jax.lax.ragged_dot(x_AxD, kernel_ExDxF, sizes_E, preferred_element_type=dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019); statistics in float32. The output is
    multiplied by (offset + scale): Gemma checkpoints store scale - 1 and use offset 1."""

    def __init__(
        self,
        dim: int,
        *,
        eps: float,
        dtype,
        param_dtype,
        offset: float = 0.0,
        axes: tuple[str, ...] = ("norm",),
    ):
        self.eps, self.dtype, self.offset = eps, dtype, offset
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, param_dtype), axes=axes)

    def _scale(self, name: str, ndim: int) -> jax.Array:
        x = getattr(self, name)[...].astype(jnp.float32)
        return x.reshape((1,) * (ndim - 1) + (-1,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (self.offset + self._scale("scale", x.ndim))).astype(self.dtype)


class LayerNorm(RMSNorm):
    """LayerNorm (Ba et al. 2016): mean and variance over the last axis in float32, then scale
    and bias."""

    def __init__(
        self,
        dim: int,
        *,
        eps: float,
        dtype,
        param_dtype,
        offset: float = 0.0,
        axes: tuple[str, ...] = ("norm",),
    ):
        super().__init__(
            dim, eps=eps, dtype=dtype, param_dtype=param_dtype, offset=offset, axes=axes
        )
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), axes=axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        x32 = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        x32 = x32 * (self.offset + self._scale("scale", x.ndim)) + self._scale("bias", x.ndim)
        return x32.astype(self.dtype)


def make_norm(cfg, dim: int | None = None, axes: tuple[str, ...] = ("norm",)) -> RMSNorm:
    """The norm `cfg.norm` over `dim` (default d_model) channels."""
    cls = LayerNorm if cfg.norm == "layernorm" else RMSNorm
    return cls(
        cfg.d_model if dim is None else dim,
        eps=cfg.norm_eps,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        offset=cfg.norm_offset,
        axes=axes,
    )


class Embed(nnx.Module):
    """Token embeddings: int ids [B, L] -> [B, L, D] in `dtype`; `attend` is the tied LM head."""

    def __init__(self, vocab: int, dim: int, *, init_std: float, dtype, param_dtype, rngs):
        self.dtype = dtype
        init = jax.nn.initializers.normal(init_std)
        self.embedding = param(rngs, init, (vocab, dim), ("vocab", "embed"), param_dtype)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        tokens_BxL = jnp.asarray(tokens_BxL)
        if tokens_BxL.ndim != 2 or not jnp.issubdtype(tokens_BxL.dtype, jnp.integer):
            raise TypeError(
                "token ids must be an integer array [batch, length], not "
                f"{tokens_BxL.dtype} {tuple(tokens_BxL.shape)}"
            )
        return jnp.take(self.embedding[...], tokens_BxL, axis=0).astype(self.dtype)

    def attend(self, x_BxLxD: jax.Array) -> jax.Array:
        """Tied LM head: logits in float32."""
        return matmul("bld,vd->blv", x_BxLxD, self.embedding[...], self.dtype, jnp.float32)


def default_positions(cfg, b: int, l: int) -> jax.Array:
    """Positions 0 .. l-1 of each of b rows; a ValueError when learned positions
    (`cfg.position == "learned"`) have no row for the last of them."""
    rows = cfg.max_seq_len - cfg.encoder.position_offset
    if cfg.position == "learned" and l > rows:
        raise ValueError(
            f"{l} tokens exceed the {rows} learned positions of this model "
            f"(model.max_seq_len {cfg.max_seq_len}); pass at most {rows}."
        )
    return jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))


def logical_axes(state) -> dict:
    """A model's (abstract) `nnx.State` -> nested dict of logical-axes tuples, like its params."""
    return {
        k: tuple(v.get_metadata()["axes"]) if isinstance(v, nnx.Variable) else logical_axes(v)
        for k, v in state.items()
    }
