"""How a Hugging Face checkpoint's tensors relate to our parameters: `Link` (one tensor, per
layer and expert, and the reshape / transpose / split that makes it ours) and `Family` (one
`model_type`: its config mapping and its tensor layouts).

Our layout vs torch's: a projection is [in..., out...] (`q_proj` [D, H, K]) where a torch
`nn.Linear` weight is [out, in] (`q_proj.weight` [H*K, D]); GPT-2's `Conv1D` stores [in, out]
and fuses q, k, v into one `c_attn`. Stacked layers carry a leading [N] axis here and one tensor
per layer there (`{i}` in a name); MoE expert weights [N, E, ...] are one tensor per layer and
expert in Mixtral and DeepSeek-V2/V3 checkpoints (`{i}`, `{j}`), one [E, ...] tensor per layer in
transformers 5's fused layout. DeepSeek-V2/V3 blocks are two stacks here (dense, then MoE), so
the MoE stack's layer k is HF layer first_k_dense_replace + k (`Link.offset`).
"""

from __future__ import annotations

import dataclasses
import math
import string
from collections.abc import Callable

import numpy as np

from jaxllm.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Link:
    """One Hugging Face tensor (one per layer when `hf` holds `{i}`, per layer and expert when
    it also holds `{j}`) and the parameters it carries.

    Each placeholder of `hf` stands for one leading axis of `ours`, in order: our stacked
    [N, E, ...] expert weights are N * E tensors `...layers.{i}...experts.{j}...` there. The
    rest, one *element*, is transformed by kind: `same` (identical layout), `flat` (a 1-D
    tensor viewed as our [H, K]), `linear` (torch [out, in] -> ours [in..., out...], the first
    `n_in` axes of ours being inputs), `conv` (GPT-2 Conv1D [in, out] -> ours [in..., out...]).
    The first `n_lead` axes of an element stay in front on both sides (transformers 5's fused
    experts [E, out, in] are per-expert torch layouts). Several `ours` are concatenated along
    HF axis `axis` (GPT-2's fused q/k/v, Mixtral's fused gate/up), or with `interleave`
    alternated element by element along it (gpt-oss's gate_up: gate at even, up at odd
    indices). `offset` is the HF layer
    number of our first stacked layer (DeepSeek-V3's MoE blocks, stacked apart, follow its
    dense ones), and our k-th stacked layer is HF layer offset + k * `stride` (a hybrid
    stack's position p of a pattern of P blocks: offset p, stride P).
    """

    hf: str
    ours: tuple[str, ...]
    kind: str = "same"
    n_in: int = 1
    axis: int = -1
    n_lead: int = 0
    offset: int = 0
    interleave: bool = False
    stride: int = 1

    @property
    def indices(self) -> tuple[str, ...]:
        """The placeholders of `hf` (`i`: layer, `j`: expert), one per split leading axis."""
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.hf) if f)

    def counts(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """How many tensors per placeholder, given the full shapes of our parameters."""
        return tuple(shapes[self.ours[0]][: len(self.indices)])

    def name(self, index: tuple[int, ...] = ()) -> str:
        numbers = [
            k * self.stride + self.offset if f == "i" else k for f, k in zip(self.indices, index)
        ]
        return self.hf.format(**dict(zip(self.indices, numbers)))

    def _part_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        lead, rest = tuple(shape[: self.n_lead]), shape[self.n_lead :]
        if self.kind == "same":
            return tuple(shape)
        if self.kind == "flat":
            return (*lead, math.prod(rest))
        ins, outs = math.prod(rest[: self.n_in]), math.prod(rest[self.n_in :])
        return (*lead, *((outs, ins) if self.kind == "linear" else (ins, outs)))

    def hf_shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The HF tensor's shape, given the element shapes of `ours`."""
        parts = [self._part_shape(s) for s in shapes]
        if len(parts) == 1:
            return parts[0]
        out = list(parts[0])
        out[self.axis] = sum(p[self.axis] for p in parts)
        return tuple(out)

    def to_ours(self, w: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
        parts = [w]
        if len(shapes) > 1 and self.interleave:
            n, axis = len(shapes), self.axis % w.ndim
            parts = [w[(slice(None),) * axis + (slice(j, None, n),)] for j in range(n)]
        elif len(shapes) > 1:
            sizes = np.cumsum([self._part_shape(s)[self.axis] for s in shapes])[:-1]
            parts = np.split(w, sizes, axis=self.axis)
        return [self._one_to_ours(p, s) for p, s in zip(parts, shapes)]

    def _one_to_ours(self, w: np.ndarray, shape) -> np.ndarray:
        if self.kind == "linear":
            w = np.swapaxes(w, -1, -2)
        return np.ascontiguousarray(w.reshape(shape))

    def _one_to_hf(self, x: np.ndarray) -> np.ndarray:
        if self.kind != "linear":
            return x.reshape(self._part_shape(x.shape))
        lead, rest = x.shape[: self.n_lead], x.shape[self.n_lead :]
        return np.swapaxes(x.reshape(*lead, math.prod(rest[: self.n_in]), -1), -1, -2)

    def to_hf(self, xs: list[np.ndarray]) -> np.ndarray:
        parts = [self._one_to_hf(x) for x in xs]
        if len(parts) > 1 and self.interleave:  # [..., n, ...] stacked after the axis, merged
            axis = self.axis % parts[0].ndim
            stacked = np.stack(parts, axis=axis + 1)
            shape = list(parts[0].shape)
            shape[axis] *= len(parts)
            return np.ascontiguousarray(stacked.reshape(shape))
        out = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=self.axis)
        return np.ascontiguousarray(out)


SCORE_HEAD = Link("score.weight", ("score",), "linear")
"""A reward model's head, as every `*ForSequenceClassification` of transformers names it:
torch's [num_labels = 1, D] for our [D, 1]."""


@dataclasses.dataclass(frozen=True)
class TwoLabelHead(Link):
    """A process reward model's head as transformers' `*ForTokenClassification` with TRL's two
    labels holds it: torch [2, D] whose row 1 minus row 0 is our [D, 1] score s (the logit
    difference, so softmax(logits)[1] = sigmoid(s)); written back as the rows (0, s)."""

    def hf_shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        return (2, *super().hf_shape(shapes)[1:])

    def to_ours(self, w: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
        w = np.asarray(w, np.float32)
        return super().to_ours(w[1:] - w[:1], shapes)

    def to_hf(self, xs: list[np.ndarray]) -> np.ndarray:
        w = super().to_hf(xs)
        return np.concatenate([np.zeros_like(w), w])


PRM_HEAD = TwoLabelHead("score.weight", ("score",), "linear")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    to_model: Callable[[dict], dict]
    to_hf: Callable[[ModelConfig], dict]
    links: Callable[[ModelConfig], list[Link]]
    """The tensor layout export writes (and import reads first)."""
    ignore: tuple[str, ...] = ()
    """Suffixes of tensors that are not parameters (non-persistent buffers in old files)."""
    other_links: tuple[Callable[[ModelConfig], list[Link]], ...] = ()
    """Other tensor layouts import accepts (Mixtral: transformers 5's fused experts)."""
    skip: Callable[[ModelConfig, str], bool] | None = None
    """Tensors import leaves unread, by name (DeepSeek-V3's multi-token-prediction layers)."""
    file_fields: Callable[[frozenset[str]], dict] | None = None
    """ModelConfig fields that the files' tensor names decide rather than config.json (BERT's
    pooler: whether the file holds one); export leaves them to the parameters."""
    score_head: Link = SCORE_HEAD
    """The score head's tensor (`token_classifier`: a process reward model's two labels)."""

    def layouts(self, cfg: ModelConfig) -> list[list[Link]]:
        """The tensor layouts of `cfg`, the one export writes first (with `cfg`'s head)."""
        return [
            with_head(links, cfg, self.score_head)
            for links in (self.links(cfg), *(f(cfg) for f in self.other_links))
        ]

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        """Whether import may leave the tensor `name` unmapped."""
        skipped = self.skip is not None and self.skip(cfg, name)
        return skipped or any(name.endswith(s) for s in self.ignore)


def with_head(links: list[Link], cfg: ModelConfig, score_head: Link = SCORE_HEAD) -> list[Link]:
    """A family's links for `cfg`'s head: as they are for an LM, else the LM head's link
    replaced by the score head's (and its bias's, `model.score_bias`)."""
    if cfg.head == "lm":
        return links
    # `flat`, not `same`: import reads a `same` tensor's slice as it is, past TwoLabelHead
    bias = dataclasses.replace(score_head, hf="score.bias", ours=("score_bias",), kind="flat")
    head = [score_head, bias] if cfg.score_bias else [score_head]
    return [link for link in links if link.ours != ("lm_head",)] + head


def token_classifier(family: Family) -> Family:
    """`family` as a process reward model's `*ForTokenClassification` (`PRM_HEAD`)."""
    return dataclasses.replace(family, score_head=PRM_HEAD)
