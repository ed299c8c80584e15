"""Preference sources through the data pipeline: string and chat pairs in JSONL and Parquet, the
answer-only loss mask, whole pairs packed as segments 2k + 1 / 2k + 2 first-fit, truncation and
drop, the reward model's closing slot, bad records, and the config checks around pairs."""

import dataclasses

import numpy as np
import pytest
from test_data_sft import write

from jaxllm import JaxllmWarning, config
from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data import chat
from jaxllm.data import tokenizer as tokenizer_lib
from jaxllm.data.pipeline import load_splits

BYTES = tokenizer_lib.ByteTokenizer()
PAIRS = [(f"Q: {i} + {i} = ", f"{2 * i}", f"{2 * i + 1}!") for i in range(12)]


def rows_of(path, seq_len=64, whole_inputs=False, **fields) -> list[dict]:
    src = SourceConfig(path=path, format="preference", **fields)
    cfg = DataConfig(sources=(src,), eval_sources=(src,), seq_len=seq_len)
    rows = load_splits(cfg, whole_inputs=whole_inputs)[0]
    return [rows[i] for i in range(len(rows))]


def pairs_of(rows, whole_inputs=False):
    """[(chosen, rejected)] in row order, each (tokens, trained targets); checks the layout."""
    out = []
    for row in rows:
        seg = row["segment_ids"]
        assert seg.max() % 2 == 0  # whole pairs only
        for k in range(seg.max() // 2):
            pair = []
            for s in (2 * k + 1, 2 * k + 2):
                at = np.flatnonzero(seg == s)
                assert np.array_equal(at, np.arange(at[0], at[-1] + 1))  # contiguous
                np.testing.assert_array_equal(row["positions"][at], np.arange(len(at)))
                tokens = [*row["inputs"][at], row["targets"][at[-1]]]
                trained = row["targets"][at][row["loss_mask"][at] == 1]
                if whole_inputs:  # the closing slot: input = last token, target pad, untrained
                    assert row["loss_mask"][at[-1]] == 0 and row["targets"][at[-1]] == 0
                    assert row["inputs"][at[-1]] == row["targets"][at[-2]]
                    tokens = tokens[:-1]
                pair.append((tokens, list(trained)))
            out.append(tuple(pair))
        assert not row["loss_mask"][seg == 0].any()
    return out


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_string_pairs_with_renamed_fields(tmp_path, suffix):
    records = [{"q": p, "good": c, "bad": r} for p, c, r in PAIRS]
    path = write(tmp_path / f"p{suffix}", records)
    rows = rows_of(path, prompt_field="q", chosen_field="good", rejected_field="bad")
    got = pairs_of(rows)
    assert len(got) == len(PAIRS)
    for (prompt, chosen, rejected), pair in zip(PAIRS, got):
        for answer, (tokens, trained) in zip((chosen, rejected), pair):
            ids = list(BYTES.encode(prompt + answer))
            assert tokens == [BYTES.bos_id, *ids, BYTES.eos_id]
            assert trained == [*BYTES.encode(answer), BYTES.eos_id]  # the answer and EOS only


def test_chat_pairs_mask_the_answer_turns_only(tmp_path):
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "2."},
        {"role": "user", "content": "And 2 + 2?"},
    ]
    chosen = [{"role": "assistant", "content": "4."}]
    records = [{"prompt": prompt, "chosen": chosen, "rejected": "5."}]
    jsonl = rows_of(write(tmp_path / "c.jsonl", records), seq_len=512)
    ((c, r),) = pairs_of(jsonl)
    for answer, (tokens, trained) in ((chosen[0]["content"], c), ("5.", r)):
        messages = [*prompt, {"role": "assistant", "content": answer}]
        assert tokens == list(BYTES.encode(chat.render(messages, BYTES)))  # no BOS/EOS added
        assert bytes(trained).decode() == f"{answer}<|im_end|>"  # not the earlier "2."
    parquet = rows_of(write(tmp_path / "c.parquet", records), seq_len=512)
    for a, b in zip(jsonl, parquet):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_an_implicit_prompt_is_the_common_beginning_of_both_answers(tmp_path, suffix):
    """TRL's implicit-prompt pairs (HH-RLHF): the rows of the same pairs with the prompt given."""
    prompt = [{"role": "user", "content": "1 + 1?"}]
    chats = [
        {
            "chosen": [*prompt, {"role": "assistant", "content": "2."}],
            "rejected": [*prompt, {"role": "assistant", "content": "3."}],
        }
    ]
    explicit = [{"prompt": prompt, "chosen": "2.", "rejected": "3."}]
    # texts part at the first difference; a space just before it goes with the answers (TRL)
    texts = [{"chosen": p + "x" + c, "rejected": p + " " + r} for p, c, r in PAIRS]
    given = [{"prompt": p[:-1], "chosen": " x" + c, "rejected": "  " + r} for p, c, r in PAIRS]
    for i, (implicit, want) in enumerate(((chats, explicit), (texts, given))):
        got = rows_of(write(tmp_path / f"i{i}{suffix}", implicit), seq_len=512)
        for a, b in zip(got, rows_of(write(tmp_path / f"e{i}{suffix}", want), seq_len=512)):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
        assert got


def test_pairs_pack_first_fit_and_whole(tmp_path):
    rng = np.random.default_rng(0)
    pairs = [
        ("x" * rng.integers(1, 12), "c" * rng.integers(1, 9), "r" * rng.integers(1, 9))
        for _ in range(40)
    ]
    path = write(
        tmp_path / "p.jsonl", [dict(zip(("prompt", "chosen", "rejected"), p)) for p in pairs]
    )
    for whole in (False, True):
        rows = rows_of(path, seq_len=48, whole_inputs=whole)
        got = pairs_of(rows, whole_inputs=whole)
        # every pair once, whole (first-fit puts later pairs into earlier rows with room)
        assert sorted(bytes(c[0][1:-1] + r[0][1:-1]) for c, r in got) == sorted(
            (p + c + p + r).encode() for p, c, r in pairs
        )
        used = sum(int((row["segment_ids"] > 0).sum()) for row in rows)
        # first-fit wastes less than a row's worth on average: the rows are well filled
        assert used > 0.75 * 48 * len(rows)
        per_seq = 1 if whole else 0
        assert used == sum(len(c[0]) + len(r[0]) - 2 + 2 * per_seq for c, r in got)


def test_long_pairs_are_truncated_or_dropped_and_counted(tmp_path):
    # (prompt, rejected) lengths; the chosen answer is "yes"; with BOS and EOS a pair of
    # sequences of n_c and n_r tokens takes n_c + n_r - 2 of a row's 40 slots
    shapes = [(4, 1), (4, 12), (16, 8), (25, 1)]
    records = [{"prompt": "p" * n, "chosen": "yes", "rejected": "no!" * m} for n, m in shapes]
    path = write(tmp_path / "p.jsonl", records)
    with pytest.warns(JaxllmWarning, match="3 of 4 pairs do not fit .* cut to fit") as said:
        rows = rows_of(path, seq_len=40)
    assert "kept no trained token" not in str(said[0].message)
    got = pairs_of(rows)
    lengths = [(len(c[0]), len(r[0])) for c, r in got]
    # (4, 12): the prompt fits, the longer answer is cut; (16, 8): the prompt keeps a quarter of
    # the row (10 tokens, BOS included), then the rejected answer is cut; (25, 1): its prompt
    # fills more than half a row, so only it is cut, to its last 16 characters
    assert lengths == [(9, 9), (9, 33), (14, 28), (21, 21)]
    assert got[1][0][1] == [*b"yes", BYTES.eos_id]
    assert got[3][0] == ([BYTES.bos_id, *b"p" * 16, *b"yes", BYTES.eos_id], [*b"yes", BYTES.eos_id])
    src = SourceConfig(path=path, format="preference")
    cfg = DataConfig(sources=(src,), eval_sources=(src,), seq_len=40, truncation="drop")
    with pytest.warns(JaxllmWarning, match="3 of 4 pairs .* left out .*truncation=drop"):
        rows = load_splits(cfg)[0]
    assert len(pairs_of([rows[i] for i in range(len(rows))])) == 1
    cfg = dataclasses.replace(cfg, seq_len=8)
    with pytest.warns(JaxllmWarning), pytest.raises(ConfigError, match="none of its 4 pairs"):
        load_splits(cfg)


def test_a_long_prompt_loses_its_start_as_trl_cuts_it(tmp_path):
    # TRL keeps a prompt's end (truncation_mode keep_end), then cuts the answers' ends; a pair
    # whose prompt alone fills more than half a row is kept, not left out
    prompt = "".join(chr(ord("a") + i % 26) for i in range(30))
    records = [{"prompt": prompt, "chosen": "ok", "rejected": "no" * 20}]
    with pytest.warns(JaxllmWarning, match="1 of 1 pairs do not fit .* the prompt's start first"):
        rows = load_splits(
            DataConfig(
                sources=(
                    SourceConfig(path=write(tmp_path / "p.jsonl", records), format="preference"),
                ),
                eval_fraction=0,
                seq_len=40,
            )
        )[0]
    assert rows.truncated == 1
    ((chosen, rejected),) = pairs_of([rows[i] for i in range(len(rows))])
    # the prompt keeps BOS and its last 9 characters (a quarter of the 42 tokens); the rejected
    # answer (41 tokens) is cut to what is left after the chosen's 3: 42 - 20 - 3 = 19
    kept = [BYTES.bos_id, *prompt[-9:].encode()]
    assert chosen == ([*kept, *b"ok", BYTES.eos_id], [*b"ok", BYTES.eos_id])
    assert rejected == ([*kept, *(b"no" * 20)[:19]], list((b"no" * 20)[:19]))


def test_a_long_chat_prompt_loses_its_start_and_keeps_its_answers(tmp_path):
    system = "".join(chr(ord("a") + i % 26) for i in range(200))
    prompt = [{"role": "system", "content": system}, {"role": "user", "content": "2 + 2?"}]
    records = [{"prompt": prompt, "chosen": "4.", "rejected": "5."}]
    with pytest.warns(JaxllmWarning, match="1 of 1 pairs do not fit"):
        ((c, r),) = pairs_of(rows_of(write(tmp_path / "c.jsonl", records), seq_len=128))
    for answer, (tokens, trained) in (("4.", c), ("5.", r)):
        full = list(
            BYTES.encode(chat.render([*prompt, {"role": "assistant", "content": answer}], BYTES))
        )
        # the rendered prompt's end, the whole answer turn: 2 * 65 - 2 = 128 predictions
        assert len(tokens) == 65 and tokens == full[-65:]
        assert bytes(trained).decode() == f"{answer}<|im_end|>"


@pytest.mark.parametrize(
    "bad,why",
    [
        ({"prompt": "q", "chosen": "a"}, "has no field 'rejected'"),
        ({"prompt": "q", "chosen": 3, "rejected": "b"}, "has a chosen answer in field 'chosen'"),
        ({"prompt": "q", "chosen": "a", "rejected": " "}, "has an empty rejected answer"),
        ({"prompt": 7, "chosen": "a", "rejected": "b"}, "has a prompt that is neither"),
        (
            {"prompt": [{"role": "system", "content": "s"}], "chosen": "a", "rejected": "b"},
            "has a chat prompt without a user turn",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "q"}],
                "chosen": [{"role": "user", "content": "a"}],
                "rejected": "b",
            },
            "has a chosen answer with a message that is not an assistant turn",
        ),
    ],
)
def test_bad_records_are_skipped_or_fail_with_file_and_line(tmp_path, bad, why):
    good = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS[:3]]
    path = write(tmp_path / "p.jsonl", [good[0], good[1], bad, good[2]])
    with pytest.warns(JaxllmWarning, match=f"skipped 1 record.*first: {path} line 3 {why}"):
        assert len(pairs_of(rows_of(path))) == 3
    src = SourceConfig(path=path, format="preference")
    cfg = DataConfig(sources=(src,), eval_sources=(src,), seq_len=64, on_bad_record="fail")
    with pytest.raises(ConfigError, match=f"{path} line 3 {why}.*; fix it or set"):
        load_splits(cfg)


def test_config_pairs_preference_sources_with_their_objectives(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    pref = [f"data.sources=[{{path: {path}, format: preference}}]"]
    with pytest.raises(ConfigError, match="train.objective=dpo trains on preference pairs"):
        config.load(None, ["train.objective=dpo"]).validate(8)
    with pytest.raises(ConfigError, match="which train.objective=sft does not read"):
        config.load(None, [*pref, "train.objective=sft"]).validate(8)
    with pytest.raises(ConfigError, match="data.train_on_prompt does not apply"):
        config.load(None, [*pref, "train.objective=orpo", "data.train_on_prompt=true"]).validate(8)
    config.load(None, [*pref, "train.objective=simpo"]).validate(8)
    src = SourceConfig(path=path, format="preference")
    with pytest.raises(ConfigError, match="peft.method=prompt does not train on"):
        load_splits(DataConfig(sources=(src,), eval_sources=(src,), seq_len=16), virtual_tokens=4)
