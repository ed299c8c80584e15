"""Chat with a trained run: a conversation rendered by its chat template, the assistant's reply
generated, and exact-match accuracy over conversations that carry their expected reply.

    chat = load_chat("runs/sft_stdlib")  # jaxllm.infer.cli.load_chat
    chat.reply([{"role": "user", "content": "Which module defines `heapq.heappush`?"}])  # "heapq"
    chat.exact_match(read_conversations("runs/stdlib_qa/test.jsonl")).accuracy

The prompt is `jaxllm.data.chat.render(messages, tok, add_generation_prompt=True)` tokenized as
SFT tokenizes conversations (text spelling a special token read as that token), so the model
sees what it was trained on up to the first token of the reply. A reply ends at the first of:
the tokenizer's EOS, a generation_config.json's `eos_token_id`, the template's end-of-turn
marker when that is one token (Llama 3's `<|eot_id|>`, ChatML's `<|im_end|>` in a tokenizer
that has it), or that marker's tokens in a row when it is text (the built-in template with the
byte tokenizer writes `<|im_end|>` as ten bytes: a stop sequence). The marker is also cut from
the decoded text, in case a BPE tokenizer spelled it with other tokens than stand-alone.

The end-of-turn marker is what the template writes right after a reply: a probe conversation is
rendered and the non-space characters after the probe reply are taken (`end_of_turn`).

A conversation of a chat JSONL (the `chat` source format, `{"messages": [...]}`) is asked up to
its last user turn; one assistant turn after it is the reference reply (what exact match
compares with), and nothing else may follow it. Exact match compares the reply and the
reference with surrounding whitespace stripped and inner runs of whitespace made one space;
decoding is greedy and runs at most as many tokens as the longest reference (plus the marker and
8), since a longer reply cannot match.

Replies are generated on the inference engine (`jaxllm.infer.engine.batch`), with the same
tokens and stops as the static generator, which still runs where the engine cannot (an
encoder-decoder, a soft prompt, a mesh with a stage or sequence axis). Conversations with image
parts (`jaxllm.infer.vision`: images in any turn, a vision-language model's run) run there too,
each request's images through the tower at its prefill.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path

from jaxllm.config import ConfigError, GenerateConfig
from jaxllm.data import chat as templates
from jaxllm.data import vision_chat
from jaxllm.infer import vision
from jaxllm.infer.engine import batch as engine_batch

_PROBE = "Probe reply 7"


@dataclasses.dataclass(frozen=True)
class EndOfTurn:
    """How a reply ends for one tokenizer and template."""

    marker: str
    """The text the template writes right after a reply (`<|im_end|>`, `<|eot_id|>`); ""
    when it writes none."""
    stop_ids: frozenset[int]
    """Token ids that end a reply: EOS, the generation config's, the marker when it is one."""
    stop_sequences: tuple[tuple[int, ...], ...]
    """The marker's ids when it is several tokens (text), ending a reply where they follow."""


@dataclasses.dataclass(frozen=True)
class Conversation:
    """What to ask (the messages up to the last user turn) and the expected reply, if any."""

    messages: tuple[dict, ...]
    reference: str | None = None
    base_dir: str | None = None
    """Where relative image paths of its parts are read (a chat JSONL's directory)."""


@dataclasses.dataclass(frozen=True)
class ExactMatch:
    """Replies to conversations with references and how many equal them."""

    replies: list[str]
    correct: list[bool]

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else 0.0


def end_of_turn(tok, stop_ids: Sequence[int] = ()) -> EndOfTurn:
    """The end-of-turn marker of `tok`'s chat template and the stops that end a reply
    (`stop_ids` added, e.g. a generation config's EOS ids)."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = templates.render(probe, tok)
    except templates.ChatError:
        text = ""
    at = text.rfind(_PROBE)
    marker = re.match(r"\s*(\S*)", text[at + len(_PROBE) :]).group(1) if at >= 0 else ""
    stops = {*stop_ids, *([tok.eos_id] if tok.eos_id is not None else [])}
    sequences: tuple[tuple[int, ...], ...] = ()
    if marker:
        ids = tuple(int(i) for i in tok.encode_offsets(marker, specials=True)[0])
        if len(ids) == 1:
            stops.add(ids[0])
        elif ids:
            sequences = (ids,)
    return EndOfTurn(marker, frozenset(stops), sequences)


def prompt_ids(messages: Sequence[dict], tok) -> list[int]:
    """The conversation rendered with the generation prompt, tokenized as SFT examples are."""
    try:
        messages = vision_chat.flatten(messages)[0]  # lists of text parts joined
        text = templates.render(messages, tok, add_generation_prompt=True)
    except templates.ChatError as e:
        raise ConfigError(f"the conversation cannot be rendered ({e}); check its roles.") from None
    return tok.encode_offsets(text, specials=True)[0].tolist()


def reply_text(ids: Sequence[int], tok, eot: EndOfTurn) -> str:
    """The reply of generated `ids`: decoded, cut at the end-of-turn marker, stripped."""
    text = tok.decode(ids)
    if eot.marker and eot.marker in text:
        text = text[: text.index(eot.marker)]
    return text.strip()


def normalize(text: str) -> str:
    """What exact match compares: whitespace stripped around and made single inside."""
    return " ".join(text.split())


def split_conversation(messages: Sequence[dict], where: str = "the conversation") -> Conversation:
    """The messages up to the last user turn and the one assistant reply after it (None when
    there is none); ConfigError naming `where` when the conversation is not one to ask."""
    if not isinstance(messages, (list, tuple)) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), (str, list)) for m in messages
    ):
        raise ConfigError(f"{where} is not a list of {{role, content}} messages; fix it.")
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise ConfigError(f"{where} has no user message to reply to; add one.")
    rest = messages[users[-1] + 1 :]
    if len(rest) > 1 or (rest and rest[0].get("role") != "assistant"):
        raise ConfigError(
            f"{where} has {len(rest)} message{'s' * (len(rest) != 1)} after its last user "
            "turn; at most one, the assistant's reference reply, may follow it."
        )
    if rest and not isinstance(rest[0]["content"], str):
        raise ConfigError(f"{where}: the reference reply (the last assistant turn) is not text.")
    return Conversation(tuple(messages[: users[-1] + 1]), rest[0]["content"] if rest else None)


def read_conversations(path: str | Path, field: str = "messages") -> list[Conversation]:
    """The conversations of a chat JSONL (one `{"messages": [...]}` per line), split as
    `split_conversation` splits them."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; give a chat JSONL file.")
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except ValueError:
            raise ConfigError(f"{where} is not valid JSON; fix it.") from None
        if not isinstance(record, dict) or field not in record:
            raise ConfigError(f"{where} has no {field!r} field; write {{{field!r}: [...]}}.")
        c = split_conversation(record[field], where)
        out.append(dataclasses.replace(c, base_dir=str(path.parent)))
    if not out:
        raise ConfigError(f"{path} holds no conversation.")
    return out


class Chat:
    """A model with its tokenizer and stops, answering conversations (greedy or sampled as
    `gen` says)."""

    def __init__(
        self, model, tok, gen: GenerateConfig = GenerateConfig(), *, stop_ids=(), mesh=None
    ):
        self.model, self.tok, self.gen, self.mesh = model, tok, gen, mesh
        self.eot = end_of_turn(tok, stop_ids)
        self.step: int | None = None  # the checkpoint's, when restored from a run

    def replies(
        self,
        conversations: Sequence[Sequence[dict] | Conversation],
        gen: GenerateConfig | None = None,
        batch_size: int = 64,
    ) -> list[str]:
        """One reply per conversation (a list of messages or a `Conversation`), generated
        `batch_size` conversations at a time."""
        gen = gen or self.gen
        bases = [c.base_dir if isinstance(c, Conversation) else None for c in conversations]
        conversations = [c.messages if isinstance(c, Conversation) else c for c in conversations]
        if any(vision.has_images(c) for c in conversations):
            return self._image_replies(conversations, gen, batch_size, bases)
        prompts = [prompt_ids(c, self.tok) for c in conversations]
        out = []
        for start in range(0, len(prompts), batch_size):
            try:
                new = engine_batch.generate(
                    self.model,
                    prompts[start : start + batch_size],
                    gen,
                    stop_tokens=sorted(self.eot.stop_ids),
                    stop_sequences=self.eot.stop_sequences,
                    mesh=self.mesh,
                )
            except ValueError as e:
                raise ConfigError(str(e)) from None
            out += [reply_text(ids, self.tok, self.eot) for ids in new.tokens]
        return out

    def _image_replies(self, conversations, gen, batch_size: int, bases) -> list[str]:
        """`replies` of conversations with image parts (relative paths read under `bases`, the
        working directory where None), on the engine with the vision tower (the prefill of a
        request runs the tower on its images)."""
        v = self.model.cfg.vision
        if v is None:
            raise ConfigError(
                "images need a vision-language model (model.vision); this run is text-only, "
                "so give a VLM's run or leave the images out."
            )
        if vision_chat.VisionTokens().pad_id(self.tok) != v.image_token_id:
            raise ConfigError(
                f"the tokenizer's image pad token is not model.vision.image_token_id "
                f"({v.image_token_id}); use the model's own tokenizer."
            )
        spec = vision.image_spec(v)
        examples = [
            vision.prompt_example(c, self.tok, spec, base_dir=b)
            for c, b in zip(conversations, bases)
        ]
        out = []
        for start in range(0, len(examples), batch_size):
            part = examples[start : start + batch_size]
            try:
                new = engine_batch.generate(
                    self.model,
                    [ids for ids, _ in part],
                    gen,
                    stop_tokens=sorted(self.eot.stop_ids),
                    stop_sequences=self.eot.stop_sequences,
                    mesh=self.mesh,
                    images=[pixels for _, pixels in part],
                )
            except ValueError as e:
                raise ConfigError(str(e)) from None
            out += [reply_text(ids, self.tok, self.eot) for ids in new.tokens]
        return out

    def reply(self, messages: Sequence[dict], gen: GenerateConfig | None = None) -> str:
        return self.replies([messages], gen)[0]

    def exact_match(
        self, conversations: Sequence[Conversation], batch_size: int = 64
    ) -> ExactMatch:
        """Greedy replies to `conversations` compared with their references (`normalize`d)."""
        if any(c.reference is None for c in conversations):
            raise ConfigError(
                "exact match needs a reference reply (a final assistant turn) in every "
                "conversation; add them."
            )
        longest = max(len(self.tok.encode(c.reference)) for c in conversations)
        marker = max((len(s) for s in self.eot.stop_sequences), default=1)
        gen = dataclasses.replace(self.gen, temperature=0.0, max_new_tokens=longest + marker + 8)
        replies = self.replies(conversations, gen, batch_size)
        correct = [normalize(r) == normalize(c.reference) for r, c in zip(replies, conversations)]
        return ExactMatch(replies, correct)
