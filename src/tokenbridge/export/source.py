"""Reading reconstruct output for the exports: :func:`tokenbridge.rows.iter_rows`.

The export API's names for the one reader (:mod:`tokenbridge.rows`): ``iter_records``
yields checked rows of a JSONL or Parquet file, and a bad row is an :class:`ExportError`
(the same class as :class:`tokenbridge.rows.RowError`) naming file, line and field.
"""

from __future__ import annotations

from ..rows import STATUSES, RowError, iter_rows

__all__ = ["ExportError", "iter_records", "STATUSES"]

#: A row cannot be exported (or counted): names the file, line and field.
ExportError = RowError
iter_records = iter_rows
