"""SFT sources end to end through the data pipeline: chat and prompt/completion records in JSONL
and Parquet, the loss mask, whole-example packing with truncation or drop, bad records, and
prepared shards that give the same rows."""

import json
import os
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxllm import JaxllmWarning
from jaxllm.cli import main
from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data import tokenizer as tokenizer_lib
from jaxllm.data.pipeline import load_splits

BYTES = tokenizer_lib.ByteTokenizer()
CHATS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is {i} + {i}?"},
        {"role": "assistant", "content": f"{2 * i}."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]
    for i in range(12)
]
PAIRS = [(f"Q: {i} + {i} = ", f"{2 * i}") for i in range(12)]


def write(path, records):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def chat_file(path, chats=CHATS):
    return write(path, [{"conv": c} for c in chats])


def pair_file(path, pairs=PAIRS):
    return write(path, [{"q": p, "a": c} for p, c in pairs])


def rows_of(src: SourceConfig, **data) -> list[dict]:
    """Every row of `src` (also its eval source, so no file split is needed)."""
    cfg = DataConfig(sources=(src,), eval_sources=(src,), **{"seq_len": 256, **data})
    rows = load_splits(cfg)[0]
    return [rows[i] for i in range(len(rows))]


def examples_of(rows) -> list[tuple[list[int], list[int]]]:
    """(all tokens, trained targets) of every example, in row order; checks each is whole."""
    out = []
    for row in rows:
        for s in range(1, row["segment_ids"].max() + 1):
            at = row["segment_ids"] == s
            assert row["positions"][at].tolist() == list(range(at.sum()))  # restart per example
            tokens = [*row["inputs"][at], row["targets"][at][-1]]
            out.append((tokens, row["targets"][at & (row["loss_mask"] == 1)].tolist()))
        assert not row["loss_mask"][row["segment_ids"] == 0].any()  # padding is never trained
    return out


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_chat_and_prompt_completion_with_renamed_fields(tmp_path, suffix):
    src = SourceConfig(
        path=chat_file(tmp_path / f"c{suffix}"), format="chat", messages_field="conv"
    )
    got = sorted(
        (BYTES.decode(tokens), BYTES.decode(trained))
        for tokens, trained in examples_of(rows_of(src))
    )
    want = sorted(
        (
            "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c),
            f"{c[2]['content']}<|im_end|>Yes.<|im_end|>",
        )
        for c in CHATS
    )
    assert got == want  # no BOS/EOS: the template owns them; the trailing \n is not trained

    src = SourceConfig(
        path=pair_file(tmp_path / f"p{suffix}"),
        format="prompt_completion",
        prompt_field="q",
        completion_field="a",
    )
    examples = examples_of(rows_of(src))
    assert sorted(BYTES.decode(t) for t, _ in examples) == sorted(p + c for p, c in PAIRS)
    assert sorted(BYTES.decode(m) for _, m in examples) == sorted(c for _, c in PAIRS)
    for tokens, trained in examples:
        assert tokens[0] == BYTES.bos_id and tokens[-1] == trained[-1] == BYTES.eos_id


def test_jsonl_and_parquet_give_the_same_rows_and_train_on_prompt(tmp_path):
    jsonl = SourceConfig(path=chat_file(tmp_path / "c.jsonl"), format="chat", messages_field="conv")
    parquet = SourceConfig(
        path=chat_file(tmp_path / "c.parquet"), format="chat", messages_field="conv"
    )
    for a, b in zip(rows_of(jsonl), rows_of(parquet), strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    for row in rows_of(jsonl, train_on_prompt=True):
        np.testing.assert_array_equal(row["loss_mask"], row["segment_ids"] > 0)


def test_long_examples_are_truncated_or_dropped_and_counted(tmp_path):
    pairs = [*PAIRS[:4], ("P" * 20, "C" * 30), ("P" * 60, "C")]  # > 33 tokens: the last two
    path = pair_file(tmp_path / "p.jsonl", pairs)
    src = SourceConfig(path, "prompt_completion", prompt_field="q", completion_field="a")
    with pytest.warns(
        JaxllmWarning, match="2 of 6 examples .* cut .*; 1 had no trained token within a row"
    ):
        examples = examples_of(rows_of(src, seq_len=32))
    assert len(examples) == 5
    cut = [e for e in examples if len(e[0]) == 33]  # the first 33 tokens: BOS, 20 P, 12 C
    assert BYTES.decode(cut[0][0]) == "P" * 20 + "C" * 12 and BYTES.decode(cut[0][1]) == "C" * 12
    with pytest.warns(JaxllmWarning, match="2 of 6 examples .* left out .*truncation=drop"):
        assert len(examples_of(rows_of(src, seq_len=32, truncation="drop"))) == 4
    with pytest.raises(ConfigError, match="none of its 6 examples has a trained token"):
        with pytest.warns(JaxllmWarning):
            rows_of(src, seq_len=4, truncation="drop")


BAD_CHATS = [
    ([{"content": "hi"}, {"role": "assistant", "content": "x"}], "message 1 without a string role"),
    ([{"role": "user", "content": ["hi"]}], "message 1 whose content is not a string"),
    ([{"role": "tool", "content": "hi"}], "message 1 with role 'tool'"),
    ([{"role": "user", "content": "hi"}], "no assistant message"),
    ("hi", "no list of messages in field 'conv'"),
]


@pytest.mark.parametrize("bad, why", BAD_CHATS)
def test_bad_chats_are_skipped_or_fail_with_file_and_line(tmp_path, bad, why):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join([json.dumps({"conv": CHATS[0]})] * 2 + [json.dumps({"conv": bad})]))
    src = SourceConfig(path=str(path), format="chat", messages_field="conv")
    with pytest.warns(JaxllmWarning, match=f"skipped 1 record.*first: {path} line 3 has {why}"):
        assert len(examples_of(rows_of(src))) == 2
    with pytest.raises(ConfigError, match=f"{path} line 3 has {why}.*; fix it or set"):
        rows_of(src, on_bad_record="fail")


def test_bad_prompt_completion_records(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\nnot json\n{"prompt": "a"}\n[1]\n')
    src = SourceConfig(path=str(path), format="prompt_completion")
    with pytest.warns(
        JaxllmWarning, match="skipped 3 record.*'prompt' and 'completion'.*line 2 is"
    ):
        assert len(examples_of(rows_of(src))) == 1
    with pytest.raises(ConfigError, match="line 2 has no string field 'completion'"):
        write(path, [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": None}])
        rows_of(src, on_bad_record="fail", seq_len=8)
    with pytest.raises(ConfigError, match="has no column 'completion'.*completion_field"):
        rows_of(
            SourceConfig(
                path=write(tmp_path / "p.parquet", [{"prompt": "a"}]), format="prompt_completion"
            )
        )


@pytest.mark.parametrize("fmt", ["chat", "prompt_completion"])
def test_prepared_shards_give_the_same_rows(tmp_path, fmt):
    tok = tokenizer_lib.train_bpe(
        ["What is 4 + 4? Be brief. Q: A: Sure? Yes. <|im_end|>"] * 8, 290, tmp_path / "tok"
    )
    if fmt == "chat":
        src = SourceConfig(
            path=chat_file(tmp_path / "c.jsonl"), format="chat", messages_field="conv"
        )
        fields = ["--messages-field", "conv"]
    else:
        src = SourceConfig(
            path=pair_file(tmp_path / "p.parquet"),
            format=fmt,
            prompt_field="q",
            completion_field="a",
        )
        fields = ["--prompt-field", "q", "--completion-field", "a"]
    out = tmp_path / "prepared"
    args = [src.path, "--out", str(out), "--format", fmt, *fields, "--tokenizer", str(tok)]
    assert main(["data", "prepare", *args, "--eval-fraction", "0", "--workers", "1"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "jaxllm-prepared-sft/1" and manifest["kind"] == fmt
    for data in ({}, {"train_on_prompt": True, "add_bos": False}):
        direct = rows_of(src, tokenizer=str(tok), **data)
        prepared = rows_of(SourceConfig(path=str(out)), tokenizer=str(tok), **data)
        for a, b in zip(direct, prepared, strict=True):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
    if fmt == "chat":  # another template would render other text: refused
        (tok.parent / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 1 }}"}))
        os.utime(tok, ns=(0, tok.stat().st_mtime_ns + 1))  # the loaded tokenizer is cached
        with pytest.raises(ConfigError, match="rendered by another chat template"):
            rows_of(SourceConfig(path=str(out)), tokenizer=str(tok))


def test_prepare_refuses_to_mix_text_and_sft(tmp_path):
    text = write(tmp_path / "t.jsonl", [{"text": "hello"}])
    with pytest.raises(ConfigError, match="mix chat and text records"):
        from jaxllm.data.prepare import prepare

        prepare(
            [
                SourceConfig(path=text),
                SourceConfig(path=chat_file(tmp_path / "c.jsonl"), format="chat"),
            ],
            tmp_path / "out",
        )


@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_no_trained_token_in_a_row_names_only_the_fixes_that_would_help(tmp_path, truncation):
    long = [("a long question " * 4, "4")] * 3
    src = SourceConfig(
        path=pair_file(tmp_path / "p.jsonl", long),
        format="prompt_completion",
        prompt_field="q",
        completion_field="a",
    )
    with warnings.catch_warnings(), pytest.raises(ConfigError) as e:
        warnings.simplefilter("ignore", JaxllmWarning)  # the counts before the error
        rows_of(src, seq_len=16, truncation=truncation)
    assert str(e.value).endswith(
        "raise data.seq_len." if truncation == "truncate" else "or set data.truncation=truncate."
    )
    pref = tmp_path / "pref.jsonl"
    write(pref, [{"prompt": "a long question " * 4, "chosen": "4", "rejected": "5"}] * 3)
    src = SourceConfig(path=str(pref), format="preference")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JaxllmWarning)
        if truncation == "truncate":  # pairs lose their prompt's start instead (TRL's keep_end)
            assert len(rows_of(src, seq_len=16, truncation=truncation)) == 3
            return
        with pytest.raises(ConfigError, match="set data.truncation"):
            rows_of(src, seq_len=16, truncation=truncation)
