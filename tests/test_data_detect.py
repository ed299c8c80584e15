"""`format: auto` on chat and preference records (`jaxllm.data.detect`): the shapes read as
their format with one line saying so, a set format winning, records of no or several shapes
refused in one line naming the format, and the objective checked against what was detected."""

import json

import pytest
from test_data_sft import write

from jaxllm import cli, config
from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data import preference
from jaxllm.data.packing import FirstFitRows
from jaxllm.data.pipeline import load_splits
from jaxllm.train.vision import run_splits

USER, BOT = {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}
SHAPES = {
    "messages": ("chat", {"messages": [USER, BOT]}),
    "sharegpt": (
        "chat",
        {"conversations": [{"from": "human", "value": "2 + 2?"}, {"from": "gpt", "value": "4"}]},
    ),
    "alpaca": ("chat", {"instruction": "Add.", "input": "2 + 2", "output": "4"}),
    "pairs": ("preference", {"prompt": "2 + 2 = ", "chosen": "4", "rejected": "5"}),
    "chat pairs": (
        "preference",
        {"chosen": [USER, BOT], "rejected": [USER, {**BOT, "content": "5"}]},
    ),
}


def data_cfg(path, **src) -> DataConfig:
    return DataConfig(sources=(SourceConfig(path=path, **src),), eval_fraction=0, seq_len=256)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_plain_records_are_read_in_their_format_said_in_one_line(tmp_path, capsys, name, suffix):
    fmt, record = SHAPES[name]
    path = write(tmp_path / f"d{suffix}", [record] * 3)
    rows = load_splits(data_cfg(path))[0]
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        f"data.sources[0]: the records of {path} are {fmt} records, read as format: {fmt} "
        "(set data.sources[0].format to read them otherwise)"
    ]
    expected = preference.PairRows if fmt == "preference" else FirstFitRows
    assert isinstance(rows, expected) and rows.num_docs == 3
    explicit = load_splits(data_cfg(path, format=fmt))[0]
    for i in range(len(rows)):  # the rows of naming the format
        assert all((rows[i][k] == explicit[i][k]).all() for k in rows[i])


def test_a_set_format_wins_and_text_records_stay_text(tmp_path, capsys):
    path = write(tmp_path / "a.jsonl", [SHAPES["alpaca"][1]] * 3)
    cfg = data_cfg(
        path, format="prompt_completion", prompt_field="input", completion_field="output"
    )
    rows = load_splits(cfg)[0]
    assert rows.num_docs == 3 and capsys.readouterr().err == ""
    text = write(tmp_path / "t.jsonl", [{"text": "hello there", "messages": [USER, BOT]}] * 40)
    rows = load_splits(data_cfg(text))[0]
    assert not isinstance(rows, (FirstFitRows, preference.PairRows))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "records",
    [
        [{"messages": [USER, BOT], "prompt": "q", "chosen": "a", "rejected": "b"}] * 2,
        [SHAPES["messages"][1], SHAPES["pairs"][1]],  # first records of two shapes
        [{"chosen": "2 + 2 = 4", "rejected": "2 + 2 = 5"}] * 2,  # texts: not plainly pairs
    ],
)
def test_records_of_no_or_several_shapes_are_one_line_naming_the_format(tmp_path, capsys, records):
    path = write(tmp_path / "d.jsonl", records)
    run = [f"data.sources=[{{path: {path}}}]", "data.eval_fraction=0"]
    assert cli.main(["bench", "data", *run, "--batches", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxllm: ") and err.count("\n") == 1, err
    assert "hold no documents" in err and "format: " in err


def test_the_objective_is_checked_against_the_detected_format(tmp_path):
    pairs = write(tmp_path / "p.jsonl", [SHAPES["pairs"][1]] * 4)
    chats = write(tmp_path / "c.jsonl", [SHAPES["messages"][1]] * 4)
    common = ["data.eval_fraction=0", "data.seq_len=256"]
    dpo = config.load(None, [f"data.sources=[{{path: {pairs}}}]", "train.objective=dpo", *common])
    assert isinstance(run_splits(dpo)[0], preference.PairRows)
    with pytest.raises(ConfigError, match="does not read; set train.objective"):
        run_splits(config.load(None, [f"data.sources=[{{path: {pairs}}}]", *common]))
    wrong = config.load(None, [f"data.sources=[{{path: {chats}}}]", "train.objective=dpo", *common])
    with pytest.raises(ConfigError, match="has format chat; give format: preference"):
        run_splits(wrong)
    texts = write(tmp_path / "t.jsonl", [{"text": "hello"}] * 4)
    loose = config.load(None, [f"data.sources=[{{path: {texts}}}]", "train.objective=dpo", *common])
    with pytest.raises(ConfigError, match="not plainly pairs"):
        run_splits(loose)
    with pytest.raises(ConfigError, match="give format: preference"):  # stdlib: refused at load
        config.load(None, ["train.objective=dpo"])


def test_prepare_reads_plain_pairs_as_pairs(tmp_path, capsys):
    path = write(tmp_path / "p.jsonl", [SHAPES["pairs"][1]] * 4)
    out = tmp_path / "prepared"
    assert cli.main(["data", "prepare", path, "--out", str(out), "--eval-fraction", "0"]) == 0
    assert json.loads((out / "manifest.json").read_text())["kind"] == "preference"
    assert "SOURCE: the records of" in capsys.readouterr().err
