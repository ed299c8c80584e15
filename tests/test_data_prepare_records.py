"""`jaxllm data prepare` on preference pairs (format preference / unpaired_preference) and on
step-labelled solutions (format stepwise): training from the prepared directory gives the very
rows of reading the records on the fly, train and eval split alike; a prepared directory named
with another format, and a label that is not a boolean, are one line and exit 2."""

import json

import numpy as np
import pytest

from jaxllm import cli
from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data.pipeline import load_splits


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _unpaired(root):
    records = [
        {"prompt": f"q{i % 7}:", "completion": f" a{i}" * (1 + i % 3), "label": bool(i % 2)}
        for i in range(20)
    ]
    chats = [
        {
            "prompt": [{"role": "user", "content": f"u{i}"}],
            "completion": [{"role": "assistant", "content": f"b{i}"}],
            "label": i % 3 == 0,
        }
        for i in range(8)
    ]
    _write(root / "strings.jsonl", records)
    _write(root / "chats.jsonl", chats)
    return root


def _pairs(root):
    records = [
        {"prompt": f"p{i}=", "chosen": f" c{i}", "rejected": f" r{i}" * 2} for i in range(24)
    ]
    _write(root / "pairs.jsonl", records)
    return root


def _stepwise(root):
    rng = np.random.default_rng(0)
    records = []
    for i in range(24):
        labels = [bool(x) for x in rng.integers(0, 2, rng.integers(1, 4))]
        steps = [f"s{rng.integers(10)} {'ok' if y else 'no'}" for y in labels]
        records.append({"prompt": f"q{i % 5}:", "completions": steps, "labels": labels})
    _write(root / "steps.jsonl", records)
    return root


MAKERS = {"unpaired_preference": _unpaired, "preference": _pairs, "stepwise": _stepwise}


@pytest.mark.parametrize("fmt", list(MAKERS))
@pytest.mark.parametrize("add_bos", [True, False])
def test_prepared_records_give_the_rows_of_the_records(tmp_path, fmt, add_bos):
    (tmp_path / "data").mkdir()
    data = MAKERS[fmt](tmp_path / "data")
    out = tmp_path / "prepared"
    argv = ["data", "prepare", str(data), "--format", fmt, "--out", str(out)]
    assert cli.main([*argv, "--eval-fraction", "0.25", "--shard-docs", "5"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == fmt and manifest["splits"]["eval"]["docs"] > 0
    common = {"seq_len": 512, "eval_fraction": 0.25, "add_bos": add_bos}
    direct = load_splits(DataConfig(sources=(SourceConfig(path=str(data), format=fmt),), **common))
    prepared = load_splits(DataConfig(sources=(SourceConfig(path=str(out), format=fmt),), **common))
    for a, b in zip(direct, prepared, strict=True):
        assert len(a) == len(b) > 0
        for i in range(len(a)):
            assert a[i].keys() == b[i].keys()
            for k in a[i]:
                np.testing.assert_array_equal(a[i][k], b[i][k], err_msg=f"row {i} {k}")


def test_a_prepared_directory_must_be_named_with_its_format(tmp_path):
    data = _unpaired(tmp_path)
    out = tmp_path / "prepared"
    argv = ["data", "prepare", str(data), "--format", "unpaired_preference", "--out", str(out)]
    assert cli.main([*argv, "--eval-fraction", "0"]) == 0
    for fmt in ("auto", "preference"):
        cfg = DataConfig(sources=(SourceConfig(path=str(out), format=fmt),), seq_len=512)
        with pytest.raises(ConfigError, match="set format: unpaired_preference"):
            load_splits(cfg)


def test_a_label_that_is_not_a_boolean_is_one_line_and_exit_2(tmp_path, capsys):
    records = [{"prompt": "a", "completion": "b", "label": True}] * 3
    data = _write(tmp_path / "u.jsonl", [*records, {"prompt": "a", "completion": "b", "label": 1}])
    argv = ["data", "prepare", str(data), "--format", "unpaired_preference"]
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxllm: ") and err.count("\n") == 1 and "boolean" in err
    assert not (tmp_path / "out").exists()


def test_field_options_name_the_record_fields(tmp_path):
    rows = [{"q": f"p{i}", "good": f" c{i}", "bad": " r", "thumb": i % 2 == 0} for i in range(6)]
    data = _write(tmp_path / "pairs.jsonl", rows)
    for fmt, fields in (
        ("preference", ["--chosen-field", "good", "--rejected-field", "bad"]),
        ("unpaired_preference", ["--completion-field", "good", "--label-field", "thumb"]),
    ):
        out = tmp_path / fmt
        argv = ["data", "prepare", str(data), "--format", fmt, "--prompt-field", "q", *fields]
        assert cli.main([*argv, "--out", str(out), "--eval-fraction", "0"]) == 0
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["docs"] == 6 and manifest["sources"][0]["prompt_field"] == "q"
