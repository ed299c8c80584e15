"""Per-request sampling: `SamplingParams`, the device-side row sampler and the host-side stop
rules.

On the device, `sample_rows` takes one row of logits per slot and each slot's own parameters
as arrays ([S] each), so a batch of requests with different temperatures, filters, penalties
and seeds runs in one fixed-shape program. Penalties follow vLLM's sampler: repetition (HF's
CTRL rule: a logit of a token seen in the prompt or the output is divided by p when positive,
multiplied by p when negative), then OpenAI's frequency and presence penalties over the output
tokens, then temperature, then top-k / top-p / min-p. The counts come from each slot's token
history ([S, M], M the model's context) scattered into [S, V] on the device, only when some row
asks for a penalty (`lax.cond`), so a batch without penalties computes exactly what it did
before they existed. Log-probabilities are the model's own (log-softmax of the raw logits, as
vLLM returns by default); the top `MAX_TOP_LOGPROBS` come from one `lax.top_k` every step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.infer.engine.structured import Structured, allow, structured_of

MAX_TOP_LOGPROBS = 20
"""The most top log-probabilities a request may ask for (OpenAI's limit): the device always
computes this many, one compile."""

MAX_LOGIT_BIAS = 300
"""The most `logit_bias` entries a request may give (OpenAI's limit)."""

BIAS_WIDTH = 512
"""Entries of each slot's sparse bias list: its `logit_bias` and, before `min_tokens`, its stop
tokens masked (one shape, one compile)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is continued (defaults: greedy, 16 tokens)."""

    max_tokens: int = 16
    """New tokens per sample at most (a stop token ends it earlier and is not returned); 0
    computes the prompt only (with `prompt_logprobs`, to score it) and samples nothing: the
    sample ends with reason "length" once its prompt is in the cache."""
    temperature: float = 0.0
    """0 is greedy (argmax); the filters below apply only when sampling."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    min_p: float = 0.0
    """Keep tokens at least min_p times as likely as the most likely one."""
    repetition_penalty: float = 1.0
    """> 0: logits of tokens in the prompt or output are divided by it (positive logits) or
    multiplied by it (negative ones); 1 is off (HF / vLLM semantics)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that occurs in the output (OpenAI)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it occurs in the output (OpenAI)."""
    stop_tokens: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token sequences that end a sample when its output ends with one; the sequence is not
    returned (unless include_stop), and tokens that may begin one are held back from
    `StepResult.new_tokens` until they are known not to."""
    include_stop: bool = False
    """Return the stop token or stop sequence that ended a sample."""
    seed: int | None = None
    """The draws of sample j depend only on (seed, j, token index); None: the request id."""
    n: int = 1
    """Independent samples of the prompt; they share the prompt's full pages."""
    logprobs: bool = False
    """Return each new token's log-probability under the model (before penalties and
    temperature)."""
    top_logprobs: int = 0
    """Also return, per new token, the `top_logprobs` (<= 20) most likely (token, log-prob)
    pairs under the model."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in [-100, 100]) pairs added to the logits before sampling and greedy
    choice (OpenAI's `logit_bias`; a dict is taken too). Log-probabilities stay the model's."""
    min_tokens: int = 0
    """Stop tokens and stop sequences cannot end a sample before it has this many tokens: the
    stop tokens' logits are -inf until then (vLLM's `min_tokens`)."""
    prompt_logprobs: int | None = None
    """Return the log-probability of each prompt token after the first under the model, and
    the top `prompt_logprobs` (<= 20) pairs at each position (None: off). The prompt is then
    computed, not read from the prefix cache."""
    structured: Structured | None = None
    """The text the sample must be (a `Structured`, or a dict of its fields): a JSON schema,
    any JSON object, a regex, a choice of strings or a Lark grammar (`structured`; needs the
    engine's tokenizer and llguidance)."""

    def __post_init__(self):
        object.__setattr__(self, "structured", structured_of(self.structured))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = tuple(sorted({int(t): float(b) for t, b in bias}.items()))
        object.__setattr__(self, "logit_bias", bias)
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
        if any(t < 0 or not -100 <= b <= 100 for t, b in bias):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if self.min_tokens and len(bias) + len(set(self.stop_tokens)) > BIAS_WIDTH:
            raise ValueError(
                f"min_tokens masks the stop tokens: at most {BIAS_WIDTH} of them and logit_bias "
                "entries together"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        seqs = tuple(tuple(int(t) for t in s) for s in self.stop_sequences)
        object.__setattr__(self, "stop_sequences", seqs)
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        if self.max_tokens < 0 or self.n < 1:
            raise ValueError("max_tokens must be at least 0 and n at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and 0 <= min_p <= 1")
        if self.top_k < 0 or self.repetition_penalty <= 0:
            raise ValueError("top_k >= 0 and repetition_penalty > 0")
        penalties = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        if not all(map(math.isfinite, (self.temperature, *penalties))):
            raise ValueError("temperature and the penalties must be finite numbers")
        # a top_k beyond the vocabulary keeps every token: held in the step's int32 rows
        object.__setattr__(self, "top_k", min(int(self.top_k), 2**31 - 1))
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if any(not s for s in seqs):
            raise ValueError("a stop sequence needs at least one token")

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) != (
            1.0,
            0.0,
            0.0,
        )


class Rows(NamedTuple):
    """Each slot's sampling parameters for one device step, [S] each (history [S, M])."""

    temp_S: jax.Array
    top_k_S: jax.Array
    top_p_S: jax.Array
    min_p_S: jax.Array
    seed_S: jax.Array
    count_S: jax.Array
    """Tokens the sample has produced so far: the draw's index."""
    rep_S: jax.Array
    presence_S: jax.Array
    frequency_S: jax.Array
    history_SxM: jax.Array
    """The slot's tokens (prompt then output), read up to length_S."""
    prompt_len_S: jax.Array
    length_S: jax.Array
    """0 for a slot without penalties: nothing of its history is read."""
    bias_ids_SxW: jax.Array
    bias_SxW: jax.Array
    """Added to the logits of bias_ids_SxW (0 in unused entries): logit_bias, -inf on the stop
    tokens before min_tokens."""
    allowed_SxB: jax.Array | None = None
    """Structured outputs' allowed tokens, one bit each ([S, ceil(V / 32)] int32, all ones in
    unguided rows); None (a program without it) when no slot is guided."""


def _bias(logits_SxV, r: Rows):
    s, w = r.bias_ids_SxW.shape
    rows_SxW = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[:, None], (s, w))
    ids_SxW = jnp.clip(r.bias_ids_SxW, 0, logits_SxV.shape[-1] - 1)
    biased_SxV = logits_SxV.at[rows_SxW, ids_SxW].add(r.bias_SxW)
    # rows without entries keep their logits bit for bit
    return jnp.where(jnp.any(r.bias_SxW != 0, axis=1)[:, None], biased_SxV, logits_SxV)


def _penalize(logits_SxV, r: Rows):
    s, v = logits_SxV.shape
    m = r.history_SxM.shape[1]
    pos_1xM = jnp.arange(m, dtype=jnp.int32)[None]
    seen_SxM = pos_1xM < r.length_S[:, None]
    out_SxM = seen_SxM & (pos_1xM >= r.prompt_len_S[:, None])
    rows_SxM = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[:, None], (s, m))
    ids_SxM = jnp.clip(r.history_SxM, 0, v - 1)
    seen_SxV = jnp.zeros((s, v), jnp.int32).at[rows_SxM, ids_SxM].add(seen_SxM) > 0
    count_SxV = jnp.zeros((s, v), jnp.int32).at[rows_SxM, ids_SxM].add(out_SxM)
    rep_Sx1 = r.rep_S[:, None]
    repeated_SxV = jnp.where(logits_SxV > 0, logits_SxV / rep_Sx1, logits_SxV * rep_Sx1)
    out_SxV = jnp.where(seen_SxV, repeated_SxV, logits_SxV)
    out_SxV = out_SxV - r.frequency_S[:, None] * count_SxV
    out_SxV = out_SxV - r.presence_S[:, None] * (count_SxV > 0)
    # rows without penalties keep their logits bit for bit
    on_S = (r.rep_S != 1) | (r.presence_S != 0) | (r.frequency_S != 0)
    return jnp.where(on_S[:, None], out_SxV, logits_SxV)


def sample_rows(logits_SxV, r: Rows):
    """(token [S], its log-probability under the model [S], the top K = min(MAX_TOP_LOGPROBS,
    V) tokens [S, K] and their log-probabilities [S, K]): per-row logit bias, penalties, temperature (0 greedy),
    top-k (0 off), top-p, min-p (keep tokens with probability >= min_p x the largest), drawn
    with the key fold_in(key(seed), count), so a token's draw depends on its request's seed and
    index only (a recomputed or rescheduled sequence draws the same)."""
    logits_SxV = logits_SxV.astype(jnp.float32)
    logp_SxV = jax.nn.log_softmax(logits_SxV, axis=-1)
    k = min(MAX_TOP_LOGPROBS, logp_SxV.shape[-1])  # a vocabulary may be smaller
    top_logp_SxK, top_ids_SxK = jax.lax.top_k(logp_SxV, k)
    logits_SxV = jax.lax.cond(jnp.any(r.bias_SxW != 0), _bias, lambda x, _: x, logits_SxV, r)
    if r.allowed_SxB is not None:
        logits_SxV = allow(logits_SxV, r.allowed_SxB)
    any_penalty = jnp.any((r.rep_S != 1) | (r.presence_S != 0) | (r.frequency_S != 0))
    logits_SxV = jax.lax.cond(any_penalty, _penalize, lambda x, _: x, logits_SxV, r)
    greedy_S = jnp.argmax(logits_SxV, axis=-1).astype(jnp.int32)
    v = logits_SxV.shape[-1]
    scaled_SxV = logits_SxV / jnp.where(r.temp_S > 0, r.temp_S, 1.0)[:, None]
    sorted_SxV = -jnp.sort(-scaled_SxV, axis=-1)
    k_S = jnp.where((r.top_k_S > 0) & (r.top_k_S < v), r.top_k_S, v)
    kth_Sx1 = jnp.take_along_axis(sorted_SxV, (k_S - 1)[:, None], axis=1)
    probs_SxV = jax.nn.softmax(sorted_SxV, axis=-1)
    before_SxV = jnp.cumsum(probs_SxV, axis=-1) - probs_SxV  # mass of more likely tokens
    keep_SxV = before_SxV < r.top_p_S[:, None]
    nucleus_Sx1 = jnp.min(jnp.where(keep_SxV, sorted_SxV, jnp.inf), axis=-1, keepdims=True)
    log_min_p_S = jnp.where(r.min_p_S > 0, jnp.log(jnp.maximum(r.min_p_S, 1e-30)), -jnp.inf)
    min_p_Sx1 = sorted_SxV[:, :1] + log_min_p_S[:, None]
    cut_Sx1 = jnp.maximum(jnp.maximum(kth_Sx1, nucleus_Sx1), min_p_Sx1)
    filtered_SxV = jnp.where(scaled_SxV < cut_Sx1, jnp.finfo(jnp.float32).min, scaled_SxV)
    keys_S = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(r.seed_S, r.count_S)
    drawn_S = jax.vmap(jax.random.categorical)(keys_S, filtered_SxV).astype(jnp.int32)
    tok_S = jnp.where(r.temp_S > 0, drawn_S, greedy_S)
    logp_S = jnp.take_along_axis(logp_SxV, tok_S[:, None], axis=1)[:, 0]
    return tok_S, logp_S, top_ids_SxK.astype(jnp.int32), top_logp_SxK


class RowBuilder:
    """Fills the host arrays of `Rows` for one step. Token histories are kept per slot on the
    host and sent only when a row of the step has a penalty (otherwise the last device copy
    is reused: the shapes, hence the compiled program, never change)."""

    def __init__(self, slots: int, context: int):
        self.history_SxM = np.zeros((slots, context), np.int32)
        self._owner: list[object] = [None] * slots
        self._written = [0] * slots
        self._device = None
        self._bias = None  # (host ids, host values, their device copies) last sent

    def build(self, seqs, put=None) -> Rows:
        """The rows of the sequences that run (each with its `slot`, `params`, `seed`, `out`,
        `prompt`); `put` moves host arrays to the device (default `jnp.asarray` each)."""
        put = put or (lambda *arrays: tuple(map(jnp.asarray, arrays)))
        s = self.history_SxM.shape[0]
        temp, top_p, min_p, rep, pres, freq = (np.zeros(s, np.float32) for _ in range(6))
        top_k, seed, count, prompt_len, length = (np.zeros(s, np.int32) for _ in range(5))
        top_p[:], rep[:] = 1.0, 1.0
        send = False
        bias_ids, bias = np.zeros((s, BIAS_WIDTH), np.int32), np.zeros((s, BIAS_WIDTH), np.float32)
        for seq in seqs:
            r, p = seq.slot, seq.params
            temp[r], top_k[r], top_p[r], min_p[r] = p.temperature, p.top_k, p.top_p, p.min_p
            seed[r], count[r] = seq.seed, len(seq.out)
            entries = list(p.logit_bias)
            if len(seq.out) < p.min_tokens:
                entries += [(t, -np.inf) for t in sorted(set(p.stop_tokens))]
            if entries:
                bias_ids[r, : len(entries)], bias[r, : len(entries)] = zip(*entries)
            if p.penalized:
                rep[r], pres[r], freq[r] = (
                    p.repetition_penalty,
                    p.presence_penalty,
                    p.frequency_penalty,
                )
                self.write(r, seq, seq.prompt + seq.out)
                prompt_len[r], length[r], send = (
                    len(seq.prompt),
                    len(seq.prompt) + len(seq.out),
                    True,
                )
        if send or self._device is None:
            (self._device,) = put(self.history_SxM)
        small = put(temp, top_k, top_p, min_p, seed, count, rep, pres, freq, prompt_len, length)
        last = self._bias
        if last is None or not (
            np.array_equal(last[0], bias_ids) and np.array_equal(last[1], bias)
        ):
            self._bias = last = (bias_ids, bias, *put(bias_ids, bias))  # sent when it changes
        return Rows(*small[:9], self._device, *small[9:], *last[2:])

    def write(self, slot: int, key: object, tokens: list[int]) -> None:
        """Copies a sequence's tokens into its slot's history (only the new ones when the slot
        still holds the same sequence)."""
        if self._owner[slot] is not key:
            self._owner[slot], self._written[slot] = key, 0
        start = self._written[slot]
        self.history_SxM[slot, start : len(tokens)] = tokens[start:]
        self._written[slot] = len(tokens)


def stop_match(out: list[int], p: SamplingParams) -> int:
    """The length of the stop sequence `out` ends with (0: none)."""
    for seq in p.stop_sequences:
        if len(out) >= len(seq) and tuple(out[-len(seq) :]) == seq:
            return len(seq)
    return 0


def held_back(out: list[int], p: SamplingParams) -> int:
    """How many trailing tokens of `out` may begin a stop sequence (they are not shown yet)."""
    best = 0
    for seq in p.stop_sequences:
        for k in range(min(len(seq) - 1, len(out)), best, -1):
            if tuple(out[-k:]) == seq[:k]:
                best = k
                break
    return best


def accept(
    seq, token: int, logprob: float, top, complete: bool = False
) -> tuple[list[int], str | None]:
    """Adds a sampled token to `seq` (its `out`, `logprobs` and `top`; `top` is the token's
    top (id, log-prob) pairs or None) under its stop rules (`complete`: its structured output
    is complete, a stop). Returns ((token, log-prob, top) of
    each token shown now, the finish reason or None): tokens that may begin a stop sequence are shown once they are
    known not to (or when the sample ends), and a stop that ends the sample is dropped unless
    include_stop."""
    p = seq.params
    reason = "stop" if token in p.stop_tokens else None
    if reason is None or p.include_stop:
        seq.out.append(token)
        seq.logprobs.append(logprob)
        seq.top.append(top)
    if reason is None:
        k = stop_match(seq.out, p) if len(seq.out) >= p.min_tokens else 0
        if k:
            reason = "stop"
            if not p.include_stop:
                del seq.out[-k:], seq.logprobs[-k:], seq.top[-k:]
        elif complete:
            reason = "stop"
        elif len(seq.out) >= p.max_tokens:
            reason = "length"
    end = len(seq.out) if reason else len(seq.out) - held_back(seq.out, p)
    a = seq.emitted
    shown = list(zip(seq.out[a:end], seq.logprobs[a:end], seq.top[a:end]))
    seq.emitted = max(a, end)
    return shown, reason
