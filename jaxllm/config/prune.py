"""The `prune` section: how a run's weights were pruned after training (`jaxllm prune`).

A run written by `jaxllm prune` records its method here. Its checkpoint is an ordinary float
checkpoint whose pruned weights hold exact zeros: those zeros are the mask, and a run that
trains from it (`checkpoint.init_from`) keeps them (docs/compression.md). A run that was never
pruned has `method: none`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from jaxllm.config.errors import fail
from jaxllm.config.quantize import check_calibration

METHODS = ("magnitude", "wanda", "sparsegpt", "layers", "heads", "channels", "slicegpt")
# The methods that read calibration data.
CALIBRATED = ("wanda", "sparsegpt", "layers", "heads", "channels", "slicegpt")
# The methods that remove whole parts, so the model's shapes shrink (no zeros to keep).
STRUCTURED = ("layers", "heads", "channels", "slicegpt")


@dataclasses.dataclass(frozen=True)
class SparseGPTConfig:
    """SparseGPT's settings (`jaxllm.compress.prune`; Frantar & Alistarh 2023)."""

    block_size: int = 128
    """Input channels whose mask is chosen together and whose updates are applied lazily (the
    paper's 128)."""
    dampening: float = 0.01
    """Added to the Hessian's diagonal, times its mean (the paper's 1%)."""


@dataclasses.dataclass(frozen=True)
class PruneConfig:
    """Post-training pruning (docs/compression.md). Set by `jaxllm prune`, which writes the
    pruned run."""

    method: Literal[
        "none", "magnitude", "wanda", "sparsegpt", "layers", "heads", "channels", "slicegpt"
    ] = "none"
    """`magnitude` (|W|, no data); `wanda` (|W| times the norm of its input channel) and
    `sparsegpt` (OBS-style removal with the Hessian's error feedback), both calibrated; the
    structured `layers`, `heads` (key-value head groups) and `channels` (MLP intermediate
    channels), removed by LLM-Pruner's first-order Taylor importance, and `slicegpt` (the
    residual stream rotated by its principal components and d_model sliced), calibrated."""
    sparsity: float = 0.5
    """The fraction of each chosen weight set to zero, in [0, 1) (structured: of the layers,
    key-value head groups, MLP channels or d_model channels removed, rounded down). With a
    pattern, N/M."""
    pattern: str = ""
    """N:M semi-structured sparsity, e.g. `2:4`: N of every M consecutive input channels of each
    output are zero (M must divide the input channels). Empty: unstructured."""
    head: bool = False
    """Prune the untied LM head too (by default it stays dense)."""
    skip: tuple[str, ...] = ()
    """More weights to leave dense: parameter-path patterns (`fnmatch`), as `quantize.skip`."""
    calibration: str | None = None
    """wanda / sparsegpt: a `data.sources` entry; unset: the run's own held-out split."""
    samples: int = 128
    """Rows of `data.seq_len` tokens of the calibration data used (the papers' 128)."""
    sparsegpt: SparseGPTConfig = SparseGPTConfig()

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def calibrated(self) -> bool:
        return self.method in CALIBRATED

    @property
    def nm(self) -> tuple[int, int] | None:
        """(N, M) of the pattern, or None when unstructured."""
        if not self.pattern:
            return None
        n, m = self.pattern.split(":")
        return int(n), int(m)

    @property
    def fraction(self) -> float:
        """The fraction of each pruned weight that is zero."""
        nm = self.nm
        return nm[0] / nm[1] if nm else self.sparsity

    def validate(self) -> None:
        if not self.enabled:
            return
        if self.pattern and not re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", self.pattern):
            fail(f"--pattern {self.pattern!r}: give N:M, such as 2:4 or 4:8.")
        if self.nm and self.nm[0] >= self.nm[1]:
            fail(f"--pattern {self.pattern}: N must be below M (N of every M are zero).")
        if not 0 <= self.sparsity < 1:
            fail(f"--sparsity {self.sparsity} is outside [0, 1).")
        check_calibration(self.calibration)
        if self.calibration and not self.calibrated:
            fail(
                f"prune.calibration: method {self.method} reads no calibration data; the "
                f"calibrated methods are {', '.join(CALIBRATED)}."
            )
        if self.samples < 1:
            fail(f"prune.samples must be at least 1, not {self.samples}.")
        if self.method in STRUCTURED and (self.pattern or self.head or self.skip):
            fail(
                f"--method {self.method} removes whole parts: it takes no --pattern, "
                "prune.head or prune.skip."
            )
        g = self.sparsegpt
        if g.block_size < 1 or not g.dampening >= 0:
            fail("prune.sparsegpt.block_size must be >= 1 and prune.sparsegpt.dampening >= 0.")
        if self.method == "sparsegpt" and self.nm and g.block_size % self.nm[1]:
            fail(
                f"prune.sparsegpt.block_size ({g.block_size}) must be a multiple of the "
                f"pattern's M ({self.nm[1]})."
            )
        for pattern in self.skip:
            if not pattern or not isinstance(pattern, str):
                fail(f"prune.skip: {pattern!r} is not a parameter-path pattern.")
