"""The KV cache of generation: allocation, writes (quantize on write), and attention over it.

Storage formats and the decode-attention kernel live in `jaxllm.kernels.decode_attention`
(`KVCache`: every array carries a leading `layers` axis, heads before tokens). This module owns
what happens around them:

- `init_cache`: zeros for all layers, contiguous ([B, G, T, ...] per layer) or paged ([P, G, N,
  ...] pages plus a per-sequence block table, `allocate_pages`). Page 0 is a scratch page: block
  table entries past a sequence's allocation point at it, so writes of padding land there.
- `CacheView`: what one forward pass of the model sees: the cache, the layer being run, and the
  sequence lengths after this pass's tokens are written. `Attention` calls `write` with its new
  keys/values and then (decode steps) `attend`.
- MLA models cache a latent (`cache_dims`): one "kv head" of [compressed kv ; rope key] per
  token that is key and value at once (`KVCache.value_dim`), so a token costs
  kv_lora_rank + qk_rope_head_dim values per layer instead of 2 x heads x head_dim.

Quantize on write, as KIVI (Liu et al. 2024, arXiv:2402.02750) does for int4 and int2 (KIVI-2):
keys are quantized
per channel over groups of `group` tokens, so the tokens of a group that is not full yet stay in
a full-precision residual buffer and are quantized together when the group's last token comes.
int8 (one scale per token and kv head) and full-precision caches write each token directly.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import parallel, sharding
from jaxllm.config.sections import KV_CACHE_DTYPE
from jaxllm.infer.linear_state import LinearState, num_full_layers, state_bytes
from jaxllm.kernels.decode_attention import quant
from jaxllm.kernels.decode_attention.ops import decode_attention
from jaxllm.kernels.decode_attention.quant import KVCache, cache_bytes_per_token
from jaxllm.kernels.decode_attention.reference import decode_attention_reference

KINDS = ("bfloat16", "float32", "int8", "int4", "int2")
KIVI_KINDS = tuple(quant.KIVI_BITS)  # packed codes with a full-precision residual window


def cache_length(max_tokens: int, kind: str, group: int, page_size: int = 0) -> int:
    """Tokens per sequence a contiguous cache reserves: `max_tokens` rounded up to whole KIVI
    (int4 / int2) groups and kernel blocks (pages set their own granularity)."""
    unit = page_size or math.lcm(group if kind in quant.KIVI_BITS else 1, 16)
    return -(-max_tokens // unit) * unit


def allocate_pages(tokens_B, page_size: int) -> tuple[np.ndarray, int]:
    """Block table [B, max pages] (int32) giving each sequence just the pages its tokens need,
    and the total number of pages including the scratch page 0 (unused entries point at it)."""
    pages_B = [-(-int(n) // page_size) for n in tokens_B]
    table = np.zeros((len(pages_B), max(pages_B)), np.int32)
    nxt = 1
    for b, n in enumerate(pages_B):
        table[b, :n] = np.arange(nxt, nxt + n)
        nxt += n
    return table, nxt


def cache_dims(cfg) -> tuple[int, int, int | None]:
    """(kv heads, key width, value width or None) of a model's cache. An MLA model caches one
    "head" of [latent ; rope key] per token whose first kv_lora_rank channels are the values
    (None: values as wide as keys, stored apart). Gaussian-kernel attention caches its keys
    with ||k||^2 appended (`jaxllm.model.gaussian`) and values zero-padded to that width."""
    if cfg.mla.enabled:
        a = cfg.mla
        return 1, a.kv_lora_rank + a.qk_rope_head_dim, a.kv_lora_rank
    extra = 1 if cfg.attention_kernel == "gaussian" else 0
    return cfg.num_kv_heads, cfg.resolved_head_dim + extra, None


def init_cache(
    *,
    num_layers: int,
    batch: int,
    num_kv_heads: int,
    head_dim: int,
    max_len: int,
    kind: str = KV_CACHE_DTYPE,
    group: int = 32,
    compute_dtype=jnp.bfloat16,
    block_table: jax.Array | None = None,
    num_pages: int | None = None,
    value_dim: int | None = None,
) -> KVCache:
    """An empty cache for all layers. Contiguous unless `block_table` (with `num_pages`, from
    `allocate_pages`) is given; then `max_len` is the page size. `value_dim`: a latent cache
    (MLA; keys only, values are their first `value_dim` channels)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kv cache dtype {kind!r}; expected one of {KINDS}")
    lyr, g, k = num_layers, num_kv_heads, head_dim
    rows = (lyr, batch) if block_table is None else (lyr, num_pages)
    t = max_len
    z = lambda *shape, dtype=jnp.bfloat16: jnp.zeros((*rows, g, *shape), dtype)  # noqa: E731
    fields: dict = dict(kind=kind, group=group, block_table=block_table, value_dim=value_dim)
    if value_dim is not None:
        if kind in quant.KIVI_BITS:
            raise ValueError(f"a latent (MLA) cache cannot be {kind}: its keys are its values")
        dtype = jnp.int8 if kind == "int8" else jnp.dtype(kind)
        fields.update(k=z(t, k, dtype=dtype), v=None, k_scale=z(t) if kind == "int8" else None)
    elif kind in ("bfloat16", "float32"):
        fields.update(k=z(t, k, dtype=jnp.dtype(kind)), v=z(t, k, dtype=jnp.dtype(kind)))
    elif kind == "int8":
        fields.update(
            k=z(t, k, dtype=jnp.int8), v=z(t, k, dtype=jnp.int8), k_scale=z(t), v_scale=z(t)
        )
    else:  # KIVI: codes packed along K, a full-precision residual group per sequence
        vg, kn = min(group, k), k // quant.codes_per_byte(kind)
        res = jnp.zeros((lyr, batch, g, group, k), compute_dtype)
        fields.update(
            k=z(t, kn, dtype=jnp.uint8),
            v=z(t, kn, dtype=jnp.uint8),
            k_scale=z(t // group, k),
            k_zero=z(t // group, k),
            v_scale=z(t, k // vg),
            v_zero=z(t, k // vg),
            k_res=res,
            v_res=jnp.zeros_like(res),  # its own buffer: a step may donate both
        )
    return KVCache(**fields)


def bytes_per_token(
    kind: str, num_layers: int, num_kv_heads: int, head_dim: int, group: int, latent: bool = False
):
    """Cache bytes one token costs over all layers, codes and scales included (the KIVI
    residual window is a constant `group` tokens per sequence on top; `latent`: keys only)."""
    return num_layers * cache_bytes_per_token(kind, num_kv_heads, head_dim, group, latent)


def model_bytes_per_token(cfg, kind: str, group: int = 32) -> int:
    """`bytes_per_token` of a model's cache (`cache_dims`)."""
    g, k, value_dim = cache_dims(cfg)
    n = num_full_layers(cfg)  # linear layers keep a fixed-size state instead
    return bytes_per_token(kind, n, g, k, group, latent=value_dim is not None)


def logical_axes(kv: KVCache) -> KVCache:
    """The cache with each array replaced by its logical axes: batch (DP) and kv heads (TP) are
    split; the pages of a paged cache are shared by the whole batch, so only their heads are."""
    paged = kv.block_table is not None

    def axes(name):
        x = getattr(kv, name)
        if x is None:
            return None
        if name == "block_table":
            return ("batch", None)
        lead = ("layers", "batch") if name in ("k_res", "v_res") or not paged else ("layers", None)
        heads = None if kv.value_dim is not None else "kv_heads"  # a latent cache has one
        return (*lead, heads) + (None,) * (x.ndim - 3)

    names = ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero", "k_res", "v_res", "block_table")
    return dataclasses.replace(kv, **{n: axes(n) for n in names})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheView:
    """The cache as one forward pass sees it.

    lengths_B: valid tokens per sequence once this pass's `num_new` tokens are written. A
    prefill writes its L tokens at positions 0..L-1 (right-padded prompts; lengths are the
    prompt lengths); a decode step writes Q tokens at lengths - Q .. lengths - 1.
    """

    kv: KVCache
    lengths_B: jax.Array
    layer: jax.Array
    prefill: bool = dataclasses.field(metadata=dict(static=True))
    impl: str = dataclasses.field(default="xla", metadata=dict(static=True))
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))
    linear: LinearState | None = None
    """The linear-attention layers' state (`jaxllm.infer.linear_state`); `layer` indexes
    it in a linear layer, `kv` in a full one (each counts its own kind of layer)."""
    real_B: jax.Array | None = None
    """Decode steps of right-padded rows (the engine): how many of this pass's tokens are
    real per row; linear layers neither decay nor write their state by the rest, and a row of
    0 keeps its state (None: every token is real). A prefill's real tokens are `lengths_B`."""

    def at_layer(self, layer) -> CacheView:
        return dataclasses.replace(self, layer=layer)

    def linear_state(self) -> jax.Array:
        return self.linear.state[self.layer]

    def linear_tails(self) -> tuple[jax.Array, ...]:
        return tuple(t[self.layer] for t in self.linear.tails)

    def write_linear(self, state_BxHxKxV, tails) -> CacheView:
        """This linear layer's new state and convolution tails."""
        lin = self.linear
        new = LinearState(
            state=lin.state.at[self.layer].set(state_BxHxKxV.astype(lin.state.dtype)),
            tails=tuple(t.at[self.layer].set(x.astype(t.dtype)) for t, x in zip(lin.tails, tails)),
        )
        return dataclasses.replace(self, linear=new)

    # -- writes -----------------------------------------------------------------------------

    def write(self, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array | None) -> CacheView:
        """Writes this pass's keys and values (values None for a latent cache)."""
        b, l = k_BxLxGxK.shape[:2]
        if self.prefill:
            pos_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        else:
            pos_BxL = self.lengths_B[:, None] - l + jnp.arange(l, dtype=jnp.int32)[None]
        kv = self.kv
        if kv.value_dim is not None:  # latent: keys only
            if kv.kind == "int8":
                kc, ks = quant.quantize_int8(k_BxLxGxK)
                kv = dataclasses.replace(
                    kv, k=self._put(kv.k, pos_BxL, kc), k_scale=self._put(kv.k_scale, pos_BxL, ks)
                )
            else:
                kv = dataclasses.replace(kv, k=self._put(kv.k, pos_BxL, k_BxLxGxK))
        elif kv.kind in ("bfloat16", "float32"):
            kv = dataclasses.replace(
                kv, k=self._put(kv.k, pos_BxL, k_BxLxGxK), v=self._put(kv.v, pos_BxL, v_BxLxGxK)
            )
        elif kv.kind == "int8":
            kc, ks = quant.quantize_int8(k_BxLxGxK)
            vc, vs = quant.quantize_int8(v_BxLxGxK)
            kv = dataclasses.replace(
                kv,
                k=self._put(kv.k, pos_BxL, kc),
                k_scale=self._put(kv.k_scale, pos_BxL, ks),
                v=self._put(kv.v, pos_BxL, vc),
                v_scale=self._put(kv.v_scale, pos_BxL, vs),
            )
        elif self.prefill:
            kv = self._kivi_prefill(kv, k_BxLxGxK, v_BxLxGxK)
        else:
            for j in range(l):  # Q is small; each token may complete a group
                kv = self._kivi_append(kv, pos_BxL[:, j], k_BxLxGxK[:, j], v_BxLxGxK[:, j])
        return dataclasses.replace(self, kv=kv)

    def _slots(self, pos_BxL, arr_pages: int):
        """(row, column) indices of tokens in a [L, rows, G, T-or-N, ...] array; positions
        that fall outside get an out-of-range index, which `mode="drop"` discards."""
        kv = self.kv
        b = pos_BxL.shape[0]
        if kv.block_table is None:
            rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], pos_BxL.shape)
            return rows, pos_BxL
        n = arr_pages
        page_BxL = jnp.take_along_axis(
            kv.block_table, pos_BxL // n, axis=1, mode="fill", fill_value=0
        )
        return page_BxL, pos_BxL % n

    def _put(self, arr, pos_BxL, val_BxLxGx_, token_axis_len: int | None = None):
        """Writes per-token values [B, L, G, ...] into arr [layers, rows, G, T, ...]."""
        rows, cols = self._slots(pos_BxL, token_axis_len or arr.shape[3])
        return arr.at[self.layer, rows, :, cols].set(val_BxLxGx_.astype(arr.dtype), mode="drop")

    def _kivi_prefill(self, kv, k_BxLxGxK, v_BxLxGxK):
        b, l, _, _ = k_BxLxGxK.shape
        grp = kv.group
        lg = -(-l // grp) * grp
        pad = [(0, 0), (0, lg + grp - l), (0, 0), (0, 0)]  # one spare group for the residual
        k_BxLgxGxK, v_BxLgxGxK = jnp.pad(k_BxLxGxK, pad), jnp.pad(v_BxLxGxK, pad)
        k_BxGxLgxK = k_BxLgxGxK[:, :lg].transpose(0, 2, 1, 3)
        v_BxGxLgxK = v_BxLgxGxK[:, :lg].transpose(0, 2, 1, 3)
        kc, ks, kz = quant.quantize_kivi_keys(k_BxGxLgxK, grp, quant.KIVI_BITS[kv.kind])
        vc, vs, vz = quant.quantize_kivi_values(v_BxGxLgxK, grp, quant.KIVI_BITS[kv.kind])
        pos_BxLg = jnp.broadcast_to(jnp.arange(lg, dtype=jnp.int32), (b, lg))
        # Groups beyond a prompt's last full one hold padding; decode overwrites them when
        # they fill, and attention never reads codes past the last full group.
        kv = self._kivi_put(kv, pos_BxLg, kc, ks, kz, vc, vs, vz)
        full_B = (self.lengths_B // grp) * grp
        take = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, grp, axis=0))
        k_res = take(k_BxLgxGxK, full_B).transpose(0, 2, 1, 3)  # [B, G, group, K]
        v_res = take(v_BxLgxGxK, full_B).transpose(0, 2, 1, 3)
        return dataclasses.replace(
            kv,
            k_res=kv.k_res.at[self.layer].set(k_res.astype(kv.k_res.dtype)),
            v_res=kv.v_res.at[self.layer].set(v_res.astype(kv.v_res.dtype)),
        )

    def _kivi_put(self, kv, pos_BxT, kc, ks, kz, vc, vs, vz):
        """Writes whole quantized groups: codes/value scales per token, key scales per group.
        pos_BxT lists each group's tokens in order (T a multiple of the group)."""
        grp = kv.group
        t_axis = kv.k.shape[3]
        tr = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, G, T, ...] -> [B, T, G, ...]
        rows, cols = self._slots(pos_BxT, t_axis)
        at = lambda arr, r, c, val: arr.at[self.layer, r, :, c].set(  # noqa: E731
            val.astype(arr.dtype), mode="drop"
        )
        g_rows, g_cols = rows[:, ::grp], cols[:, ::grp] // grp
        return dataclasses.replace(
            kv,
            k=at(kv.k, rows, cols, tr(kc)),
            v=at(kv.v, rows, cols, tr(vc)),
            v_scale=at(kv.v_scale, rows, cols, tr(vs)),
            v_zero=at(kv.v_zero, rows, cols, tr(vz)),
            k_scale=at(kv.k_scale, g_rows, g_cols, tr(ks)),
            k_zero=at(kv.k_zero, g_rows, g_cols, tr(kz)),
        )

    def _kivi_append(self, kv, pos_B, k_BxGxK, v_BxGxK):
        """One token into the residual; a sequence whose group it completes quantizes the group
        into the codes (other sequences' writes are dropped)."""
        grp = kv.group
        b = pos_B.shape[0]
        slot_B = pos_B % grp
        bi = jnp.arange(b)
        k_res = kv.k_res.at[self.layer, bi, :, slot_B].set(k_BxGxK.astype(kv.k_res.dtype))
        v_res = kv.v_res.at[self.layer, bi, :, slot_B].set(v_BxGxK.astype(kv.v_res.dtype))
        kv = dataclasses.replace(kv, k_res=k_res, v_res=v_res)
        bits = quant.KIVI_BITS[kv.kind]
        kc, ks, kz = quant.quantize_kivi_keys(k_res[self.layer], grp, bits)
        vc, vs, vz = quant.quantize_kivi_values(v_res[self.layer], grp, bits)
        start_B = pos_B - grp + 1
        full_B = slot_B == grp - 1
        # Sequences whose group is not complete write at an out-of-range position: dropped.
        never = kv.k.shape[3] * (1 if kv.block_table is None else kv.block_table.shape[1]) + grp
        start_B = jnp.where(full_B, start_B, never)
        pos_BxG = start_B[:, None] + jnp.arange(grp, dtype=jnp.int32)[None]
        if kv.block_table is not None:  # out of range of the block table -> scratch page 0
            pos_BxG = jnp.where(full_B[:, None], pos_BxG, kv.k.shape[3] * kv.block_table.shape[1])
        return self._kivi_put(kv, pos_BxG, kc, ks, kz, vc, vs, vz)

    # -- attention --------------------------------------------------------------------------

    def attend(
        self,
        q_BxQxHxK: jax.Array,
        *,
        sm_scale=None,
        soft_cap=None,
        sliding_window=None,
        alibi_slopes_H=None,
        sinks_H=None,
    ) -> jax.Array:
        """Attention of the new queries over the cache (causal among themselves), with the
        layer's logit scale, soft cap, sliding window (int, or traced: 0 is none), ALiBi
        slopes and attention sinks. The kernel runs global layers; windowed and ALiBi layers take the reference
        path (`decode_attention` says why)."""
        masks = dict(sm_scale=sm_scale, soft_cap=soft_cap)
        if self.impl == "kernel":  # per (batch, kv head) shard: a kernel cannot be partitioned
            # Optional operands travel by name; a static window stays a Python int.
            named = {
                "sliding_window": (sliding_window, None),
                "alibi_slopes_H": (alibi_slopes_H, ("act_heads",)),
                "sinks_H": (sinks_H, ("act_heads",)),
            }
            if isinstance(sliding_window, int):
                masks["sliding_window"] = named.pop("sliding_window")[0]
            named = {k: v for k, v in named.items() if v[0] is not None}

            def kernel(q, kv, lengths, layer, *extra):
                return decode_attention(
                    q,
                    kv,
                    lengths,
                    layer=layer,
                    interpret=self.interpret,
                    **masks,
                    **dict(zip(named, extra)),
                )

            q_axes = ("batch", None, "act_heads", None)
            out = parallel.per_shard(
                kernel,
                (q_BxQxHxK, self.kv, self.lengths_B, self.layer, *(v for v, _ in named.values())),
                (
                    q_axes,
                    logical_axes(self.kv),
                    ("batch",),
                    None,
                    *(ax for _, ax in named.values()),
                ),
                q_axes,
            )
        else:
            out = decode_attention_reference(
                q_BxQxHxK,
                self.kv,
                self.lengths_B,
                layer=self.layer,
                sliding_window=sliding_window,
                alibi_slopes_H=alibi_slopes_H,
                sinks_H=sinks_H,
                **masks,
            )
        return out.astype(q_BxQxHxK.dtype)


def cache_report(cfg, mesh) -> dict:
    """KV-cache bytes per token (all layers, scales included) for every cache dtype, and the
    cache of `train.global_batch_size` sequences of `model.max_seq_len` tokens per device with
    `generate.kv_cache_dtype` (batch split over the data axes, kv heads over `tensor`); the
    linear-attention layers' fixed-size state of that batch (`jaxllm plan`)."""
    m, gen = cfg.model, cfg.generate
    kinds = [k for k in KINDS if not (m.mla.enabled and k in KIVI_KINDS)]  # no KIVI latent
    per_token = {kind: model_bytes_per_token(m, kind, gen.kv_group) for kind in kinds}
    # MLA's latent cache is one "head": tensor shards each hold all of it
    split_axes = (*sharding.RULES["batch"], *(() if m.mla.enabled else ("tensor",)))
    split = int(np.prod([mesh.shape[a] for a in split_axes]))
    tokens = cfg.train.global_batch_size * m.max_seq_len
    state = state_bytes(m, cfg.train.global_batch_size) if m.layer_pattern else 0
    return {
        "linear_state": state,  # batch over the data axes, value heads over tensor
        "linear_state_per_device": state / split,
        "per_token": per_token,
        "kind": gen.kv_cache_dtype,
        "tokens": tokens,
        "bytes_per_device": per_token[gen.kv_cache_dtype] * tokens / split,
    }
