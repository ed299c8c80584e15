"""Columnar sources: CSV / TSV and Arrow files (the shards Hugging Face `datasets` writes with
`save_to_disk`, whose metadata JSON files a directory source skips) give the records a Parquet
file of the same rows gives, as documents and as SFT examples."""

import json

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest
from test_data_sft import BYTES, examples_of, rows_of
from test_data_sources import DOCS, texts_of

from jaxllm.config import ConfigError, SourceConfig

RECORDS = [{"text": d, "prompt": f'q{i}, "quoted"\n', "completion": d} for i, d in enumerate(DOCS)]


def save_to_disk(directory, table: pa.Table) -> None:
    """What `datasets.Dataset.save_to_disk` writes: Arrow stream shards and two JSON files."""
    directory.mkdir()
    with pa.ipc.new_stream(str(directory / "data-00000-of-00001.arrow"), table.schema) as out:
        out.write_table(table)
    (directory / "dataset_info.json").write_text(json.dumps({"features": {}}, indent=2))
    (directory / "state.json").write_text(json.dumps({"_data_files": []}, indent=2))


def test_csv_tsv_and_arrow_read_like_parquet(tmp_path):
    table = pa.Table.from_pylist(RECORDS)
    pq.write_table(table, tmp_path / "a.parquet")
    pyarrow.csv.write_csv(table, tmp_path / "a.csv")
    options = pyarrow.csv.WriteOptions(delimiter="\t", quoting_style="all_valid")
    pyarrow.csv.write_csv(table, tmp_path / "a.tsv", options)
    save_to_disk(tmp_path / "saved", table)
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink:  # Arrow's random-access file format
        with pa.ipc.new_file(sink, table.schema) as out:
            out.write_table(table)
    for path in ("a.parquet", "a.csv", "a.tsv", "saved", "f.arrow"):
        assert texts_of(tmp_path / path) == DOCS, path
        src = SourceConfig(path=str(tmp_path / path), format="prompt_completion")
        examples = sorted(BYTES.decode(t) for t, _ in examples_of(rows_of(src)))
        assert examples == sorted(r["prompt"] + r["completion"] for r in RECORDS), path


def test_bad_tables_name_the_file_and_the_columns(tmp_path):
    (tmp_path / "a.csv").write_text("body,n\nhello,1\n")
    with pytest.raises(ConfigError, match=r"CSV file .*a.csv has no column 'text' \(columns: body"):
        texts_of(tmp_path / "a.csv")
    (tmp_path / "b.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(ConfigError, match=r"cannot read Arrow file .*b.arrow"):
        texts_of(tmp_path / "b.arrow")
    (tmp_path / "c.csv").write_text("text,n\nhello,1,2\n")
    with pytest.raises(ConfigError, match=r"cannot read CSV file .*c.csv"):
        texts_of(tmp_path / "c.csv")
