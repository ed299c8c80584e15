"""The `quantize` section: how a run's weights were quantized after training (`jaxllm quantize`).

A run written by `jaxllm quantize` records its method here, and everything that loads it
(`generate`, `eval`, `load_model`, `plan`) reads its weights as the packed codes this section
describes. A run that was never quantized has `method: none`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import yaml

from jaxllm.config.errors import fail

# method -> the bit widths it takes. (A method and its widths are added together, with the
# function in `jaxllm.compress` that computes it.)
METHOD_BITS = {
    "rtn": (8, 4, 3, 2),
    "gptq": (8, 4, 3, 2),
    "awq": (8, 4, 3, 2),
    "smoothquant": (8,),
    "llm_int8": (8,),
    "fp8": (8,),
    "mxfp4": (4,),
}
DEFAULT_BITS = {
    "rtn": 8,
    "gptq": 4,
    "awq": 4,
    "smoothquant": 8,
    "llm_int8": 8,
    "fp8": 8,
    "mxfp4": 4,
}
# The methods whose checkpoints hold integer codes on RTN's grid (`quantized.QuantizedTensor`):
# what GGUF's Q8_0 / Q4_0 and compressed-tensors' pack-quantized store.
INTEGER_CODES = ("rtn", "gptq", "awq")
# The methods that read calibration data (`jaxllm.compress.calibrate`).
CALIBRATED = ("gptq", "awq", "smoothquant")
# The methods of `coded.CodedTensor`, whose grids are fixed: no group size, no zero point.
FIXED_GRID = ("smoothquant", "llm_int8", "fp8", "mxfp4")

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


def check_calibration(value: str | None) -> None:
    """Fails when a `--calibration` source is neither a path nor a YAML mapping."""
    try:
        yaml.safe_load(value or "")
    except yaml.YAMLError as e:
        fail(
            f"--calibration {value}: not a path or a YAML mapping ({str(e).splitlines()[0]}); "
            "write it like {path: x.jsonl, format: chat}."
        )


@dataclasses.dataclass(frozen=True)
class GPTQConfig:
    """GPTQ's settings (`jaxllm.compress.gptq`; Frantar et al. 2022)."""

    block_size: int = 128
    """Input channels rounded between two lazy updates of the rest (the paper's 128)."""
    dampening: float = 0.01
    """Added to the Hessian's diagonal, as a fraction of its mean (the paper's 1%)."""
    act_order: bool = False
    """Round the channels in order of decreasing activation energy H_kk (AutoGPTQ's
    desc_act); with groups it needs static_groups."""
    static_groups: bool = False
    """Every group's grid from the original weights before any update (llm-compressor's);
    false: from the weights as they are when the group's first channel is reached (the
    paper's)."""


@dataclasses.dataclass(frozen=True)
class AWQConfig:
    """AWQ's settings (`jaxllm.compress.awq`; Lin et al. 2023)."""

    grid: int = 20
    """Points of the search for the exponent alpha of the scales s = mean|x|^alpha, over
    [0, 1) (the paper's 20)."""
    duo_scaling: bool = True
    """s = mean|x|^alpha / mean|w|^(1 - alpha), AutoAWQ's and llm-compressor's default (|w|
    relative to each output's largest); false: the paper's s = mean|x|^alpha."""
    clip: bool = True
    """After the scales, search each group's clipping range (AutoAWQ's `apply_clip`): the
    largest |w| shrunk by up to half, in 20ths, to the least output error on the calibration
    rows (the query and key projections unclipped); false: the scales alone."""


@dataclasses.dataclass(frozen=True)
class SmoothQuantConfig:
    """SmoothQuant's settings (`jaxllm.compress.smoothquant`; Xiao et al. 2022)."""

    alpha: float = 0.5
    """Migration strength: s = max|x|^alpha / max|w|^(1 - alpha) (the paper's 0.5)."""


@dataclasses.dataclass(frozen=True)
class LLMInt8Config:
    """LLM.int8()'s settings (Dettmers et al. 2022)."""

    threshold: float = 6.0
    """Input features with any |x| above this stay in 16 bits (the paper's 6.0)."""


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """Post-training weight quantization (docs/compression.md). Set by `jaxllm quantize`, which
    writes the quantized run; editing these keys in a run's config.yaml does not re-quantize
    its checkpoint (its codes would no longer match, and loading it fails)."""

    method: Literal["none", "rtn", "gptq", "awq", "smoothquant", "llm_int8", "fp8", "mxfp4"] = (
        "none"
    )
    """Weight-only integer codes: `rtn` round-to-nearest; `gptq` with Hessian error feedback
    and `awq` with activation-aware scales, both calibrated. `smoothquant` (calibrated) W8A8
    int8, `llm_int8` int8 with 16-bit outlier features, `fp8` E4M3 weights, `mxfp4` OCP
    microscaling E2M1 (docs/compression.md)."""
    bits: int = 8
    """Bits per weight code: 8, 4, 3 or 2 (`jaxllm quantize` defaults: rtn 8, gptq and awq 4). Codes are packed into bytes (int4 two a
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

    calibration: str | None = None
    """The calibrated methods' data: a `data.sources` entry, a path or a mapping such as
    `{path: chats.jsonl, format: chat}`; unset: the run's own held-out split."""
    samples: int = 128
    """Rows of `data.seq_len` tokens of the calibration data used (GPTQ's and AWQ's 128)."""
    gptq: GPTQConfig = GPTQConfig()
    awq: AWQConfig = AWQConfig()
    smoothquant: SmoothQuantConfig = SmoothQuantConfig()
    llm_int8: LLMInt8Config = LLMInt8Config()
    fp8_activations: bool = False
    """fp8 only: W8A8-FP8, each token's activations in E4M3 with its own scale at run time and
    an E4M3 x E4M3 dot (false: fp8 weights, activations in the compute dtype)."""

    @property
    def calibrated(self) -> bool:
        return self.method in CALIBRATED

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def validate(self) -> None:
        if not self.enabled:
            self._check_unused()
            return
        takes = METHOD_BITS[self.method]
        if self.bits not in takes:
            fail(
                f"quantize.bits={self.bits}: method {self.method} takes "
                f"{', '.join(map(str, takes))} bits."
            )
        if self.method in FIXED_GRID and (self.group_size or not self.symmetric):
            fail(
                f"method {self.method} has a fixed grid (per output channel"
                f"{', MXFP4 blocks of 32' if self.method == 'mxfp4' else ''}, symmetric): it "
                "takes no --group-size and no --asymmetric."
            )
        if self.fp8_activations and self.method != "fp8":
            fail(f"quantize.fp8_activations is fp8's; method {self.method} does not take it.")
        if not 0 <= self.smoothquant.alpha <= 1 or not self.llm_int8.threshold > 0:
            fail("quantize.smoothquant.alpha must be in [0, 1], quantize.llm_int8.threshold > 0.")
        if self.group_size < 0:
            fail(f"quantize.group_size must be >= 0 (0: per channel), not {self.group_size}.")
        if self.calibration and not self.calibrated:
            fail(
                f"quantize.calibration: method {self.method} reads no calibration data; the "
                f"calibrated methods are {', '.join(CALIBRATED)}."
            )
        if self.samples < 1:
            fail(f"quantize.samples must be at least 1, not {self.samples}.")
        check_calibration(self.calibration)
        g = self.gptq
        if g.block_size < 1 or not g.dampening >= 0:
            fail("quantize.gptq.block_size must be >= 1 and quantize.gptq.dampening >= 0.")
        if self.method == "gptq" and g.act_order and self.group_size and not g.static_groups:
            fail(
                "quantize.gptq.act_order with --group-size needs quantize.gptq.static_groups="
                "true: the checkpoint keeps contiguous groups, with no group index."
            )
        if self.awq.grid < 1:
            fail(f"quantize.awq.grid must be at least 1, not {self.awq.grid}.")
        if self.method == "gptq" and g.static_groups and not self.group_size:
            fail("quantize.gptq.static_groups needs --group-size: per channel has no groups.")
        if self.samples != QuantizeConfig.samples and not self.calibrated:
            fail(
                f"quantize.samples: method {self.method} reads no calibration data; the "
                f"calibrated methods are {', '.join(CALIBRATED)}."
            )
        for section in ("gptq", "awq", "smoothquant", "llm_int8"):
            value = getattr(self, section)
            if section != self.method and value != type(value)():
                fail(
                    f"quantize.{section}.* are method {section}'s settings; method "
                    f"{self.method} does not read them (leave them at their defaults)."
                )
        for pattern in self.skip:
            if not pattern or not isinstance(pattern, str):
                fail(f"quantize.skip: {pattern!r} is not a parameter-path pattern.")

    def _check_unused(self) -> None:
        """Fails on a key set away from its default while no method is set: it describes
        quantized weights the run does not hold, so it would do nothing."""
        for key, value, default in _fields(self, "quantize"):
            if key != "quantize.method" and value != default:
                shown = list(value) if isinstance(value, tuple) else value
                fail(
                    f"{key}={shown} does nothing: quantize.method=none, and quantize.* only "
                    "describes the weights jaxllm quantize wrote (a LoRA run on a quantized "
                    "run takes them from its base); leave it unset (train.qat.* fake-quantizes "
                    "while training)."
                )


def _fields(obj, prefix: str):
    """(dotted key, value, default) of each leaf field of the dataclass `obj`."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _fields(value, key)
        else:
            yield key, value, f.default
