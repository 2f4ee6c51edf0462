"""Reading reconstruct output row by row, whatever its file format.

Reconstruct writes JSONL (one row per line) or Parquet (nested free-form fields such
as ``usage`` and ``messages`` stored as JSON text). Both are streamed: a JSONL file line
by line, a Parquet file in bounded record batches, so readers never hold a file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from ..exchanges import RecordError, iter_objects

__all__ = ["ExportError", "iter_records", "STATUSES"]

#: Every status a reconstructed row may carry.
STATUSES = ("ok", "flagged", "rejected")
#: Parquet columns that reconstruct stores as JSON text.
_JSON_TEXT_FIELDS = ("usage", "messages", "tools")
_PARQUET_BATCH_ROWS = 256


class ExportError(ValueError):
    """A row cannot be exported as training data: names the file, line and field."""

    def __init__(self, path: str | Path, line: int | None, field: str, message: str):
        self.path = str(path)
        self.line = line
        self.field = field
        self.detail = message
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {field}: {message}")


def iter_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line or row number from 1, record) for every row of a reconstruct output file."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(path, None, "<file>", "no such file")
    if path.suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        yield from _iter_jsonl(path)


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        yield from iter_objects(path)
    except RecordError as exc:
        raise ExportError(path, exc.line, exc.field, exc.detail) from None


def _iter_parquet(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a broken file
        raise ExportError(path, None, "<file>", f"not a readable Parquet file ({exc})") from None
    row = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        for record in batch.to_pylist():
            row += 1
            for key in _JSON_TEXT_FIELDS:
                value = record.get(key)
                if isinstance(value, str):
                    try:
                        record[key] = json.loads(value)
                    except json.JSONDecodeError:
                        raise ExportError(path, row, key, "is not valid JSON text") from None
            yield row, record
