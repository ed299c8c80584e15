"""The attention kernels run per shard (`jaxllm.model.attention.dot_product_attention` picks
them): the Pallas flash kernel and cuDNN's fused attention. A custom call cannot be split by the
SPMD partitioner, so under a mesh each runs through `shard_map` over batch and heads. Both name
their output and logsumexp for `model.remat=dots_attention` (`jaxllm.model.remat`)."""

from __future__ import annotations

import jax

from jaxllm import parallel
from jaxllm.kernels import flash_attention
from jaxllm.model.cudnn import cudnn_attention
from jaxllm.model.remat import save_attention


def flash(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    q_seg_BxL,
    kv_seg_BxS,
    causal,
    scale,
    window,
    soft_cap,
    sinks_H=None,
):
    """The Pallas kernel per shard (interpreted on CPU); `sinks_H` [H] shard with the heads."""
    interpret = jax.default_backend() == "cpu"

    def kernel(q, k, v, q_seg, kv_seg, sinks=None):
        seg = None if q_seg is None else (q_seg, kv_seg)
        return flash_attention(
            q,
            k,
            v,
            causal=causal,
            segment_ids=seg,
            sm_scale=scale,
            sliding_window=window,
            soft_cap=soft_cap,
            sinks=sinks,
            interpret=interpret,
        )

    if q_seg_BxL is not None and kv_seg_BxS is None:
        kv_seg_BxS = q_seg_BxL
    if sinks_H is None:
        return parallel.per_shard_attention(
            kernel, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS
        )
    qkv = ("batch", None, "act_heads", None)
    seg = None if q_seg_BxL is None else ("batch", None)
    return parallel.per_shard(
        kernel,
        (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, sinks_H),
        (qkv, qkv, qkv, seg, seg, ("act_heads",)),
        qkv,
    )


def cudnn(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, causal, scale, window, m):
    """cuDNN's fused attention per shard (`jaxllm.model.cudnn`), packed segments as offsets;
    the flash kernel when a row holds more than `m` segments."""

    def fallback(q, k, v, q_seg, kv_seg):
        return flash_attention(
            q,
            k,
            v,
            causal=causal,
            segment_ids=(q_seg, kv_seg),
            sm_scale=scale,
            sliding_window=window,
        )

    def kernel(q, k, v, q_seg, kv_seg):
        return cudnn_attention(
            q,
            k,
            v,
            q_seg,
            kv_seg,
            causal=causal,
            scale=scale,
            sliding_window=window,
            max_segments=m,
            fallback=fallback,
        )

    if q_seg_BxL is not None and kv_seg_BxS is None:
        kv_seg_BxS = q_seg_BxL
    return parallel.per_shard_attention(  # cuDNN's residuals named for remat=dots_attention
        save_attention(kernel), q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS
    )
