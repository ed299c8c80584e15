"""What the FlashAttention-2 backends share: the static `Config` of a call, block sizes and
padding, which backend can run where, the block ranges and masks of the static and dynamic
masks, scaled / soft-capped logits, the matmul forms and the backward preamble (delta).

The backend modules (`triton.py`, `mosaic_tpu.py`, `mosaic_gpu.py` with
`mosaic_gpu_backward.py` and the opt-in `mosaic_gpu_ws.py`, `mosaic_gpu_fused_backward.py`)
implement one contract: q/out/dout [B, H, Lp, K], k/v [B, G, Sp, K],
lse [B, H, Lp, 1] float32 (a trailing unit lane dim so every block is 2-D), q segment ids
[B, Lp, 1] and kv segment ids [B, 1, Sp]. Lp / Sp are the lengths padded to the block sizes by
`ops.py`; the real kv length masks the padded keys. A row with no visible key gives out 0,
lse `MASK_VALUE` and zero gradients. Softmax statistics and accumulators are float32; p and ds
are rounded to the input dtype for the second matmul of each pair (as FlashAttention does for
bf16). This module imports no backend's Pallas lowering.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Kernel backends; `ops.py` imports the module of one only when a call uses it.
BACKENDS = ("mosaic_tpu", "triton", "mosaic_gpu")

# What the Mosaic GPU (Hopper, wgmma) kernels take, known before their module is imported.
MOSAIC_GPU_DTYPES = (jnp.bfloat16, jnp.float16)
MOSAIC_GPU_HEAD_DIMS = (64, 128)
MOSAIC_GPU_BLOCK_MULTIPLE = 64  # rows of one wgmma tile of a warpgroup


@dataclasses.dataclass(frozen=True)
class Config:
    """Static description of one attention call (hashable: a custom_vjp nondiff argument)."""

    block_q: int
    block_kv: int
    q_len: int  # real (unpadded) lengths
    kv_len: int
    causal: bool
    sliding_window: int | None
    soft_cap: float | None
    sm_scale: float
    has_segments: bool
    backend: str  # one of BACKENDS
    interpret: bool
    warp_specialized: bool = False  # Mosaic GPU: the forward of `mosaic_gpu_ws.py`
    fused_backward: bool = False  # Mosaic GPU: the backward of `mosaic_gpu_fused_backward.py`


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows of q (`block_q`) and of k/v (`block_kv`) per kernel block.

    Defaults per backend: Mosaic TPU 128 / 128 for the forward and both backward kernels (one
    [128, 128] MXU tile per grid step; lane-dense kv segment-id slices),
    Triton 64 / 64 (keeps the f32 [64, 64] tiles and a K <= 128 accumulator in registers),
    Mosaic GPU 64 / 64 (one wgmma row tile per warpgroup; the dq and dk/dv pipelines fit Hopper's
    shared memory at K = 128). Clipped to the padded sequence length for short sequences (not
    below 64 rows for Mosaic GPU); Triton needs powers of 2, Mosaic GPU multiples of 64, Mosaic
    TPU multiples of 8 and, with segment ids, a block_kv that is a multiple of 128 (lane-dim
    slices of the kv ids) unless one block holds the whole padded sequence.

    `warp_specialized` (Mosaic GPU only) runs the FlashAttention-3 style forward of
    `mosaic_gpu_ws.py`: `block_q` rows per program split over two compute warpgroups (a multiple
    of 128, not below 128 for short sequences; e.g. `BlockSizes(128, 128, True)`); the backward
    then runs with the default 64 / 64.

    `fused_backward` (Mosaic GPU only) runs the FlashAttention-3 style backward of
    `mosaic_gpu_fused_backward.py` instead of the two FlashAttention-2 kernels: one kernel per
    block of keys that accumulates dk / dv in registers and adds each q block's dq into a float32
    buffer with TMA reduce-add stores. It runs at these blocks, or at the default 64 / 64 under
    `warp_specialized` (e.g. `BlockSizes(128, 128, True, fused_backward=True)`); at K = 128 it
    needs 64 / 64 blocks to fit shared memory. Off by default until it is measured on a GPU.
    """

    block_q: int
    block_kv: int
    warp_specialized: bool = False
    fused_backward: bool = False

    @classmethod
    def default(cls, backend: str) -> BlockSizes:
        return cls(64, 64) if backend in ("triton", "mosaic_gpu") else cls(128, 128)


def block_size(requested: int, length: int, backend: str) -> int:
    """Short sequences get one block of the next power of 2 (>= 8 sublanes, >= one wgmma tile for
    Mosaic GPU) instead of a mostly padded full-size block."""
    minimum = MOSAIC_GPU_BLOCK_MULTIPLE if backend == "mosaic_gpu" else 8
    return max(minimum, min(requested, pl.next_power_of_2(length)))


def round_up(length: int, block: int) -> int:
    return -(-length // block) * block


def pad_to(x, axis: int, size: int, value=0):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def mosaic_gpu_runs_on(device) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.x). wgmma exists only there:
    Blackwell's tensor cores take tcgen05 instead, and older GPUs have neither TMA nor wgmma."""
    capability = getattr(device, "compute_capability", None)
    return capability is not None and str(capability).split(".")[0] == "9"


def mosaic_gpu_supported(dtype, head_dim: int, blocks: tuple[int, int] | None = None) -> str | None:
    """Why the Mosaic GPU kernels cannot run a call, or None when they can."""
    if jnp.dtype(dtype) not in map(jnp.dtype, MOSAIC_GPU_DTYPES):
        return f"dtype {jnp.dtype(dtype).name} (wgmma here takes bfloat16 or float16)"
    if head_dim not in MOSAIC_GPU_HEAD_DIMS:
        return f"head dim {head_dim} (supported: {MOSAIC_GPU_HEAD_DIMS})"
    if blocks is not None and any(size % MOSAIC_GPU_BLOCK_MULTIPLE for size in blocks):
        return f"blocks {blocks[0]}/{blocks[1]} (need multiples of {MOSAIC_GPU_BLOCK_MULTIPLE})"
    return None


# ------------------------------------------------------------------------- in-kernel math


def dot_nt(a, b):  # a @ b.T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):  # a.T @ b
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a, b):  # a @ b
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def kv_block_range(q_block, cfg: Config, num_kv_blocks: int):
    """[lo, hi) of the kv blocks that query block `q_block` may see under the static masks."""
    bq, bk, w = cfg.block_q, cfg.block_kv, cfg.sliding_window
    lo, hi = jnp.int32(0), jnp.int32(num_kv_blocks)
    first_q, last_q = q_block * bq, q_block * bq + (bq - 1)
    if cfg.causal:  # k <= q
        hi = jnp.minimum(hi, lax.div(last_q, bk) + 1)
    if w is not None:  # q - w < k (and k < q + w without causality)
        lo = lax.div(jnp.maximum(first_q - w + 1, 0), bk)
        if not cfg.causal:
            hi = jnp.minimum(hi, lax.div(last_q + w - 1, bk) + 1)
    return lo, hi


def q_block_range(kv_block, cfg: Config, num_q_blocks: int):
    """[lo, hi) of the query blocks that may see kv block `kv_block` under the static masks."""
    bq, bk, w = cfg.block_q, cfg.block_kv, cfg.sliding_window
    lo, hi = jnp.int32(0), jnp.int32(num_q_blocks)
    first_k, last_k = kv_block * bk, kv_block * bk + (bk - 1)
    if cfg.causal:  # q >= k
        lo = lax.div(first_k, bq)
    if w is not None:  # q < k + w (and q > k - w without causality)
        hi = jnp.minimum(hi, lax.div(last_k + w - 1, bq) + 1)
        if not cfg.causal:
            lo = lax.div(jnp.maximum(first_k - w + 1, 0), bq)
    return lo, hi


def block_mask(q_start, k_start, q_ids, kv_ids, cfg: Config, num_q_rows: int, pad_q: bool):
    """[bq, bk] visibility of the block at (q_start, k_start), or None when every entry is
    visible; ids [bq, 1] and [1, bk] (None without segments)."""
    bq, bk = num_q_rows, cfg.block_kv
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    return mask_from_positions(q_pos, k_pos, q_ids, kv_ids, cfg, pad_q)


def mask_from_positions(q_pos, k_pos, q_ids, kv_ids, cfg: Config, pad_q: bool):
    """Visibility of one block from its (broadcast) positions and segment ids, or None when
    every entry is visible: the per-element mask of every backend's kernels."""
    mask = None

    def conj(a, b):
        return b if a is None else a & b

    if cfg.kv_len % cfg.block_kv:  # padded keys are never attended
        mask = conj(mask, k_pos < cfg.kv_len)
    if pad_q and cfg.q_len % cfg.block_q:  # padded queries give nothing back (dk/dv)
        mask = conj(mask, q_pos < cfg.q_len)
    if cfg.causal:
        mask = conj(mask, k_pos <= q_pos)
    if cfg.sliding_window is not None:
        mask = conj(mask, q_pos - cfg.sliding_window < k_pos)
        if not cfg.causal:
            mask = conj(mask, k_pos < q_pos + cfg.sliding_window)
    if q_ids is not None:
        mask = conj(mask, q_ids == kv_ids)
    return mask


def scale_and_cap(products, cfg: Config):
    """Logits of one block from its float32 q k^T products and, with a soft cap, tanh(s / cap)
    for the backward derivative (1 - tanh^2); None without a cap."""
    s = products * jnp.float32(cfg.sm_scale)
    if cfg.soft_cap is None:
        return s, None
    t = jnp.tanh(s / jnp.float32(cfg.soft_cap))
    return jnp.float32(cfg.soft_cap) * t, t


def block_scores(q, k, cfg: Config):
    """`scale_and_cap` of q k^T for a [bq, K] q tile and a [bk, K] k tile in registers."""
    return scale_and_cap(dot_nt(q, k), cfg)


def backward_delta(out, do, dlse=None):
    """The FlashAttention-2 preprocessing step of every backward, [B, H, Lp, 1] float32:
    delta_i = sum_k do_ik out_ik = sum_j p_ij dp_ij, so that ds = p * (dp - delta).

    With a cotangent `dlse` [B, H, Lp, 1] of the logsumexp: d lse_i / d s_ij = p_ij, so the lse
    path adds p_ij * dlse_i to ds_ij, i.e. ds = p * (dp - (delta - dlse)).
    """
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    if dlse is not None:
        delta = delta - dlse
    return delta
