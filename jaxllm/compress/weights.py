"""Which weights a quantization method takes, their quantized shapes, and quantizing a model's
parameters layer by layer onto its mesh.

A method is a function `(w [*lead, *in, *out], cfg, *, n_in, n_out) -> QuantizedTensor` in
`METHODS`. The parameters it receives are the matmul weights `quantize.*` chooses
(`chosen`): every projection of attention, MLP, experts and MLA; the untied LM head with
`quantize.head`; none that `quantize.skip` names. Embeddings, norms, biases, the MoE router and
score / value heads are not matmul kernels of the seam, or not ones whose error stays local,
and stay in their dtype (docs/compression.md).
"""

from __future__ import annotations

import fnmatch
import math
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from tqdm import tqdm

from jaxllm import sharding
from jaxllm.compress.rtn import rtn
from jaxllm.config import ConfigError, QuantizeConfig
from jaxllm.config.quantize import INTEGER_CODES, QUANTIZABLE
from jaxllm.model import coded, quantized


def _coded(kind: str, act):
    def method(w, cfg: QuantizeConfig, *, n_in: int, n_out: int) -> coded.CodedTensor:
        how = dict(kind=kind, act=act(cfg), threshold=cfg.llm_int8.threshold)
        return coded.encode(w, **how, n_in=n_in, n_out=n_out)

    return method


# The methods that quantize each weight on its own (the calibrated ones are in
# `calibrate.UNIT_METHODS`); `encoder` has every method's per-weight format.
METHODS: dict[str, Callable] = {
    "rtn": rtn,
    "fp8": _coded("fp8", lambda cfg: "fp8" if cfg.fp8_activations else "none"),
    "mxfp4": _coded("mxfp4", lambda cfg: "none"),
    "llm_int8": _coded("int8", lambda cfg: "llm_int8"),
}
_SMOOTHQUANT = _coded("int8", lambda cfg: "int8")


def encoder(cfg: QuantizeConfig) -> Callable:
    """The function that stores a weight as `cfg.method` does (what a calibrated method ends
    with: RTN's codes for gptq / awq, W8A8 int8 for smoothquant)."""
    if cfg.method in INTEGER_CODES:
        return rtn
    return _SMOOTHQUANT if cfg.method == "smoothquant" else METHODS[cfg.method]


def is_quantized(x) -> bool:
    return isinstance(x, (quantized.QuantizedTensor, coded.CodedTensor))


LEAD_AXES = ("layers", "expert")  # dims each quantized on its own, kept whole


def path_of(keys) -> str:
    """A parameter's "/"-joined path (`layers/attn/q_proj`) from a jax tree key path."""
    return "/".join(str(getattr(k, "key", k)) for k in keys)


def dims(path: str, axes: tuple, cfg: QuantizeConfig) -> tuple[int, int] | None:
    """(contracted dims, output dims) of the weight at `path` with logical `axes` when `cfg`
    quantizes it, else None."""
    name = path.rsplit("/", 1)[-1]
    if not cfg.enabled or name not in (*QUANTIZABLE, *(("lm_head",) if cfg.head else ())):
        return None
    if any(fnmatch.fnmatchcase(path, p) for p in cfg.skip):
        return None
    lead = 0
    while lead < len(axes) and axes[lead] in LEAD_AXES:
        lead += 1
    n_in = 2 if name == "o_proj" else 1  # the output projection contracts (heads, head_dim)
    n_out = len(axes) - lead - n_in
    return (n_in, n_out) if n_out >= 1 else None


def chosen(tree, axes, cfg) -> dict:
    """{path: (leaf, n_in, n_out)} of the weights of `tree` (arrays or abstract ones, logical
    `axes`) that `cfg` (a `quantize`, `prune` or QAT section: its enabled, head and skip)
    takes, in tree order."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    out = {}
    for (keys, leaf), ax in zip(flat, flat_axes):
        d = dims(path_of(keys), tuple(ax), cfg)
        if d is not None:
            out[path_of(keys)] = (leaf, *d)
    return out


def _check(path: str, shape: tuple, n_in: int, n_out: int, cfg: QuantizeConfig) -> None:
    """ConfigError when `cfg`'s groups or packing do not fit the weight at `path`."""
    lead = len(shape) - n_in - n_out
    k = math.prod(shape[lead : lead + n_in])  # input channels: the groups run over them
    if cfg.method == "mxfp4" and (k % 32 or shape[lead + n_in - 1] % 2):
        raise ConfigError(
            f"mxfp4 scales blocks of 32 input channels, packed two a byte along the last; "
            f"{path} has {k} (last dim {shape[lead + n_in - 1]}); leave it out with "
            "quantize.skip."
        )
    if cfg.method not in INTEGER_CODES:
        return
    g = cfg.group_size
    if g and k % g:
        raise ConfigError(
            f"--group-size {g} does not divide the {k} input channels of {path}; choose a "
            f"divisor of {k} (or 0, per channel), or leave it out with quantize.skip."
        )
    last, per_byte = shape[lead + n_in - 1], quantized.chunk(cfg.bits)[0]
    if last % per_byte:
        raise ConfigError(
            f"--bits {cfg.bits} packs {per_byte} codes at a time along the input channels, "
            f"and {path}'s last input dim ({last}) is not a multiple of {per_byte}; choose "
            "other bits, or leave it out with quantize.skip."
        )


def not_trained(cfg: QuantizeConfig, what: str) -> None:
    """ConfigError when `what` (a run's weights, to train or start from) is quantized."""
    if cfg.enabled:
        raise ConfigError(
            f"{what} holds quantized weights (quantize.method={cfg.method}, jaxllm quantize), "
            "which do not train; train the run it was quantized from."
        )


def quantized_abstract(abstract: dict, axes: dict, cfg: QuantizeConfig | None):
    """(abstract params, logical axes) of the model's parameters once `cfg` quantized them:
    chosen weights become `QuantizedTensor`s of ShapeDtypeStructs (with their axes as the
    same structure); ConfigError when a group size or packing does not fit a weight. Both
    unchanged without a method."""
    if cfg is None or not cfg.enabled:
        return abstract, axes
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    out, out_axes = {}, {}
    for (keys, leaf), ax in zip(flat, flat_axes):
        path, ax = path_of(keys), tuple(ax)
        d = dims(path, ax, cfg)
        if d is not None:
            _check(path, leaf.shape, *d, cfg)
            fn = encoder(cfg)
            leaf = jax.eval_shape(lambda w, d=d: fn(w, cfg, n_in=d[0], n_out=d[1]), leaf)
            if isinstance(leaf, quantized.QuantizedTensor):
                ax = quantized.quantized_axes(leaf, ax)
            else:
                ax = coded.axes(leaf, ax)
        _put(out, keys, leaf)
        _put(out_axes, keys, ax)
    return out, out_axes


def _put(tree: dict, keys, value) -> None:
    for k in keys[:-1]:
        tree = tree.setdefault(k.key, {})
    tree[keys[-1].key] = value


def quantize_params(params: dict, axes: dict, cfg: QuantizeConfig, mesh: Mesh) -> dict:
    """`params` (arrays on `mesh`, logical `axes`) with the weights `cfg` chooses quantized by
    its method, in their shards on `mesh`. Stacked layers go one layer index at a time (a
    progress bar on stderr), each slice quantized where it lies."""
    method = METHODS[cfg.method]
    q_abstract, q_axes = quantized_abstract(params, axes, cfg)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    jobs = {}  # path -> (keys, weight, n_in, n_out, stacked)
    for (keys, w), ax in zip(flat, flat_axes):
        d = dims(path_of(keys), tuple(ax), cfg)
        if d is not None:
            jobs[path_of(keys)] = (keys, w, *d, bool(ax) and ax[0] == "layers")
    depth = max((j[1].shape[0] for j in jobs.values() if j[4]), default=0)
    shard = sharding.tree_shardings(mesh, q_axes)
    slices = {p: [] for p, j in jobs.items() if j[4]}

    def one(w, layer, n_in, n_out):
        return method(w[layer], cfg, n_in=n_in, n_out=n_out)

    jitted = jax.jit(one, static_argnums=(2, 3))

    steps = depth + any(not j[4] for j in jobs.values())
    with tqdm(total=steps, unit="layer", desc="quantize", file=sys.stderr, disable=None) as bar:
        for layer in range(depth):
            for path, (_, w, n_in, n_out, stacked) in jobs.items():
                if stacked and layer < w.shape[0]:
                    slices[path].append(jitted(w, layer, n_in, n_out))
            bar.update(1)
        out = jax.tree.map(lambda x: x, params)
        for path, (keys, w, n_in, n_out, stacked) in jobs.items():
            target = _get(shard, keys)
            if stacked:
                value = jax.jit(_stack, out_shardings=target)(slices.pop(path))
            else:
                value = jax.jit(
                    lambda w, n_in=n_in, n_out=n_out: method(w, cfg, n_in=n_in, n_out=n_out),
                    out_shardings=target,
                )(w)
            _put(out, keys, value)
        if steps > depth:
            bar.update(1)
    assert jax.tree.structure(out) == jax.tree.structure(q_abstract)
    return out


def _stack(slices):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *slices)


def _get(tree, keys):
    for k in keys:
        tree = tree[k.key]
    return tree


def weight_bytes(abstract: dict, axes: dict, cfg: QuantizeConfig, mesh: Mesh) -> dict:
    """What the weights of a model quantized by `cfg` take: {"how": the method in words,
    "quantized": parameters stored as codes, "quantized_bytes": their codes, scales and zero
    points, "total": all parameters' bytes, "per_device": those on one device of `mesh`}."""
    q_abstract, q_axes = quantized_abstract(abstract, axes, cfg)
    is_q = is_quantized
    groups = f"groups of {cfg.group_size}" if cfg.group_size else "per channel"
    how = f"{cfg.method} {cfg.bits}-bit {groups}" + ("" if cfg.symmetric else " asymmetric")
    if cfg.method not in INTEGER_CODES:
        how = {
            "fp8": "fp8 e4m3 per channel" + (", fp8 activations" if cfg.fp8_activations else ""),
            "mxfp4": "mxfp4 e2m1, e8m0 scales per 32",
            "llm_int8": f"llm_int8 int8 per channel, outliers > {cfg.llm_int8.threshold:g}",
            "smoothquant": f"smoothquant w8a8 int8 (alpha {cfg.smoothquant.alpha:g})",
        }[cfg.method]
    out = {"how": how, "quantized": 0, "quantized_bytes": 0, "total": 0, "per_device": 0}
    for leaf, sh in zip(
        jax.tree.leaves(q_abstract, is_leaf=is_q),
        jax.tree.leaves(sharding.tree_shardings(mesh, q_axes), is_leaf=is_q),
    ):
        parts, shs = jax.tree.leaves(leaf), jax.tree.leaves(sh)
        nbytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in parts)
        out["total"] += nbytes
        out["per_device"] += sum(
            math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in zip(parts, shs)
        )
        if is_q(leaf):
            out["quantized"] += math.prod(leaf.shape)
            out["quantized_bytes"] += nbytes
    return out
