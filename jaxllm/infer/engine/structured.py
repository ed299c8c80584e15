"""Structured outputs (guided decoding): a sample held to a JSON schema, any JSON object, a
regular expression, one of several strings or a Lark grammar, with llguidance.

Each guided sample keeps a host-side matcher (`llguidance.LLMatcher`) over the engine's
tokenizer. Before a step, every guided slot that samples in it gets its allowed tokens as a
bitmask row (bit t % 32 of word t // 32 of an int32 [S, ceil(V / 32)] array; other rows all
ones), and the device sets the disallowed logits to -inf after `logit_bias`, before the
penalties and sampling (`allow`). A step with no guided slot sends no mask: it runs the program
of before, its logits bit for bit; a step with one runs a second program per (Q, width) bucket,
compiled once. After the step the sampled token advances the matcher. The stop tokens are
allowed only while the matcher accepts, and a matcher that can take no more tokens ends the
sample (reason "stop"). A preempted sample keeps its matcher: it advances only on sampled
tokens, never on recomputed ones.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np

KINDS = ("json", "json_object", "regex", "choice", "grammar")
COMPACT = {"whitespace_flexible": False}
"""JSON without whitespace between its tokens (a schema's "x-guidance" may allow it): a model
cannot spend its tokens on indentation."""


@dataclasses.dataclass(frozen=True)
class Structured:
    """What a sample's text must be: exactly one of these."""

    json: str | dict | None = None
    """A JSON schema (a dict, or its JSON text)."""
    json_object: bool = False
    """Any JSON object."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: tuple[str, ...] | None = None
    """One of these strings, exactly."""
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect), from its `start` rule."""

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured output takes exactly one of {', '.join(KINDS)} (got {given or 'none'})"
            )
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        choice = self.choice
        if choice is not None:
            if isinstance(choice, str) or not choice or not all(isinstance(c, str) for c in choice):
                raise ValueError("structured choice: a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("json", "regex", "grammar"):
            if not isinstance(getattr(self, name), str | None):
                raise ValueError(f"structured {name}: expected a string")
        if self.json_object not in (True, False):
            raise ValueError("structured json_object: expected true or false")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self, llg) -> str:
        """llguidance's grammar for this constraint (`llg`: the llguidance module)."""
        m = llg.LLMatcher
        if self.json is not None or self.json_object:  # compact: no whitespace between tokens
            schema = self.json if self.json is not None else {"type": "object"}
            return m.grammar_from_json_schema(schema, defaults=COMPACT)
        if self.regex is not None:
            return m.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llg.grammar_from("choice", list(self.choice))
        return m.grammar_from_lark(self.grammar)


def structured_of(value) -> Structured | None:
    """`SamplingParams.structured` from a `Structured`, a dict of its fields, or None."""
    if value is None or isinstance(value, Structured):
        return value
    if not isinstance(value, dict) or set(value) - set(KINDS):
        raise ValueError(f"structured takes a Structured or a dict of {', '.join(KINDS)}")
    return Structured(**value)


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError:
        raise ValueError(
            "structured outputs need llguidance: pip install 'jaxllm[serve]' (or llguidance)"
        ) from None
    return llguidance


class _ByteVocab:
    """The byte tokenizer as llguidance reads a vocabulary: ids 0..255 are bytes, BOS / EOS
    have none."""

    def __init__(self, tok):
        self.eos_token_id, self.bos_token_id = tok.eos_id, tok.bos_id
        self.tokens = [bytes([i]) for i in range(256)] + [b""] * (tok.vocab_size - 256)
        self.special_token_ids = [tok.bos_id, tok.eos_id]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class Guide:
    """Makes the matchers of an engine's guided requests; the tokenizer is wrapped for
    llguidance once, on the first guided request."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltok = None

    def _ll_tokenizer(self, llg):
        if self._lltok is not None:
            return self._lltok
        tok = self.tokenizer
        if tok is None:
            raise ValueError("structured outputs need the engine's tokenizer: Engine(tokenizer=)")
        if hasattr(tok, "to_str"):  # a Hugging Face tokenizer.json
            try:
                lltok = llg.LLTokenizer(tok.to_str(), eos_token=tok.eos_id)
            except Exception as e:  # llguidance's reader refuses some tokenizers
                msg = f"structured outputs: llguidance cannot read {tok.name}: {e}"
                raise ValueError(msg) from None
        elif getattr(tok, "name", None) == "byte":
            lltok = llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(tok)))
        else:
            raise ValueError(
                "structured outputs take the byte tokenizer or a Hugging Face tokenizer.json, "
                f"not {type(tok).__name__}"
            )
        if lltok.vocab_size > self.vocab_size:
            raise ValueError(
                f"the tokenizer's {lltok.vocab_size} ids exceed the model's vocabulary "
                f"({self.vocab_size})"
            )
        self._lltok = lltok
        return lltok

    def matchers(self, params) -> list | None:
        """One `Matcher` per sample of a request with `params.structured` (None without);
        ValueError naming the problem when its schema, regex or grammar is invalid."""
        spec = params.structured
        if spec is None:
            return None
        llg = _llguidance()
        lltok = self._ll_tokenizer(llg)
        grammar = check(spec, lltok)
        return [Matcher(llg.LLMatcher(lltok, grammar, log_level=0), lltok) for _ in range(params.n)]


def check(spec: Structured, lltok=None) -> str:
    """llguidance's grammar of `spec`, checked (against `lltok`, an `llguidance.LLTokenizer`,
    when given); ValueError naming the problem when it is invalid or llguidance is missing."""
    llg = _llguidance()
    try:
        grammar = spec.grammar_text(llg)
    except ValueError as e:
        raise ValueError(f"structured {spec.kind}: {e}") from None
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if failed:
        # one line: llguidance's message without its excerpt of the grammar and carets
        lines = [ln.strip() for ln in messages[0].splitlines()]
        text = " ".join(ln for ln in lines if ln.strip("^") and "|" not in ln[:6])
        raise ValueError(f"structured {spec.kind}: {text}")
    return grammar


class Matcher:
    """One sample's matcher and the bitmask words its tokenizer fills."""

    def __init__(self, matcher, lltok):
        self.matcher = matcher
        self.words = -(-lltok.vocab_size // 32)
        self.eos = sorted(set(lltok.eos_tokens))

    def fill(self, row_B: np.ndarray, stop_tokens) -> None:
        """Writes the tokens allowed next into `row_B` (int32 words, zeroed first): ids past
        the tokenizer's vocabulary never; the stop tokens (and no other end token) only while
        the matcher accepts."""
        row_B[:] = 0
        view_B = row_B[: self.words]
        self.matcher.unsafe_compute_mask_ptr(view_B.ctypes.data, view_B.nbytes)
        bits_B = row_B.view(np.uint32)
        for t in self.eos:
            bits_B[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        if self.matcher.is_accepting():
            for t in stop_tokens:
                bits_B[t >> 5] |= np.uint32(1 << (t & 31))

    def advance(self, token: int) -> bool:
        """Consumes a sampled token; whether the sample is complete (the matcher takes no
        more tokens)."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped()


def masks(batch, slots: int, vocab_size: int) -> np.ndarray | None:
    """The step's allowed-token bitmask [S, ceil(V / 32)] (None when no slot is guided):
    all ones in unguided rows and in rows that are mid-prefill (their sample is not used)."""
    guided = [(seq, take) for seq, take in batch if seq.matcher is not None]
    if not guided:
        return None
    mask_SxB = np.full((slots, -(-vocab_size // 32)), -1, np.int32)
    for seq, take in guided:
        if seq.computed + take == len(seq.tokens):
            seq.matcher.fill(mask_SxB[seq.slot], seq.params.stop_tokens)
    return mask_SxB


def advance(seq, token: int) -> bool:
    """Advances a guided sample's matcher on its sampled token (a stop token ends the sample
    anyway); whether the sample is now complete."""
    if seq.matcher is None or token in seq.params.stop_tokens:
        return False
    return seq.matcher.advance(token)


def allow(logits_SxV, allowed_SxB):
    """Logits with the tokens whose bit is 0 at -inf (rows of all ones bit for bit)."""
    s, v = logits_SxV.shape
    bits_SxBx32 = (allowed_SxB[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None]) & 1
    ok_SxV = bits_SxBx32.reshape(s, -1)[:, :v] != 0
    return jnp.where(ok_SxV, logits_SxV, -jnp.inf)
