"""What the engine keeps per request: its sequences (`Seq`, one per sample) and what a step
hands back (`StepResult`, `Output`)."""

from __future__ import annotations

import dataclasses
import operator

from jaxllm.infer.engine import swap
from jaxllm.infer.engine.sampling import SamplingParams


def token_ids(prompt_ids, params) -> list[int]:
    """`Engine.add_request`'s prompt as a list of ints; a TypeError for text, non-integer ids,
    or `params` that are not a `SamplingParams`."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
    try:
        return [operator.index(t) for t in prompt_ids]
    except TypeError:
        raise TypeError(
            "a prompt is a sequence of integer token ids (encode text with the run's tokenizer), "
            f"not {type(prompt_ids).__name__} {str(prompt_ids)[:40]!r}"
        ) from None


def check_request(prompt: list[int], params, cfg, page_size: int, num_pages: int) -> None:
    """ValueError when the engine cannot take the request: an empty prompt, ids outside the
    vocabulary, more tokens than the model's context or the pool's pages hold."""
    if not prompt:
        raise ValueError("an empty prompt has nothing to continue")
    if not all(0 <= t < cfg.vocab_size for t in prompt):
        bad = next(t for t in prompt if not 0 <= t < cfg.vocab_size)
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
    bad = [t for t, _ in params.logit_bias if t >= cfg.vocab_size]
    if bad:
        raise ValueError(
            f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})"
        )
    if len(prompt) + params.max_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"the model's max_seq_len ({cfg.max_seq_len})"
        )
    if -(-(len(prompt) + params.max_tokens) // page_size) > num_pages - 1:
        raise ValueError("one sequence of this request needs more pages than the pool has")


@dataclasses.dataclass
class Output:
    """One finished sample of a request."""

    request_id: int
    index: int
    """Which of the request's n samples."""
    tokens: list[int]
    finish_reason: str
    """"stop" (a stop token or stop sequence came) or "length" (max_tokens; with max_tokens 0,
    once the prompt is computed)."""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token, the `top_logprobs` most likely (token, log-prob) pairs, most likely first."""
    prompt_logprobs: list | None = None
    """With `SamplingParams.prompt_logprobs`: per prompt token None (the first) or (its
    log-probability, its rank (1: the most likely), the top `prompt_logprobs` (token,
    log-prob) pairs at its position)."""


@dataclasses.dataclass
class StepResult:
    """What one `Engine.step` produced: (request id, sample index, token) per new token shown
    (tokens that may begin a stop sequence come once they are known not to), and the samples
    that finished."""

    new_tokens: list[tuple[int, int, int]]
    finished: list[Output]
    new_logprobs: list[tuple[float, list[tuple[int, float]] | None]] = dataclasses.field(
        default_factory=list
    )
    """Per new token (in `new_tokens`' order): its log-probability and its top pairs (None
    unless the request asked for top_logprobs)."""
    prompts: list[tuple[int, int, list]] = dataclasses.field(default_factory=list)
    """(request id, sample index, `Output.prompt_logprobs`) of the samples whose prompt
    log-probabilities were completed in this step (before their first token)."""


@dataclasses.dataclass(eq=False)
class Seq:
    request_id: int
    index: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list = dataclasses.field(default_factory=list)  # per token: top (id, log-prob) pairs
    emitted: int = 0  # output tokens shown in StepResult.new_tokens
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose keys/values are in the cache
    hashed: int = 0  # leading full pages registered in the prefix cache
    last_hash: int | None = None
    slot: int | None = None
    done: bool = False
    resumed: bool = False  # preempted once: its lookups no longer count in the hit rate
    swapped: swap.Swapped | None = None  # host copy of its computed pages (`swap.save`)
    images: object = None  # the request's `vision.RequestImages`, None without images
    prompt_lp: list | None = None  # its prompt's log-probabilities once complete (`prompts`)
    prompt_partial: list | None = None  # the same while its prefill computes them
    matcher: object = None  # its structured output's `structured.Matcher`, None without

    @property
    def salts(self) -> dict | None:
        """Page index -> image digest, for its prefix keys (None without images)."""
        return None if self.images is None else self.images.salts

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out
