"""AWQ (Lin et al. 2023, arXiv:2306.00978): activation-aware weight quantization. The input
channels that carry large activations matter most; scaling them up before rounding (and the
activations down by the same factor) shrinks their relative rounding error.

For each set of weights that read the same input (a block's q/k/v projections, its MLP's gate
and up projections, and its down projection, which reads the up projection's output in a gated
MLP), per input channel k:

    s_k = mean|x_k|^alpha, normalised by sqrt(max(s) min(s)),   W' = Q(diag(s) W) ... / s

with alpha searched over `quantize.awq.grid` points of [0, 1), keeping the one whose output
error over the calibration rows is least; s = 1 (round-to-nearest) is a candidate too, so
AWQ never does worse than RTN on that error. As in the paper, a norm's readers are judged by the output of the module they
feed (the attention, or the MLP / MoE layer) run on the norm's recorded output with the set's
weights as diag(s)^-1 Q(diag(s) W); the other sets' readers are their own module, whose error
is tr(dW^T X^T X dW) from the Gram matrices calibration records. With duo scaling (AutoAWQ's
and llm-compressor's default) s_k is divided by mean|w_k|^(1 - alpha), |w| taken relative to
the largest of its quantization group and averaged over all the set's outputs; s is floored
at 1e-4.

The 1/s is folded into what produces the input, so the model computes the same function in
float: the preceding norm's scale (and bias), whose other readers are compensated (the MoE
router's rows times s); the up projection's output columns for the down projection; the value
projection's output for the output projection when every query head has its own value head
(MHA). A set whose input comes from elsewhere (post-norm blocks, a non-gated MLP's down
projection, GQA's output projection) keeps s = 1.

Then, as AutoAWQ's `apply_clip` (`quantize.awq.clip`), each chosen weight but the query and key
projections is clipped per (group, output) to the fraction of its largest |w| (1, 0.95, ...,
0.55) whose output error over the group's inputs, tr(dW^T H dW), is least, and takes RTN codes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.compress.rtn import rtn
from jaxllm.config import Config
from jaxllm.model import quantized
from jaxllm.model.outputs import MoEOutput

ATTN_INPUTS = ("q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj")


def _get(tree, path):
    for part in path.split("/"):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _set(tree, path, value):
    *parents, name = path.split("/")
    for part in parents:
        tree = tree[part]
    tree[name] = value


def sets(params: dict, cfg: Config) -> list[tuple[str, list[str], str]]:
    """(producer, readers, kind) of each set of weights sharing an input whose scales fold
    into its producer: kind "norm" (a norm's scale), "columns" (a weight's output columns)."""
    out = []
    pre = cfg.model.norm_placement != "post"
    for norm, module, names in (
        ("attn_norm", "attn", ATTN_INPUTS),
        ("mlp_norm", "mlp", ("gate_proj", "up_proj", "shared/gate_proj", "shared/up_proj")),
    ):
        readers = [f"{module}/{n}" for n in names if _get(params, f"{module}/{n}") is not None]
        if pre and readers and _get(params, norm) is not None:
            out.append((norm, readers, "norm"))
    for mlp in ("mlp", "mlp/shared"):
        if _get(params, f"{mlp}/gate_proj") is not None:
            out.append((f"{mlp}/up_proj", [f"{mlp}/down_proj"], "columns"))
    v, o = _get(params, "attn/v_proj"), _get(params, "attn/o_proj")
    if v is not None and o is not None and v.shape[-2:] == o.shape[-3:-1]:
        out.append(("attn/v_proj", ["attn/o_proj"], "columns"))
    if pre and _get(params, "lm_head") is not None and _get(params, "final_norm") is not None:
        out.append(("final_norm", ["lm_head"], "norm"))
    return out


# The norms whose readers' error is measured after the whole module they feed (the paper's
# "module2inspect"); the other sets' readers are that module themselves.
MODULES = {"attn_norm": "attn", "mlp_norm": "mlp"}


def kept(params: dict, chosen: dict, cfg: Config) -> frozenset:
    """The weights whose inputs calibration keeps whole: one reader of each norm in
    `MODULES`, whose input is the module's."""
    out = set()
    for producer, readers, _ in sets(params, cfg):
        measured = [r for r in readers if r in chosen]
        if producer in MODULES and measured:
            out.add(measured[0])
    return frozenset(out)


def awq_unit(params: dict, chosen: dict, stats: dict, cfg: Config, prefix: str, ctx=None) -> dict:
    """A block's (or the model's head's) parameters with AWQ's scales folded in and its
    chosen weights quantized (module docstring). `ctx` (`calibrate.Context`): the block's
    graphdef, state, per-layer inputs, batches and kept inputs, for the module losses."""
    q = cfg.quantize
    out = jax.tree.map(lambda x: x, params)
    scales = {}  # reader: the s its rows were scaled by
    for producer, readers, kind in sets(params, cfg):
        measured = [r for r in readers if r in chosen]
        if not measured:
            continue
        ws = tuple(_flat(_get(out, r), *chosen[r]) for r in measured)
        hs = tuple(stats[r]["gram"] for r in measured)
        shared = kind == "norm"  # one s for all readers (and all their experts)
        abs_sum = sum(_lead_sum(stats[r]["abs_sum"], shared) for r in measured)
        count = sum(_lead_sum(stats[r]["count"], shared, counts=True) for r in measured)
        candidates = _candidates(ws, abs_sum, count, q, shared)
        if ctx is not None and producer in MODULES and measured[0] in ctx.raw:
            members = tuple((r, *_in_dims(params, r), chosen[r][1]) for r in measured)
            losses = _module_losses(
                out, members, candidates, MODULES[producer], q, ctx, measured[0]
            )
        else:
            losses = _gram_losses(ws, hs, candidates, q)
        s = candidates[jnp.argmin(jnp.asarray(losses))]
        for r in readers:
            _set(out, r, _scale_rows(_get(out, r), s, *_in_dims(params, r)))
        _fold(out, producer, kind, s, cfg)
        scales.update({r: s for r in measured})
    for path, (n_in, n_out) in chosen.items():
        w = _get(out, path)
        if q.awq.clip and path.rsplit("/", 1)[-1] not in NO_CLIP:
            c = _clip(_flat(w, n_in, n_out), stats[path]["gram"], scales.get(path), q)
            w = c.reshape(w.shape).astype(w.dtype)
        _set(out, path, _rtn(w, q, n_in, n_out))
    return out


# AutoAWQ leaves the query and key projections unclipped: their error is seen through q k^T
NO_CLIP = ("q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj")
CLIP_RATIOS = 1.0 - np.arange(10) / 20  # the paper's code: 20 points, shrinking by at most half


@functools.partial(jax.jit, static_argnames=("q",))
def _clip(w, h, s, q):
    """AWQ's clip search: w [*lead, K, N] clipped to +-r max|w| per (group, output), r of
    `CLIP_RATIOS` with the least output error tr(dw^T H dw) over the group's own inputs; with
    the scales s folded in (w's rows are already times s), the inputs' Gram is
    diag(1/s) H diag(1/s)."""
    k, n = w.shape[-2:]
    gs = q.group_size or k
    if s is not None:  # [*lead, K], or [K] shared by the experts
        inv = (1.0 / s).reshape((1,) * (h.ndim - 1 - s.ndim) + s.shape)
        h = h * inv[..., :, None] * inv[..., None, :]
    lead = w.shape[:-2]
    wg = w.astype(jnp.float32).reshape(*lead, k // gs, gs, n)
    hb = jnp.einsum("...gigj->...gij", h.reshape(*h.shape[:-2], k // gs, gs, k // gs, gs))
    amax = jnp.max(jnp.abs(wg), axis=-2, keepdims=True)

    def error(r):
        c = jnp.clip(wg, -r * amax, r * amax).reshape(w.shape)
        d = wg - _fake(c, jnp.ones((k,), jnp.float32), q).reshape(wg.shape)
        return jnp.einsum("...gin,...gij,...gjn->...gn", d, hb, d)

    ratios = jnp.asarray(CLIP_RATIOS, jnp.float32)
    best = ratios[jnp.argmin(jax.lax.map(error, ratios), axis=0)]  # [*lead, G, N]
    m = amax * best[..., None, :]
    return jnp.clip(wg, -m, m).reshape(w.shape)


@functools.partial(jax.jit, static_argnames=("q", "n_in", "n_out"))
def _rtn(w, q, n_in, n_out):
    return rtn(w, q, n_in=n_in, n_out=n_out)


def _flat(w, n_in: int, n_out: int):
    """w [*lead, *in, *out] -> [*lead, K, N]."""
    lead = w.ndim - n_in - n_out
    return w.reshape(*w.shape[:lead], math.prod(w.shape[lead : lead + n_in]), -1)


def _lead_sum(x, shared: bool, counts: bool = False):
    """Statistics [*lead, K] (counts [*lead]) summed over the experts when the set shares
    one s."""
    if not shared:
        return x
    return x.sum() if counts else x.reshape(-1, x.shape[-1]).sum(0)


def _module_losses(params, members, candidates, module: str, q, ctx, kept_name: str):
    """For each candidate s, the squared error over the calibration rows of the module's
    output (attention or MLP, on its recorded input) with the set's weights as Q(diag(s) W) /
    s, against the float module: [grid]."""
    losses = np.zeros(len(candidates))
    for (_, pos, seg, mask), raw in zip(ctx.batches, ctx.raw[kept_name]):
        xn = raw.T.reshape(*pos.shape, raw.shape[0])
        ref = _module_out(ctx.gdef, params, ctx.state, module, xn, pos, seg, ctx.inputs)
        # one program per batch, every candidate in it; waited for before the next (on a CPU
        # "mesh", programs with collectives left in flight together can starve each other)
        losses += np.asarray(
            _module_errors(
                ctx.gdef,
                params,
                ctx.state,
                candidates,
                members,
                q,
                module,
                xn,
                pos,
                seg,
                mask,
                ctx.inputs,
                ref,
            )
        )
    return losses


def _call(gdef, params, state, module, xn, pos, seg, inputs):
    block = nnx.merge(gdef, params, state) if state else nnx.merge(gdef, params)
    if module == "attn":
        return block.attn(xn, pos, seg, None, inputs.get("windowed")).out
    y = block.mlp(xn)
    return y.out if isinstance(y, MoEOutput) else y


_module_out = jax.jit(_call, static_argnums=(0, 3))


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def _module_errors(
    gdef, params, state, candidates, members, q, module, xn, pos, seg, mask, inputs, ref
):
    """The module's squared output error for each candidate s: [candidates]."""

    def error(s):
        p = jax.tree.map(lambda x: x, params)
        for path, lead, n_in, n_out in members:
            w = _get(p, path)
            _set(p, path, _fake(w, s, q, n_in, n_out, lead).astype(w.dtype))
        d = (_call(gdef, p, state, module, xn, pos, seg, inputs) - ref).astype(jnp.float32)
        return jnp.sum(jnp.square(d) * mask[..., None])

    return jax.lax.map(error, candidates)


@functools.partial(jax.jit, static_argnames=("q", "shared"))
def _candidates(ws, abs_sum, count, q, shared):
    """The scales [1 + grid, *lead, K]: s = 1, then those of each alpha of the grid."""
    mean = abs_sum / jnp.maximum(count, 1.0)[..., None] if not shared else abs_sum / count
    mean = jnp.where(mean > 0, mean, 0.0)
    w_mean = _weight_magnitude(ws, shared, q.group_size) if q.awq.duo_scaling else None

    def scales(alpha):
        s = mean**alpha
        if w_mean is not None:
            s = s / (w_mean ** (1 - alpha) + 1e-4)
        s = jnp.maximum(s, 1e-4)  # floored after the division, as AutoAWQ and llm-compressor
        return s / jnp.sqrt(jnp.max(s, -1, keepdims=True) * jnp.min(s, -1, keepdims=True))

    grid = jax.vmap(scales)(jnp.arange(q.awq.grid, dtype=jnp.float32) / q.awq.grid)
    # s = 1 (round-to-nearest) too: with duo scaling alpha = 0 is not the identity, and AWQ
    # should never do worse than RTN on the error it judges
    return jnp.concatenate([jnp.ones_like(grid[:1]), grid])


def _fake(w, s, q, n_in: int = 1, n_out: int = 1, lead: int | None = None):
    """Q(diag(s) W) / s in float32: w [*lead, *in, *out] as quantized with its rows scaled."""
    lead = w.ndim - n_in - n_out if lead is None else lead
    t = quantized.quantize(
        _scale_rows(w, s, lead, n_in),
        bits=q.bits,
        group=q.group_size,
        symmetric=q.symmetric,
        n_in=n_in,
        n_out=n_out,
    )
    return _scale_rows(quantized.dequantize(t, jnp.float32), 1.0 / s, lead, n_in)


@functools.partial(jax.jit, static_argnames=("q",))
def _gram_losses(ws, hs, candidates, q):
    """sum over the set of tr(dW^T H dW) for each candidate s: [grid]."""

    def loss(s):
        total = 0.0
        for w, h in zip(ws, hs):
            dw = w.astype(jnp.float32) - _fake(w, s, q)
            total = total + jnp.sum(dw * jnp.einsum("...kj,...jn->...kn", h, dw))
        return total

    return jax.lax.map(loss, candidates)


def _search(ws, hs, abs_sum, count, q, shared):
    """The scales s [*lead, K] of least output error of the set's own outputs."""
    candidates = _candidates(ws, abs_sum, count, q, shared)
    return candidates[jnp.argmin(_gram_losses(ws, hs, candidates, q))]


def _weight_magnitude(ws, shared: bool, group: int):
    """Per input channel, the mean over all the set's outputs (its readers' concatenated, and
    the experts' with `shared`) of |W| relative to the largest |W| of its quantization group
    (of its whole output with `group` 0), as AutoAWQ's and llm-compressor's duo scaling:
    [*lead, K], or [K] shared."""
    total, count = 0.0, 0
    for w in ws:
        k, n = w.shape[-2:]
        g = group or k
        a = jnp.abs(w.astype(jnp.float32)).reshape(*w.shape[:-2], k // g, g, n)
        a = (a / (jnp.max(a, axis=-2, keepdims=True) + 1e-6)).reshape(w.shape)
        if shared:
            a = a.reshape(-1, k, n)
            total, count = total + a.sum((0, 2)), count + a.shape[0] * n
        else:
            total, count = total + a.sum(-1), count + n
    return total / count


def _in_dims(params: dict, path: str) -> tuple[int, int]:
    """(lead dims, contracted dims) of the weight at `path` of a block: routed experts have
    an expert dim; the output projection contracts (heads, head_dim)."""
    experts = _get(params, "mlp/router") is not None and path.count("/") == 1
    return int(experts and path.startswith("mlp/")), 2 if path.endswith("o_proj") else 1


def _scale_rows(w, s, lead: int, n_in: int):
    """w [*lead, *in, *out] with its flattened input channels times s ([*lead, K], or [K]
    shared by all the lead dims)."""
    n_out = w.ndim - lead - n_in
    s_in = s.reshape(*s.shape[:-1], *w.shape[lead : lead + n_in])
    s_in = s_in.reshape(*(1,) * (lead - (s.ndim - 1)), *s_in.shape, *(1,) * n_out)
    return (w.astype(jnp.float32) * s_in).astype(w.dtype)


def _fold(params: dict, producer: str, kind: str, s, cfg: Config) -> None:
    """Divides what produces the input by s: a norm's (offset + scale) and bias, or a weight's
    output columns (and its bias); the MoE router, which reads the same norm, takes s on its
    rows."""
    inv = 1.0 / s
    if kind == "norm":
        norm = _get(params, producer)
        off = cfg.model.norm_offset
        norm["scale"] = ((off + norm["scale"].astype(jnp.float32)) * inv - off).astype(
            norm["scale"].dtype
        )
        if "bias" in norm:
            norm["bias"] = (norm["bias"].astype(jnp.float32) * inv).astype(norm["bias"].dtype)
        router = _get(params, producer.replace("_norm", "") + "/router")
        if router is not None:
            _set(params, producer.replace("_norm", "") + "/router", _scale_rows(router, s, 0, 1))
        return
    w = _get(params, producer)  # [*lead, D, *out]: its out dims flattened are s's K
    lead_n = s.ndim - 1
    out_shape = w.shape[lead_n + 1 :]
    s_out = inv.reshape(*s.shape[:-1], *((1,)), *out_shape)
    _set(params, producer, (w.astype(jnp.float32) * s_out).astype(w.dtype))
    bias_path = producer.replace("_proj", "_bias")
    bias = _get(params, bias_path)
    if bias is not None:
        b_inv = inv.reshape(*s.shape[:-1], *out_shape)
        _set(params, bias_path, (bias.astype(jnp.float32) * b_inv).astype(bias.dtype))
