"""The reconstructed row: one typed definition, one Arrow schema, one reader and writer.

A reconstructed row (one per choice of an exchange) is what ``reconstruct`` writes and
what ``export``, ``vocab`` and ``report`` read. Its columns, their types and how each is
stored in Parquet are declared here and nowhere else:

* :class:`ReconstructedRow` -- the row as Python sees it (a ``TypedDict``: rows stay
  plain dicts, so reading and writing JSON costs nothing extra);
* :func:`arrow_schema` -- the one Arrow schema, built from :data:`_ARROW_TYPES`; exports
  select their columns from it (:func:`arrow_fields`), so a column has one type everywhere;
* :func:`iter_rows` -- every row of a JSONL or Parquet file, checked against the contract
  (a bad value is a :class:`RowError` naming file, line and field);
* :class:`JsonlRowSink` / :class:`ParquetRowSink` -- the writers ``reconstruct`` uses.

Files written before the ``reconstruction`` column existed are read with it as ``None``.
"""

from __future__ import annotations

import contextlib
import os
import stat
from functools import lru_cache
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    NotRequired,
    TypedDict,
    get_args,
)
from collections.abc import Callable, Iterable, Iterator, Mapping

import orjson

from .content import content_fault, reasoning_fault, role_fault, tool_calls_fault, tools_fault
from .exit_codes import ExitCode
from .fsio import WriteBehind, copy_range, kind_of
from .jsonl import JsonLineError, dumps_line, json_text, loads_line, not_text

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "COLUMNS",
    "DERIVED_COLUMNS",
    "JSON_TEXT_COLUMNS",
    "MARKER_SEGMENTS",
    "SEGMENT_KINDS",
    "SEVERITIES",
    "STATUSES",
    "FindingRecord",
    "JsonlRowSink",
    "ParquetRowSink",
    "ReconstructedRow",
    "NotARowFile",
    "iter_parquet_records",
    "RowError",
    "Segment",
    "Severity",
    "Status",
    "arrow_fields",
    "arrow_schema",
    "encode_lean_row",
    "encode_row",
    "iter_rows",
    "with_derived",
]

Status = Literal["ok", "flagged", "rejected"]
#: Every status a row may carry: ``ok`` (no findings), ``flagged`` (warnings only), ``rejected``.
STATUSES: tuple[Status, ...] = ("ok", "flagged", "rejected")
Severity = Literal["error", "warning"]
SEVERITIES: tuple[Severity, ...] = ("error", "warning")
#: The prompt, then the dialects' completion part kinds (:data:`tokenbridge.chat.dialect.PART_KINDS`).
SegmentKind = Literal["prompt", "format", "think_start", "reasoning", "think_end", "content", "tool_calls", "end"]
SEGMENT_KINDS: tuple[SegmentKind, ...] = get_args(SegmentKind)
#: The kinds reconstruct writes as one marker id each (a completion part that is a marker).
MARKER_SEGMENTS: frozenset[SegmentKind] = frozenset({"think_start", "think_end", "end"})


class Segment(TypedDict):
    """A span of ``input_ids``: ``[start, end)``."""

    kind: SegmentKind
    start: int
    end: int


class FindingRecord(TypedDict):
    code: str
    severity: Severity
    message: str


class ReconstructedRow(TypedDict):
    """One choice of one exchange, with its exact ids and the gate's verdict."""

    id: str
    choice: int
    dataset: str | None
    status: Status
    prompt_ids: list[int]
    completion_ids: list[int]
    input_ids: list[int]  # prompt_ids + completion_ids
    loss_mask: list[int]  # [0] * len(prompt_ids) + [1] * len(completion_ids)
    segments: list[Segment]
    findings: list[FindingRecord]
    provider: str | None
    model: str | None
    finish_reason: str | None
    thinking: bool
    usage: dict[str, Any] | None  # the response's usage object as returned
    messages: list[dict[str, Any]]  # the request's messages
    tools: list[dict[str, Any]] | None
    reasoning: str
    content: str
    #: which reconstruction hypothesis produced the ids; None = the plain formula
    reconstruction: NotRequired[str | None]


#: Column order of every file that holds rows.
COLUMNS: tuple[str, ...] = tuple(ReconstructedRow.__annotations__)
#: Free-form columns stored as JSON text in Parquet.
JSON_TEXT_COLUMNS = ("usage", "messages", "tools")
#: Text columns whose value comes from the API unchecked: any other JSON value is kept as its JSON text.
_TEXT_COLUMNS = ("dataset", "provider", "model", "finish_reason")
#: Columns a row may lack (older files): read as None.
_OPTIONAL = ("reconstruction",)

#: The one Arrow type of each column (``pyarrow`` type expressions, see :func:`_arrow_type`).
_ARROW_TYPES: dict[str, str] = {
    "id": "string",
    "choice": "int32",
    "dataset": "string",
    "status": "string",
    "prompt_ids": "ids",
    "completion_ids": "ids",
    "input_ids": "ids",
    "loss_mask": "mask",
    "segments": "segments",
    "findings": "findings",
    "provider": "string",
    "model": "string",
    "finish_reason": "string",
    "thinking": "bool",
    "usage": "string",
    "messages": "string",
    "tools": "string",
    "reasoning": "string",
    "content": "string",
    "reconstruction": "string",
}


def _arrow_type(name: str) -> pa.DataType:
    import pyarrow as pa

    simple = {"string": pa.string(), "int32": pa.int32(), "bool": pa.bool_(), "ids": pa.list_(pa.int32()),
              "mask": pa.list_(pa.int8())}
    if name in simple:
        return simple[name]
    if name == "segments":
        return pa.list_(pa.struct([("kind", pa.string()), ("start", pa.int32()), ("end", pa.int32())]))
    if name == "findings":
        return pa.list_(pa.struct([("code", pa.string()), ("severity", pa.string()), ("message", pa.string())]))
    raise KeyError(name)


@lru_cache(maxsize=1)
def arrow_schema() -> pa.Schema:
    """The row's Arrow schema (reconstruct's Parquet output), columns in :data:`COLUMNS` order."""
    import pyarrow as pa

    return pa.schema([(col, _arrow_type(_ARROW_TYPES[col])) for col in COLUMNS])


def arrow_fields(columns: Iterable[str], **types: pa.DataType) -> list[pa.Field]:
    """The schema's fields for ``columns``, in that order; ``types`` overrides a column's type
    where a consumer needs another width (speculators reads int64 ids)."""
    schema = arrow_schema()
    out = []
    for col in columns:
        field = schema.field(col)
        out.append(field.with_type(types[col]) if col in types else field)
    return out


# --- reading ---------------------------------------------------------------------------


class RowError(ValueError):
    """A row breaks the contract: names the file, the line (or row number) and the field.
    Bad input data, not a bad flag: the command exits ``exit_code`` (1, as for bad records)."""

    exit_code = ExitCode.INCOMPLETE

    def __init__(self, path: str | Path, line: int | None, field: str, message: str):
        self.path = str(path)
        self.line = line
        self.field = field
        self.detail = message
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {field}: {message}")


class NotARowFile(RowError):
    """The path is no file at all (a device, a FIFO, a folder): the argument is wrong (exit 2)."""

    exit_code = ExitCode.USAGE


_PARQUET_BATCH_ROWS = 256


def iter_rows(path: str | Path) -> Iterator[tuple[int, ReconstructedRow]]:
    """(line or row number from 1, row) for every row of a reconstruct output file.

    JSONL is streamed line by line, Parquet in bounded record batches, so no file is held.
    Every row is checked against the contract (:func:`check_row`); training-specific
    checks (ids, mask, segments) are :func:`tokenbridge.export.check_training_row`'s.
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        raise RowError(path, None, "<file>", "no such file") from None
    if not stat.S_ISREG(mode):  # /dev/null, a FIFO: a wrong argument, not bad rows
        raise NotARowFile(path, None, "<file>", f"is {kind_of(mode)}, not a regular file: give a reconstruct "
                          "output (JSONL or .parquet)")
    rows = _iter_parquet(path) if path.suffix == ".parquet" else _iter_jsonl(path)
    for line, obj in rows:
        yield line, check_row(obj, path, line)


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, "rb", buffering=1 << 20) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield lineno, loads_line(line)
            except JsonLineError as exc:
                raise RowError(path, lineno, exc.field or "<line>", exc.detail) from None


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa

    # a broken file is an ArrowException (ArrowInvalid is also a ValueError) or an OSError,
    # when opened and again in any later row group
    broken = (pa.ArrowException, OSError, ValueError)
    try:  # opened here, not by pyarrow: it takes a path as UTF-8, and a file name need not be
        fh = open(path, "rb")  # noqa: SIM115 - closed by the with below, when the rows are read
    except OSError as exc:
        raise RowError(path, None, "<file>", f"cannot be read ({exc.strerror or exc})") from None
    with fh:
        for row, record, problem in _parquet_rows(fh, path, broken):
            if problem is not None:
                raise problem
            yield row, record


def iter_parquet_records(path: str | Path) -> Iterator[tuple[int, Any, RowError | None]]:
    """(row number from 1, record, its problem or None) for every row of a Parquet file of
    rows, unchecked (:func:`check_row` is the caller's): a row whose JSON text columns do not
    parse comes with that :class:`RowError`, so a reader looking for one sample (``inspect``)
    passes over another's fault, as it passes over a bad line of a JSONL file. A file or
    record batch that cannot be read still raises (a file-level one with ``line`` None)."""
    import pyarrow as pa

    path = Path(path)
    broken = (pa.ArrowException, OSError, ValueError)
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed by the with below, when the rows are read
    except OSError as exc:
        raise RowError(path, None, "<file>", f"cannot be read ({exc.strerror or exc})") from None
    with fh:
        yield from _parquet_rows(fh, path, broken)


def _parquet_rows(fh: Any, path: Path, broken: tuple[type[BaseException], ...],
                  ) -> Iterator[tuple[int, Any, RowError | None]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(fh)
    except broken as exc:
        raise RowError(path, None, "<file>", f"not a readable Parquet file ({_one_line(exc)})") from None
    names = pf.schema_arrow.names
    if twice := sorted({n for n in names if names.count(n) > 1}):  # each row would keep the last, silently
        raise RowError(path, None, twice[0], f"the file holds this column {names.count(twice[0])} times (which one "
                       "a row means is unclear: a row's JSON holds each key once)")
    row = 0
    batches = pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS)
    while True:
        try:
            batch = next(batches, None)
        except broken as exc:
            raise RowError(path, row + 1, "<row>", f"cannot be read ({_one_line(exc)})") from None
        if batch is None:
            return
        try:
            records = batch.to_pylist()
        except UnicodeDecodeError:  # a string column (a hand edit, a broken writer) that is not UTF-8
            at, column = _not_utf8(batch)
            raise RowError(path, row + at + 1, column, "is not valid UTF-8") from None
        for record in records:
            row += 1
            problem = None
            for key in JSON_TEXT_COLUMNS:
                value = record.get(key)
                if isinstance(value, str):
                    try:
                        record[key] = loads_line(value)
                    except JsonLineError as exc:
                        where = key + ("" if not exc.field or exc.field.startswith("[") else ".") + (exc.field or "")
                        problem = RowError(path, row, where, exc.detail if exc.field is not None else "is not valid JSON text")
                        break
            yield row, record, problem


def _one_line(exc: BaseException) -> str:
    """pyarrow's words on a damaged file, on one line (thrift's run over two: an ``error:``
    line then a stray ``)``)."""
    return " ".join(str(exc).split())


def _not_utf8(batch: Any) -> tuple[int, str]:
    """(row in ``batch``, column) of the first value that is not valid UTF-8 (found value by
    value: only after the whole batch failed to convert)."""
    for name, column in zip(batch.schema.names, batch.columns):
        for i in range(len(column)):
            try:
                column[i].as_py()
            except UnicodeDecodeError:
                return i, name
    return 0, "<row>"


def _is_int(value: Any) -> bool:
    return type(value) is int


def _check_messages(messages: Any, fail: Callable[[str, str], RowError]) -> None:
    """The request's messages: a non-empty list of objects with a known role and content
    in shape, by the rules prompt loading sends by (:mod:`tokenbridge.content`), since the
    conversations export writes them for a trainer as they are."""
    if not isinstance(messages, list) or not messages:
        raise fail("messages", f"must be a non-empty list, got {type(messages).__name__}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise fail(f"messages[{k}]", "must be an object with a string role")
        if why := role_fault(m.get("role")):
            raise fail(f"messages[{k}].role", why)
        if fault := content_fault(m.get("content")):
            raise fail(f"messages[{k}].content{fault[0]}", fault[1])
        for fault in (reasoning_fault(m), tool_calls_fault(m)):
            if fault is not None:
                raise fail(f"messages[{k}].{fault[0]}", fault[1])


def check_row(obj: Any, path: str | Path, line: int) -> ReconstructedRow:  # noqa: PLR0912 - a check per column of an untrusted row
    """``obj`` as a :class:`ReconstructedRow`, or :class:`RowError`. Cheap (no per-token
    work): the column types, the status, the findings' codes and severities. Text columns
    the API filled with another JSON type keep it as JSON text, as Parquet stores it."""
    if not isinstance(obj, dict):
        raise RowError(path, line, "<line>", f"must be a JSON object, got {type(obj).__name__}")
    for col in COLUMNS:
        if col not in obj:
            if col in _OPTIONAL:
                obj[col] = None
                continue
            raise RowError(path, line, col, "missing")

    def fail(field: str, message: str) -> RowError:
        return RowError(path, line, field, message)

    if not isinstance(obj["id"], str):
        raise fail("id", f"must be a string, got {type(obj['id']).__name__}")
    if not _is_int(obj["choice"]) or obj["choice"] < 0:
        raise fail("choice", f"must be a non-negative integer, got {obj['choice']!r}")
    if obj["status"] not in STATUSES:
        raise fail("status", f"must be one of {', '.join(STATUSES)}, got {obj['status']!r}")
    for col in ("prompt_ids", "completion_ids", "input_ids", "loss_mask", "segments", "findings", "messages"):
        if not isinstance(obj[col], list):
            raise fail(col, f"must be a list, got {type(obj[col]).__name__}")
    for k, f in enumerate(obj["findings"]):
        if (not isinstance(f, dict) or not isinstance(f.get("code"), str) or f.get("severity") not in SEVERITIES
                or not isinstance(f.get("message"), str)):
            raise fail(f"findings[{k}]", "must be an object with string code and message, and severity error or warning")
        for part in ("code", "message"):
            if why := not_text(f[part]):
                raise fail(f"findings[{k}].{part}", why)
    for col in _TEXT_COLUMNS:
        value = obj[col]
        if value is not None and not isinstance(value, str):
            obj[col] = json_text(value)
    for col in ("id", "dataset", "provider", "model"):  # names every output writes
        if why := not_text(obj[col]):
            raise fail(col, why)
    if obj["reconstruction"] is not None and not isinstance(obj["reconstruction"], str):  # tokenbridge's own label
        raise fail("reconstruction", f"must be a string or null, got {type(obj['reconstruction']).__name__}")
    if type(obj["thinking"]) is not bool:
        raise fail("thinking", f"must be true or false, got {obj['thinking']!r}")
    if obj["usage"] is not None and not isinstance(obj["usage"], dict):
        raise fail("usage", f"must be an object or null, got {type(obj['usage']).__name__}")
    if obj["tools"] is not None and not isinstance(obj["tools"], list):
        raise fail("tools", f"must be a list or null, got {type(obj['tools']).__name__}")
    if fault := tools_fault(obj["tools"]):
        raise fail(f"tools{fault[0]}", fault[1])
    _check_messages(obj["messages"], fail)
    for col in ("reasoning", "content"):
        if not isinstance(obj[col], str):
            raise fail(col, f"must be a string, got {type(obj[col]).__name__}")
    return obj  # type: ignore[return-value]  # checked above, column by column


# --- writing ---------------------------------------------------------------------------


class JsonlRowSink:
    """Rows as JSON lines, handed over already encoded (by :func:`encode_row`, in pool
    workers): one buffer of whole lines, newlines included."""

    def __init__(self, path: Path):
        self.path = path
        self._fh = open(path, "wb")  # noqa: SIM115 - the sink owns it until close() or abort()
        self._behind = WriteBehind(self._fh.fileno())

    def write(self, data: bytes | memoryview) -> None:
        self._fh.write(data)
        self._behind.wrote(len(data))

    def copy_from(self, fd: int, offset: int, length: int) -> None:
        """Append ``length`` bytes of the file open as ``fd`` from ``offset`` (a pool
        worker's spooled rows), copied inside the kernel (:func:`~tokenbridge.fsio.copy_range`)."""
        self._fh.flush()  # what was written through the buffer goes first
        copy_range(fd, offset, length, self._fh.fileno())
        self._behind.wrote(length)

    def close(self) -> None:
        """Flushed and on disk (the last part synced here, the rest already behind)."""
        self._fh.flush()
        self._behind.finish()
        os.fsync(self._fh.fileno())
        self._fh.close()

    def abort(self) -> None:
        with contextlib.suppress(OSError):  # thrown away: the error that aborted it is the one to tell
            self._behind.finish()
        self._fh.close()
        self.path.unlink(missing_ok=True)


#: The columns that follow from ``prompt_ids`` + ``completion_ids`` (and come right after them).
DERIVED_COLUMNS = ("input_ids", "loss_mask")


def with_derived(lean: Mapping[str, Any]) -> dict[str, Any]:
    """A row built without :data:`DERIVED_COLUMNS` (what reconstruct holds while it gates),
    with them put in after ``completion_ids``."""
    out: dict[str, Any] = {}
    for key, value in lean.items():
        out[key] = value
        if key == "completion_ids":
            prompt, completion = lean["prompt_ids"], value
            out["input_ids"] = [*prompt, *completion]
            out["loss_mask"] = [0] * len(prompt) + [1] * len(completion)
    return out


def encode_lean_row(lean: Mapping[str, Any]) -> bytes:
    """The JSON line (no newline) of :func:`with_derived` of ``lean``, byte for byte, without
    building or serialising the derived columns: ``input_ids`` is spliced from the two id
    lists' own JSON and ``loss_mask`` is a repeated ``0,`` / ``1,`` (41% of a row's bytes
    for a fraction of the CPU). ``lean`` needs ``prompt_ids`` then ``completion_ids``,
    adjacent; anything else is serialised whole."""
    return _encode(lean, lean)


def encode_row(row: Mapping[str, Any]) -> bytes:
    """One row as its JSON line (no newline): :func:`tokenbridge.jsonl.dumps_line`'s bytes
    exactly; derived columns that follow from the ids are spliced as in
    :func:`encode_lean_row`, any others serialised as they are."""
    prompt, completion = row.get("prompt_ids"), row.get("completion_ids")
    if type(prompt) is not list or type(completion) is not list:
        return dumps_line(row)
    keys = list(row)
    at = keys.index("prompt_ids")
    if (
        keys[at : at + 4] != ["prompt_ids", "completion_ids", *DERIVED_COLUMNS]
        or row["input_ids"] != [*prompt, *completion]
        or row["loss_mask"] != [0] * len(prompt) + [1] * len(completion)
    ):
        return dumps_line(row)
    return _encode({k: v for k, v in row.items() if k not in DERIVED_COLUMNS}, row)


def _encode(lean: Mapping[str, Any], full: Mapping[str, Any]) -> bytes:
    """``dumps_line(full)``, where ``full`` is ``lean`` with the derived columns after its ids."""
    keys = list(lean)
    try:
        at = keys.index("prompt_ids")
    except ValueError:
        at = -1
    prompt, completion = lean.get("prompt_ids"), lean.get("completion_ids")
    if at < 0 or keys[at + 1 : at + 2] != ["completion_ids"] or type(prompt) is not list or type(completion) is not list:
        return dumps_line(with_derived(lean) if full is lean else full)
    try:
        head = orjson.dumps({k: lean[k] for k in keys[:at]})
        tail = orjson.dumps({k: lean[k] for k in keys[at + 2 :]})
        ids_p, ids_c = orjson.dumps(prompt), orjson.dumps(completion)
    except TypeError:  # lone surrogates (or anything else orjson refuses): the fallback's bytes
        return dumps_line(with_derived(lean) if full is lean else full)
    # one join of views into the pieces: each byte is copied once, into the line
    p, c, h, t = memoryview(ids_p), memoryview(ids_c), memoryview(head), memoryview(tail)
    ids = (c,) if not prompt else (p,) if not completion else (p[:-1], b",", c[1:])
    return b"".join((
        h[:-1], b"," if at else b"", b'"prompt_ids":', p, b',"completion_ids":', c, b',"input_ids":', *ids,
        b',"loss_mask":', *_mask(len(prompt), len(completion)), b"," if len(tail) > 2 else b"}", t[1:] if len(tail) > 2 else b"",
    ))


def _mask(n_prompt: int, n_completion: int) -> tuple[bytes, ...]:
    """The JSON of ``[0] * n_prompt + [1] * n_completion``, in pieces."""
    if n_completion:
        return b"[", b"0," * n_prompt, b"1," * (n_completion - 1), b"1]"
    return (b"[", b"0," * (n_prompt - 1), b"0]") if n_prompt else (b"[]",)


def to_arrow_record(row: Mapping[str, Any], columns: Iterable[str]) -> dict[str, Any]:
    """The ``columns`` of ``row`` as Arrow values: JSON-text columns encoded, odd API values
    in text columns as their JSON text, a missing ``reconstruction`` as None. A text that
    holds a lone surrogate (an API's ``"\\ud800"``, which the gate flags) is stored as its
    JSON text too: an Arrow string is UTF-8, and writing one raised UnicodeEncodeError."""
    out: dict[str, Any] = {}
    for col in columns:
        value = row.get(col)
        odd = col in JSON_TEXT_COLUMNS or (col in _TEXT_COLUMNS and not isinstance(value, str))
        if value is not None and odd or isinstance(value, str) and not_text(value) is not None:
            value = json_text(value)
        out[col] = value
    return out


class ParquetRowSink:
    """Rows buffered into bounded record batches of :func:`arrow_schema`."""

    def __init__(self, path: Path, batch_rows: int = 512):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._pa = pa
        self.schema = arrow_schema()
        self.path = path
        # a file object, not the path: pyarrow takes a path as UTF-8, and a file name need not be
        self._fh = open(path, "wb")  # noqa: SIM115 - the sink owns it until close() or abort()
        try:
            self._writer = pq.ParquetWriter(self._fh, self.schema)
        except BaseException:
            self._fh.close()
            raise
        self._buf: list[dict[str, Any]] = []
        self._batch_rows = batch_rows

    def write(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self.write_records(to_arrow_record(row, COLUMNS) for row in rows)

    def write_records(self, records: Iterable[dict[str, Any]]) -> None:
        """Rows already made :func:`to_arrow_record`'s (in a reconstruct worker, where a value
        too deep to write fails its own record)."""
        self._buf.extend(records)
        if len(self._buf) >= self._batch_rows:
            self._flush()

    def _flush(self) -> None:
        if self._buf:
            self._writer.write_table(self._pa.Table.from_pylist(self._buf, schema=self.schema))
            self._buf = []

    def close(self) -> None:
        self._flush()
        self._writer.close()
        self._fh.close()

    def abort(self) -> None:
        self._buf = []
        try:
            self._writer.close()
        finally:
            self._fh.close()
        self.path.unlink(missing_ok=True)
