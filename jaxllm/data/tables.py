"""Columnar files, read as batches of records: Parquet, CSV / TSV, and Arrow (the
`data-NNNNN-of-NNNNN.arrow` files Hugging Face `datasets` writes with `save_to_disk`).

One row is one record, whatever the format reads from it (a document from `text_field`, a
conversation, a pair). CSV columns get the types pyarrow infers (a column of numbers is not
text). The JSON files `save_to_disk` writes beside its Arrow files (`dataset_info.json`,
`state.json`) describe the dataset and are not records: a directory source skips them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from jaxllm.config import ConfigError

FORMATS = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv", ".arrow": "arrow"}
DATASETS_METADATA = ("dataset_info.json", "state.json")  # beside save_to_disk's Arrow files


def is_table(path: Path) -> bool:
    return path.suffix in FORMATS


def is_datasets_metadata(path: Path) -> bool:
    """Whether `path` is the metadata `save_to_disk` writes beside Arrow files (not records)."""
    return path.name in DATASETS_METADATA and any(path.parent.glob("*.arrow"))


class Table:
    """A columnar file's column names and its rows, in batches of chosen columns."""

    def __init__(self, path: Path):
        import pyarrow as pa
        import pyarrow.csv
        import pyarrow.parquet as pq

        self.path, self._parquet, self._table = path, None, None
        kind = FORMATS.get(path.suffix, "parquet")
        self.what = {"parquet": "Parquet", "csv": "CSV", "arrow": "Arrow"}[kind]
        try:
            if kind == "parquet":
                self._parquet = pq.ParquetFile(path)
                self.names = list(self._parquet.schema_arrow.names)
                return
            if kind == "csv":
                delimiter = "\t" if path.suffix == ".tsv" else ","
                options = pyarrow.csv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
                self._table = pyarrow.csv.read_csv(path, parse_options=options)
            else:
                with pa.memory_map(str(path)) as source:
                    try:
                        self._table = pa.ipc.open_stream(source).read_all()
                    except pa.ArrowInvalid:  # the Arrow file (random access) format
                        self._table = pa.ipc.open_file(source).read_all()
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError on corrupt files
            first = str(e).splitlines()[0]
            raise ConfigError(f"cannot read {self.what} file {path}: {first}") from e
        self.names = list(self._table.column_names)

    def rows(self, columns: Sequence[str], batch_size: int = 1024) -> Iterator[dict]:
        """Each row as a dict of `columns`, in file order."""
        if self._parquet is not None:
            batches = self._parquet.iter_batches(columns=list(columns), batch_size=batch_size)
        else:
            batches = self._table.select(list(columns)).to_batches(max_chunksize=batch_size)
        for batch in batches:
            yield from batch.to_pylist()
