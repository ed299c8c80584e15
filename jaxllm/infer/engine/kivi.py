"""How the engine feeds int4 / int2 (KIVI) pages: chunks that never change what a token sees.

A KIVI cache keeps the tokens of a sequence's last, incomplete quantization group (`group`
tokens, a divisor of the page size) in a full-precision residual window per slot, and
quantizes the group into its page when its last token is written (`kv_cache.CacheView`). A
query at position p then sees the earlier groups quantized and its own group's tokens up to p
at full precision, unless p completes the group. Decoding one token at a time gives exactly
that; a chunk of several tokens gives it too as long as it stays inside one group and does not
write the group's last token (that token goes alone). So a sequence's tokens see the same
cache however its prompt is cut into chunks, and a request batched with others decodes as it
does alone (prefix-shared pages hold whole groups, and a swapped-out sequence takes its
residual window with it).

Padding is the other hazard: a slot feeding fewer tokens than the step's Q writes padding
after them, into its residual window. `fit` lowers Q (and the takes above it) until no slot's
padding reaches the last token of a group, so padding never quantizes a group, and the
residual rows it overwrites are rewritten by real tokens before anyone reads them.
"""

from __future__ import annotations


def chunk_limit(start: int, group: int) -> int:
    """Tokens a sequence with `start` tokens in the cache may feed in one step: up to (not
    including) the last token of its current group, or that last token alone."""
    left = group - start % group
    return 1 if left == 1 else left - 1


def _padding_ok(start: int, take: int, q: int, group: int) -> bool:
    """Whether writing q - take tokens of padding after a slot's real ones leaves every group's
    last token alone."""
    end = start + take
    if take == q:
        return True
    if end % group == 0:  # the real tokens complete a group: padding starts the next one
        return q - take < group
    return start + q < -(-end // group) * group


def fit(starts: list[int], takes: list[int], group: int) -> list[int]:
    """The takes, lowered so that Q (the power of two at or above the largest) pads no slot
    across the last token of a group."""
    q = 1 << (max(takes) - 1).bit_length()
    while q > 1 and not all(_padding_ok(s, min(t, q), q, group) for s, t in zip(starts, takes)):
        q //= 2
    return [min(t, q) for t in takes]
