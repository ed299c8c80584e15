"""4-bit NormalFloat (NF4) storage for a frozen base model, as in QLoRA.

QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs",
arXiv:2305.14314) keeps the frozen base weights in 4 bits and trains 16-bit low-rank adapters
on top; the weights are dequantized to the compute dtype inside each matmul. The format, as
bitsandbytes implements it (`quantize_4bit(quant_type="nf4", blocksize=64,
compress_statistics=True)`):

- Blocks of 64 consecutive values (of the row-major flattened tensor) are scaled by their
  absmax into [-1, 1], and each value becomes the index of the nearest of the 16 NF4 values
  (`NF4_CODE`). These are quantiles of N(0, 1), so each code is about equally likely for
  normally distributed weights (§3, "4-bit NormalFloat"): 8 positive and 7 negative values
  and an exact zero (`nf4_code_from_normal_quantiles` re-derives them). Two codes share a
  byte: the even element in the high nibble, the odd one in the low nibble.
- Double quantization (§3): the float32 absmax constants (0.5 bits a parameter at block 64)
  are stored in 8 bits. Their mean is subtracted (one float32 offset per tensor), and the
  centred values are quantized in blocks of 256 by their own absmax to the nearest value of
  bitsandbytes' signed "dynamic" 8-bit map (`DYNAMIC_CODE`, Dettmers 2015, arXiv:1511.04561:
  a decimal exponent and a fraction whose bits shrink as the exponent grows). One float32
  scale per 256 absmax values remains: 0.5 + 1/64 + 4/(64 * 256) bytes a parameter.
- Dequantization: absmax = DYNAMIC_CODE[absmax_code] * absmax_scale + offset and
  w = NF4_CODE[code] * absmax, in float32, then cast to the compute dtype.

Layout. The 64-blocks run over the row-major flattened tensor, exactly bitsandbytes' blocks,
but the leading dims are kept: with k the smallest count of trailing dims whose product m is a
multiple of 64, `codes` is [*shape[:-k], m // 2] and `absmax_codes` [*shape[:-k], m // 64], so
a tensor sharded along its leading (kept) dims shards its codes the same way (`nf4_axes`), and
dequantization reshapes only trailing dims. The 256-blocks of the double quantization run over
the flattened absmax (the last one padded); their scales, one float32 per 16384 parameters,
stay replicated, and each absmax finds its scale by its flat index.

Rounding follows bitsandbytes: a value is multiplied by the reciprocal of its block's absmax
and takes the nearest code, a tie going to the lower one. For the 4-bit codes that is exactly
bitsandbytes' `quantize_4bit` (midpoints and `bucketize` on CPU, a tree of `x > midpoint`
tests on CUDA). For the 8-bit absmax
codes its CPU kernel looks the nearest code up in a 65536-entry table, which picks the
neighbouring code for values within about 1.5e-5 of a midpoint; this module takes the exact
nearest one. `tests/test_nf4.py` compares both against bitsandbytes and, without it, against a
numpy quantizer built on the re-derived code book.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64  # values per absmax
ABSMAX_BLOCK = 256  # absmax values per float32 scale of the double quantization

# The NF4 values of QLoRA (Appendix E) and bitsandbytes' `get_4bit_type("nf4")`, in float32.
NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)


def nf4_code_from_normal_quantiles(offset: float = 0.9677083) -> np.ndarray:
    """NF4 re-derived (float64): quantiles of N(0, 1) at 8 probabilities evenly spaced from
    `offset` down to 1/2 (exclusive) for the positive half and 7 for the negative one, an
    exact zero between them, all divided by the largest. `offset` is QLoRA's (bitsandbytes'
    `create_normal_map`), 1 - (1/30 + 1/32) / 2: the end codes cannot sit at the quantile of
    probability 1, which is infinite."""
    ppf = statistics.NormalDist().inv_cdf
    positive = [ppf(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
    negative = [-ppf(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
    values = np.sort(np.array(positive + [0.0] + negative))
    return values / values.max()


def dynamic_code(max_exponent_bits: int = 7) -> np.ndarray:
    """bitsandbytes' signed 8-bit "dynamic" map (`create_dynamic_map(signed=True)`), sorted:
    for exponent i = 0 .. 6 the 2^i midpoints of an even split of [0.1, 1] times 10^(i - 6),
    with both signs, plus 0 and 1. Boundaries are float64 linspace rounded to float32, and the
    means and decade scales are float32 products as in bitsandbytes (whose boundaries, from
    float32 `torch.linspace`, can differ in the last bit)."""
    f32 = np.float32
    data = []
    for i in range(max_exponent_bits):
        bounds = np.linspace(0.1, 1.0, 2**i + 1).astype(f32)
        means = (bounds[:-1] + bounds[1:]) / f32(2)
        decade = f32(10.0 ** (i - (max_exponent_bits - 1)))
        data += [decade * means, -decade * means]
    data.append(np.array([0.0, 1.0], f32))
    code = np.sort(np.concatenate(data))
    assert code.shape == (256,), code.shape
    return code


DYNAMIC_CODE = dynamic_code()


def _midpoints(code: np.ndarray) -> np.ndarray:
    """Decision boundaries of nearest rounding onto a sorted code book, in float32."""
    return (code[:-1] + code[1:]) / np.float32(2)


_NF4_MIDPOINTS = _midpoints(NF4_CODE)
_DYNAMIC_MIDPOINTS = _midpoints(DYNAMIC_CODE)


def _nearest(midpoints: np.ndarray, x: jax.Array) -> jax.Array:
    """uint8 index of the code nearest each x; on a midpoint, the lower code."""
    return jnp.searchsorted(jnp.asarray(midpoints), x, side="left").astype(jnp.uint8)


def _reciprocal(absmax: jax.Array) -> jax.Array:
    # An all-zero block (absmax 0) scales to 0, and 0 quantizes to an exact-zero code.
    return 1.0 / jnp.maximum(absmax, jnp.finfo(jnp.float32).tiny)


# ------------------------------------------------------------------------------------ layout


def kept_ndim(shape: Sequence[int]) -> int:
    """How many leading dims of a tensor of `shape` its codes keep: all but the fewest trailing
    dims whose product is a multiple of `BLOCK`. ValueError if there are none."""
    shape = tuple(shape)
    m = 1
    for k in range(1, len(shape) + 1):
        m *= shape[-k]
        if m % BLOCK == 0:
            return len(shape) - k
    raise ValueError(
        f"NF4 needs {BLOCK}-value blocks: no trailing dims of shape {shape} multiply to a "
        f"multiple of {BLOCK} (it has {math.prod(shape)} elements)"
    )


def _layout(shape: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """(kept leading dims, product m of the blocked trailing dims)."""
    shape = tuple(shape)
    kept = kept_ndim(shape)
    return shape[:kept], math.prod(shape[kept:])


def nf4_axes(axes: Sequence[str | None], shape: Sequence[int]) -> tuple[str | None, ...]:
    """Logical axis names of `codes` and `absmax_codes` of a tensor with these `axes`: the
    kept leading names, then None for the blocked trailing dim. `absmax_scale` and
    `absmax_offset` are replicated (axes (None,) and ())."""
    assert len(axes) == len(shape), (axes, shape)
    return (*tuple(axes)[: kept_ndim(shape)], None)


def nf4_nbytes(shape: Sequence[int]) -> int:
    """Bytes of an `NF4Tensor` of `shape`: half a byte a value, a byte per 64 values, a
    float32 per 64 * 256 values (the last block padded), and the float32 offset."""
    kept_ndim(shape)  # raises for a shape without 64-value blocks
    n = math.prod(shape)
    n_absmax = n // BLOCK
    return n // 2 + n_absmax + 4 * -(-n_absmax // ABSMAX_BLOCK) + 4


@flax.struct.dataclass
class NF4Tensor:
    """A tensor of `shape` in NF4 with double-quantized absmax (module docstring). With
    lead = shape[:kept_ndim(shape)] and m the product of the rest:"""

    codes: jax.Array  # uint8 [*lead, m // 2]: value 2i in the high nibble of byte i, 2i+1 low
    absmax_codes: jax.Array  # uint8 [*lead, m // 64]: index into DYNAMIC_CODE
    absmax_scale: jax.Array  # float32 [ceil(n // 64 / 256)]: per 256 flat absmax values
    absmax_offset: jax.Array  # float32 []: the mean absmax
    shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    dtype: np.dtype = flax.struct.field(pytree_node=False)  # of the tensor quantized

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return nf4_nbytes(self.shape)


# ------------------------------------------------------------------------- quantize / dequantize


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """int32 array of `shape` holding each element's index in the row-major flattening."""
    return jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)


def quantize(x: jax.Array) -> NF4Tensor:
    """`x` (any float dtype, a multiple of 64 values in some trailing dims) in NF4 with
    double-quantized absmax; pure jnp, static shapes, jit-able."""
    shape = tuple(x.shape)
    lead, m = _layout(shape)
    x_Mx64 = x.astype(jnp.float32).reshape(*lead, m // BLOCK, BLOCK)
    absmax = jnp.max(jnp.abs(x_Mx64), axis=-1)
    scaled = jnp.clip(x_Mx64 * _reciprocal(absmax)[..., None], -1.0, 1.0)
    idx = _nearest(_NF4_MIDPOINTS, scaled).reshape(*lead, m)
    codes = (idx[..., 0::2] << 4) | idx[..., 1::2]

    # Double quantization over the flattened absmax, in blocks of 256 (the last one padded).
    offset = jnp.mean(absmax)
    centred = (absmax - offset).reshape(-1)
    n_absmax = centred.shape[0]
    pad = -n_absmax % ABSMAX_BLOCK
    blocks_Sx256 = jnp.pad(centred, (0, pad)).reshape(-1, ABSMAX_BLOCK)
    scale_S = jnp.max(jnp.abs(blocks_Sx256), axis=-1)
    normed = jnp.clip(blocks_Sx256 * _reciprocal(scale_S)[:, None], -1.0, 1.0)
    absmax_codes = _nearest(_DYNAMIC_MIDPOINTS, normed).reshape(-1)[:n_absmax]
    return NF4Tensor(
        codes=codes,
        absmax_codes=absmax_codes.reshape(absmax.shape),
        absmax_scale=scale_S,
        absmax_offset=offset,
        shape=shape,
        dtype=np.dtype(x.dtype),
    )


def dequantize_absmax(q: NF4Tensor) -> jax.Array:
    """float32 [*lead, m // 64]: the absmax of each 64-block, DYNAMIC_CODE[code] * scale +
    offset (bitsandbytes' `dequantize_blockwise` plus its offset)."""
    scale_idx = _flat_index(q.absmax_codes.shape) // ABSMAX_BLOCK
    return jnp.asarray(DYNAMIC_CODE)[q.absmax_codes] * q.absmax_scale[scale_idx] + q.absmax_offset


def dequantize(q: NF4Tensor, dtype=None) -> jax.Array:
    """The tensor of `q`, NF4_CODE[code] * absmax in float32, in `dtype` (default: the dtype
    it was quantized from). Reshapes only the blocked trailing dims, so it runs shard-local."""
    lead, m = _layout(q.shape)
    hi_lo = jnp.stack([q.codes >> 4, q.codes & 15], axis=-1)
    values = jnp.asarray(NF4_CODE)[hi_lo].reshape(*lead, m // BLOCK, BLOCK)
    w = values * dequantize_absmax(q)[..., None]
    return w.reshape(q.shape).astype(q.dtype if dtype is None else dtype)
