"""Round-to-nearest (RTN) weight-only quantization: each weight on its own, no calibration.

Every value takes the nearest code of its group's grid (`jaxllm.model.quantized.quantize`):
symmetric, s = absmax / (2^(b-1) - 1/2) and no zero point, or asymmetric, the group's range
[min(w, 0), max(w, 0)] in 2^b - 1 steps with an integer zero point. These are the scales of
GPTQ's `Quantizer` and of compressed-tensors' `calculate_qparams`, so RTN is also what GPTQ
does before its error feedback. The dequantized weight is within half a step s / 2 of the
original (the clipped top code of a symmetric group is exactly half a step off).
"""

from __future__ import annotations

import jax

from jaxllm.config import QuantizeConfig
from jaxllm.model import quantized


def rtn(w: jax.Array, cfg: QuantizeConfig, *, n_in: int, n_out: int) -> quantized.QuantizedTensor:
    """`w` [*lead, *in, *out] quantized by round-to-nearest as `cfg` says."""
    return quantized.quantize(
        w,
        bits=cfg.bits,
        group=cfg.group_size,
        symmetric=cfg.symmetric,
        n_in=n_in,
        n_out=n_out,
    )
