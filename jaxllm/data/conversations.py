"""The shapes other fine-tuning tools write a conversation in, read as `chat` messages.

A `format: chat` record holds its conversation in the source's `messages_field` (default
`messages`, as TRL writes it). When the default field is absent the record may be:

    ShareGPT         {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}
    TRL prompt-completion, conversational
                     {"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}]}
    Alpaca           {"instruction": ..., "input": ..., "output": ..., "system": ...}

ShareGPT turns (in any field) map `from` to a role (human -> user, gpt -> assistant, system) and
`value` to content, as Axolotl and LLaMA-Factory read them. Alpaca's user turn is the
instruction, then its input on the next line when there is one (LLaMA-Factory's rendering); an
optional `system` string opens the conversation. The loss covers every assistant turn, except
for a conversational prompt-completion, which trains the completion only: the prompt's own
assistant turns are context, as in TRL's completion-only loss.

Images may sit beside the conversation, as LLaVA and LLaMA-Factory write them: a record-level
`image` (a path, LLaVA's) or `images` (a list of paths) whose turns say where each goes with
`<image>` in their text, in order (LLaVA's `"<image>\nWhat is this?"`); without any `<image>`,
they all go before the first user turn's text. Each becomes an image part
(`{"type": "image", "image": PATH}`, `jaxllm.data.vision_chat`) in any of the shapes above.

A `format: preference` record without a prompt field holds its prompt implicitly, as TRL's
implicit-prompt preference data does (Anthropic's HH-RLHF): `chosen` and `rejected` are whole
conversations (or texts), and the prompt is their longest common beginning, as TRL's
`extract_prompt` finds it: whole messages, or characters (a space just before the first
difference goes with the answers).
"""

from __future__ import annotations

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def _sharegpt(messages):
    """ShareGPT turns ({from, value}) as {role, content} messages; other lists unchanged."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "from" in m and "role" not in m for m in messages
    ):
        return messages
    turns = []
    for m in messages:
        turn = {k: v for k, v in m.items() if k not in ("from", "value")}
        turn["role"] = SHAREGPT_ROLES.get(m["from"], m["from"])
        turn["content"] = m.get("value")
        turns.append(turn)
    return turns


def _alpaca(record: dict) -> list[dict]:
    instruction, extra = record["instruction"], record.get("input")
    query = f"{instruction}\n{extra}" if isinstance(extra, str) and extra else instruction
    system = record.get("system")
    head = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    return [
        *head,
        {"role": "user", "content": query},
        {"role": "assistant", "content": record["output"]},
    ]


def messages_of(record: dict, field: str) -> tuple[object, int, str | None]:
    """(messages, trained, why) of a `chat` record: its conversation (checked by the caller),
    how many of its last assistant turns train (0: all), and why it holds none or None."""
    if field in record or field != "messages":
        return _sharegpt(record.get(field)), 0, None
    if "conversations" in record:
        return _sharegpt(record["conversations"]), 0, None
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, list) and completion is not None:
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        if not isinstance(completion, list) or not completion:
            return None, 0, "has a completion that is neither a string nor a list of messages"
        if any(not isinstance(m, dict) or m.get("role") != "assistant" for m in completion):
            return None, 0, "has a completion with a message that is not an assistant turn"
        return [*prompt, *completion], len(completion), None
    if isinstance(record.get("instruction"), str) and isinstance(record.get("output"), str):
        return _alpaca(record), 0, None
    return None, 0, None


IMAGE_KEYS = ("images", "image")  # record-level images: LLaMA-Factory's list, LLaVA's path
IMAGE_MARK = "<image>"  # where a record-level image goes in a turn's text


def images_of(record: dict) -> object:
    """The record-level images of a chat record (see the module docstring), or None."""
    return next((record[k] for k in IMAGE_KEYS if record.get(k) not in (None, [])), None)


def with_images(messages, record: dict) -> tuple[object, str | None]:
    """(`messages` with the record's `images_of` as image parts where `<image>` marks them,
    or before the first user turn's text; why they do not pair up, or None)."""
    found = images_of(record)
    if found is None or not isinstance(messages, list):
        return messages, None
    paths = [found] if isinstance(found, str) else found
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        return None, "has an image field that is neither a path nor a list of paths"
    texts = [m.get("content") if isinstance(m, dict) else None for m in messages]
    marks = sum(t.count(IMAGE_MARK) for t in texts if isinstance(t, str))
    if marks == 0:
        user = next(
            (n for n, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
            None,
        )
        if user is None or not isinstance(texts[user], str):
            return None, "has images but no user turn of text to put them in"
        texts[user] = IMAGE_MARK * len(paths) + texts[user]
    elif marks != len(paths):
        return None, f"has {marks} {IMAGE_MARK} mark(s) for {len(paths)} image(s)"
    queue, out = iter(paths), []
    for m, text in zip(messages, texts):
        if isinstance(text, str) and IMAGE_MARK in text:
            pieces = text.split(IMAGE_MARK)
            parts = [{"type": "text", "text": pieces[0]}]
            for piece in pieces[1:]:
                parts += [{"type": "image", "image": next(queue)}, {"type": "text", "text": piece}]
            m = {**m, "content": [p for p in parts if p.get("text") != ""]}
        out.append(m)
    return out, None


def implicit_prompt(chosen, rejected) -> tuple[object, object, object]:
    """(prompt, chosen, rejected) of an implicit-prompt preference record: the longest common
    beginning of the two conversations (lists of messages) or texts, and what follows it."""
    if not isinstance(chosen, list | str) or type(chosen) is not type(rejected):
        return None, chosen, rejected
    i = 0
    while i < min(len(chosen), len(rejected)) and chosen[i] == rejected[i]:
        i += 1
    if isinstance(chosen, str) and 0 < i < min(len(chosen), len(rejected)) and chosen[i - 1] == " ":
        i -= 1
    return chosen[:i], chosen[i:], rejected[i:]
