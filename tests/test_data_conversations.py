"""`format: chat` reads the conversation shapes of other fine-tuning tools (ShareGPT, Alpaca, TRL's
conversational prompt-completion) into the rows their messages give, in JSONL and Parquet, and
a conversational prompt-completion trains its completion only."""

import pytest
from test_data_sft import BYTES, CHATS, examples_of, rows_of, write

from jaxllm.config import ConfigError, SourceConfig

SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt"}


def decoded(src: SourceConfig) -> list[tuple[str, str]]:
    """(text, trained text) of every example of `src`, sorted."""
    return sorted((BYTES.decode(t), BYTES.decode(m)) for t, m in examples_of(rows_of(src)))


def chat(path, records) -> SourceConfig:
    return SourceConfig(path=write(path, records), format="chat")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_sharegpt_and_alpaca_give_the_rows_of_their_messages(tmp_path, suffix):
    want = decoded(chat(tmp_path / f"m{suffix}", [{"messages": c} for c in CHATS]))
    sharegpt = [
        {"conversations": [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in c]}
        for c in CHATS
    ]
    assert decoded(chat(tmp_path / f"s{suffix}", sharegpt)) == want
    renamed = SourceConfig(
        path=write(tmp_path / f"r{suffix}", [{"turns": r["conversations"]} for r in sharegpt]),
        format="chat",
        messages_field="turns",
    )
    assert decoded(renamed) == want

    alpaca = [
        {"instruction": f"Add {i} and {i}.", "input": "Be exact." * (i % 2), "output": str(2 * i)}
        for i in range(6)
    ]
    alpaca[0]["system"] = "Be brief."
    messages = [
        [
            *([{"role": "system", "content": "Be brief."}] if i == 0 else []),
            {"role": "user", "content": f"Add {i} and {i}." + "\nBe exact." * (i % 2)},
            {"role": "assistant", "content": str(2 * i)},
        ]
        for i in range(6)
    ]
    assert decoded(chat(tmp_path / f"a{suffix}", alpaca)) == decoded(
        chat(tmp_path / f"am{suffix}", [{"messages": m} for m in messages])
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_conversational_prompt_completion_trains_the_completion_only(tmp_path, suffix):
    # the prompt holds an earlier assistant turn: context, not trained (all of CHATS' turns are)
    records = [{"prompt": c[:-1], "completion": c[-1:]} for c in CHATS]
    if suffix == ".jsonl":  # a string completion is one assistant turn (Parquet: one type)
        records[0]["completion"] = "Yes."
    got = decoded(chat(tmp_path / f"p{suffix}", records))
    texts = sorted(
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c) for c in CHATS
    )
    assert [text for text, _ in got] == texts
    assert {trained for _, trained in got} == {"Yes.<|im_end|>"}


def test_conversational_records_elsewhere_say_what_reads_them(tmp_path):
    records = [{"prompt": c[:-1], "completion": c[-1:]} for c in CHATS]
    path = write(tmp_path / "p.jsonl", records)
    src = SourceConfig(path=path, format="prompt_completion")
    with pytest.raises(ConfigError, match="line 1 holds a conversational prompt .*format: chat"):
        rows_of(src, on_bad_record="fail")
    records[1]["completion"] = [{"role": "user", "content": "Yes."}]
    bad = chat(tmp_path / "b.jsonl", records)
    with pytest.raises(ConfigError, match="line 2 has a completion with a message that is not an"):
        rows_of(bad, on_bad_record="fail")
