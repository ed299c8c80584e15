"""One sample's text as its tokens arrive, cut at OpenAI `stop` strings, and its log-probabilities
in OpenAI's two shapes.

Stop strings are matched on the detokenized text, as vLLM does: a stop may span tokens, the
text ends right before it, and while streaming the last (longest stop - 1) characters are held
back until they cannot begin one. A stop in `keep` (vLLM's `include_stop_str_in_output`) stays
at the end of the text. Text is shown in whole characters only (a token that ends mid-character
waits for the next).
"""

from __future__ import annotations

from collections.abc import Sequence


class SampleText:
    """Tokens in, text out: `add` each token, `take` what can be shown, `finish` at the end."""

    def __init__(
        self, tok, stops: Sequence[str] = (), keep: Sequence[str] = (), min_tokens: int = 0
    ):
        """`keep`: the stops that stay in the text when they end it (the others are cut);
        `min_tokens`: no stop ends the text before it has this many tokens (vLLM's)."""
        self.tok, self.stops, self.keep = tok, [s for s in stops if s], set(keep)
        self.min_tokens = min_tokens
        self.hold = max(map(len, self.stops), default=1) - 1
        self.ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.tops: list = []
        self.generated = 0  # tokens received, stop string included
        self.text = ""  # decoded so far (whole characters), cut before a stop once found
        self.shown = 0  # characters taken
        self.taken = 0  # tokens whose log-probabilities were taken
        self.done = False
        self.prompt_logprobs = None  # the engine's `Output.prompt_logprobs`, when asked

    def add(self, token: int, logprob: float | None = None, top=None) -> bool:
        """Adds a token; True when it completes a stop string (the sample is then done)."""
        if self.done:
            return False
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.tops.append(top)
        self.generated += 1
        return self._decode()

    def finish(self, tokens, logprobs=None, tops=None) -> bool:
        """The engine ended the sample with these tokens (the ones added, and any it held back):
        True when a stop string is in their text after all."""
        if self.done:
            return False
        self.generated = len(tokens)
        self.ids = list(tokens)
        self.logprobs = list(logprobs) if logprobs is not None else [None] * len(tokens)
        self.tops = list(tops) if tops is not None else [None] * len(tokens)
        stopped = self._decode(final=True)
        self.done = True
        return stopped

    def _decode(self, final: bool = False) -> bool:
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return False
        if self.generated < self.min_tokens:
            self.text = text
            return False
        start = max(0, min(len(self.text), len(text)) - self.hold)
        hits = [(i, s) for s, i in ((s, text.find(s, start)) for s in self.stops) if i >= 0]
        if not hits:
            self.text = text
            return False
        at, stop = min(hits, key=lambda h: h[0])
        end = at + len(stop) if stop in self.keep else at
        self.text = text[:end]
        # keep the tokens the cut text needs (their log-probabilities go with the text)
        k = next(
            (k for k in range(len(self.ids) + 1) if len(self.tok.decode(self.ids[:k])) >= end),
            len(self.ids),
        )
        del self.ids[k:], self.logprobs[k:], self.tops[k:]
        self.done = True
        return True

    def take(self) -> tuple[str, list[tuple[int, float | None, object]]]:
        """(text not taken before, (token, log-prob, top pairs) of the tokens not taken before):
        all of it once done, else all but the held-back tail."""
        end = len(self.text) if self.done else max(self.shown, len(self.text) - self.hold)
        delta, self.shown = self.text[self.shown : end], end
        if not delta and not self.done:
            return "", []
        entries = list(zip(self.ids, self.logprobs, self.tops))[self.taken :]
        self.taken = len(self.ids)
        return delta, entries


def completion_logprobs(tok, entries, offset: int = 0) -> dict:
    """The completions API's `logprobs` object for (token, log-prob, top pairs) entries."""
    texts = [tok.decode([t]) for t, _, _ in entries]
    offsets, at = [], offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    tops = [None if top is None else {tok.decode([i]): v for i, v in top} for _, _, top in entries]
    return {
        "tokens": texts,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": tops if any(t is not None for t in tops) else None,
        "text_offset": offsets,
    }


def chat_logprobs(tok, entries) -> dict:
    """The chat API's `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(t, lp):
        text = tok.decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            {**item(t, lp), "top_logprobs": [item(i, v) for i, v in top or ()]}
            for t, lp, top in entries
        ]
    }


def echo_entries(ids, prompt_logprobs, top: int | None) -> list:
    """`echo`'s (token, log-prob, top pairs) entries of a prompt: the first token's log-prob
    is None (nothing comes before it); all None without the engine's `prompt_logprobs`."""
    lps = prompt_logprobs or [None] * len(ids)
    return [
        (t, None, None) if e is None else (t, e[0], e[2][:top] if top else None)
        for t, e in zip(ids, lps)
    ]


def vllm_prompt_logprobs(tok, ids, prompt_logprobs, top: int) -> list:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} of the token itself and the `top` most likely at its position."""

    def item(logprob, rank, t):
        return {"logprob": logprob, "rank": rank, "decoded_token": tok.decode([t])}

    out = []
    for t, e in zip(ids, prompt_logprobs or [None] * len(ids)):
        if e is None:
            out.append(None)
            continue
        logprob, rank, pairs = e
        d = {t: item(logprob, rank, t)}
        for r, (i, v) in enumerate(pairs[:top], 1):
            d.setdefault(i, item(v, r, i))
        out.append(d)
    return out
