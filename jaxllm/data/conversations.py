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
