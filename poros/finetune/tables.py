"""Training data the `datasets` library reads locally: a Parquet or Arrow file, a folder of them, or a
`Dataset.save_to_disk` folder (a `DatasetDict`'s: its `train` split). Rows are records with the columns
of JSON Lines records (`text`; `prompt` and `completion`; `messages`); other columns are ignored.

`datasets` is optional (`pip install 'poros[data]'`): it is imported only when such data is given.
Rows are streamed (Parquet and Arrow files through `datasets`' streaming reader, save_to_disk output
memory-mapped), so host memory stays bounded whatever the data's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from poros.finetune.records import DataError, LineReader

TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
SAVED = ("state.json", "dataset_dict.json")  # what Dataset(Dict).save_to_disk writes beside its Arrow files
INSTALL = "pip install 'poros[data]' (or pip install datasets)"


def is_table(path: Path) -> bool:
    """Whether `path` is data for `datasets` rather than JSON Lines."""
    if path.is_dir():
        return any((path / f).is_file() for f in SAVED) or bool(_table_files(path))
    return path.suffix.lower() in TABLE_SUFFIXES


def _table_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TABLE_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def open_reader(path: str | Path):
    """The reader of a data file or folder: TableReader for `datasets` data, else LineReader (JSON Lines)."""
    path = Path(path)
    return TableReader(path) if path.exists() and is_table(path) else LineReader(path)


def _datasets():
    try:
        import datasets  # optional: only tables need it
    except ImportError:
        return None
    return datasets


class TableReader:
    """The rows of a table as (row number from 1, dict), with how far through it reading is.

    Raises:
        DataError: `datasets` missing, a table it cannot read, a DatasetDict without a `train` split,
            or a folder whose files are of more than one format.
    """

    def __init__(self, path: Path):
        self.path = path
        ds = _datasets()
        if ds is None:
            raise DataError(f"{path}: reading Parquet or Arrow data needs the datasets library: {INSTALL}")
        self.size = None  # rows, where known before reading
        self.position = 0
        try:
            self._rows = self._open(ds)
        except DataError:
            raise
        except Exception as e:  # datasets and pyarrow raise many kinds; each is this table's problem
            raise DataError(f"{path}: the datasets library cannot read it ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None

    def _open(self, ds):
        path = self.path
        if path.is_dir() and any((path / f).is_file() for f in SAVED):
            data = ds.load_from_disk(str(path))
            if isinstance(data, ds.DatasetDict):
                if "train" not in data:
                    raise DataError(f"{path}: a DatasetDict without a train split (splits: {', '.join(data)}); "
                                    "save the split to train on, or name its folder")
                data = data["train"]
            self.size = len(data)
            return data
        files = _table_files(path) if path.is_dir() else [path]
        kinds = {TABLE_SUFFIXES[f.suffix.lower()] for f in files}
        if len(kinds) != 1:
            raise DataError(f"{path}: holds both Parquet and Arrow files; keep one format per folder")
        (kind,) = kinds
        if kind == "parquet":
            import pyarrow.parquet as pq  # datasets' own dependency

            self.size = sum(pq.ParquetFile(str(f)).metadata.num_rows for f in files)
        return ds.load_dataset(kind, data_files=[str(f) for f in files], split="train", streaming=True)

    def where(self, n: int) -> str:
        return f"{self.path}: row {n}"

    def progress(self) -> str:
        return f"{self.position:,} of {self.size:,} rows" if self.size else f"{self.position:,} rows"

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        rows = iter(self._rows)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:  # a broken file found while streaming it
                raise DataError(f"{self.path}: reading row {self.position + 1} failed ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from None
            self.position += 1
            yield self.position, row
