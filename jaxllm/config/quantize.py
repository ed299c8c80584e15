"""The `quantize` section: how a run's weights were quantized after training (`jaxllm quantize`).

A run written by `jaxllm quantize` records its method here, and everything that loads it
(`generate`, `eval`, `load_model`, `plan`) reads its weights as the packed codes this section
describes. A run that was never quantized has `method: none`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxllm.config.errors import fail

# method -> the bit widths it takes. (A method and its widths are added together, with the
# function in `jaxllm.compress` that computes it.)
METHOD_BITS = {"rtn": (8, 4, 3, 2)}
DEFAULT_BITS = {"rtn": 8}

# The weights a method may quantize, by name: the attention, MLP and expert projections, MLA's
# projections, and (with quantize.head) the untied LM head. Embeddings, norms, biases, the MoE
# router, a reward model's score head and PPO's value head always stay in their dtype.
QUANTIZABLE = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj",
    "kv_b_proj",
)


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """Post-training weight quantization (docs/compression.md). Set by `jaxllm quantize`, which
    writes the quantized run; editing these keys in a run's config.yaml does not re-quantize
    its checkpoint (its codes would no longer match, and loading it fails)."""

    method: Literal["none", "rtn"] = "none"
    """`rtn`: round-to-nearest per channel or per group (weight-only integer codes)."""
    bits: int = 8
    """Bits per weight code: 8, 4, 3 or 2 for rtn. Codes are packed into bytes (int4 two a
    byte, int3 eight in three bytes, int2 four a byte)."""
    group_size: int = 0
    """Consecutive values of the contracted (input) dim that share a scale; 0: one scale per
    output channel over the whole contracted dim. Must divide that dim."""
    symmetric: bool = True
    """Symmetric codes around zero (no zero point); false: a zero point per group (the group's
    [min, max] range)."""
    head: bool = False
    """Quantize the untied LM head too (by default it stays in its dtype, as GPTQ and AWQ
    leave it: its errors reach every logit)."""
    skip: tuple[str, ...] = ()
    """More weights to leave in their dtype: parameter-path patterns (`fnmatch`, e.g.
    `layers/mlp/down_proj` or `*/o_proj`), matched against paths like `layers/attn/q_proj`."""

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def validate(self) -> None:
        if not self.enabled:
            return
        takes = METHOD_BITS[self.method]
        if self.bits not in takes:
            fail(
                f"quantize.bits={self.bits}: method {self.method} takes "
                f"{', '.join(map(str, takes))} bits."
            )
        if self.group_size < 0:
            fail(f"quantize.group_size must be >= 0 (0: per channel), not {self.group_size}.")
        for pattern in self.skip:
            if not pattern or not isinstance(pattern, str):
                fail(f"quantize.skip: {pattern!r} is not a parameter-path pattern.")
