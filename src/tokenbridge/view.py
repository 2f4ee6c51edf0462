"""Terminal views: the reconstruct summary table and one sample's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping, Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text

from .display import printable
from .exchanges import RecordError, loads_line
from .jsonl import iter_lines
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .reconstruct import ReconstructSummary

_STYLE = {
    "prompt": "dim",
    "think_start": "bold magenta",
    "reasoning": "cyan",
    "think_end": "bold magenta",
    "content": "green",
    "tool_calls": "yellow",
    "end": "bold red",
}


def status_text(counts: Mapping[str, int]) -> str:
    """``140 ok, 11 flagged, 65 rejected``: reconstruct's statuses as ``run`` prints them."""
    return ", ".join(f"{counts.get(s, 0)} {s}" for s in ("ok", "flagged", "rejected"))


def summary_table(summary: ReconstructSummary, title: str = "reconstruct") -> Group:
    """Counts of records, statuses and finding codes. The title names files: it is text,
    never rich markup (``x[/y].jsonl`` is a file name, not a closing tag)."""
    totals = Table(title=Text(printable(title)), show_header=True)
    for col in ("records", "samples", "ok", "flagged", "rejected", "bad lines"):
        totals.add_column(col, justify="right")
    totals.add_row(
        str(summary.records), str(summary.rows), str(summary.status.get("ok", 0)),
        str(summary.status.get("flagged", 0)), str(summary.status.get("rejected", 0)), str(summary.bad_line_count),
    )
    parts: list[Any] = [totals]
    if summary.codes:
        codes = Table(show_header=True)
        codes.add_column("finding")
        codes.add_column("samples", justify="right")
        for code, n in sorted(summary.codes.items(), key=lambda kv: (-kv[1], kv[0])):
            codes.add_row(Text(printable(code)), str(n))
        parts.append(codes)
    return Group(*parts)


def find_row(path: Path, tok: Tokenizer, sample_id: str | None, choice: int, dialect: str | None) -> Mapping[str, Any]:
    """The reconstructed row for ``sample_id`` (first record if None), from reconstruct's
    JSONL or Parquet output; exchange records are reconstructed on the fly. LookupError
    when absent, :class:`~tokenbridge.rows.RowError` when the row breaks the contract.
    ``dialect`` renders exchange records; given for a file of rows, already rendered, it
    is :class:`~tokenbridge.chat.DialectError` rather than silently ignored."""
    from .chat import DialectError, resolve_dialect
    from .reconstruct import RECORD_ERRORS, reconstruct_record

    def rows_file() -> DialectError:
        return DialectError(f"--dialect {dialect} applies to exchange records; {path} holds reconstructed rows, "
                            "already rendered (leave --dialect out)")

    if path.suffix == ".parquet":
        if dialect is not None:
            raise rows_file()
        return _find_parquet_row(path, sample_id, choice, tok)
    unread, first_unread = 0, ""  # lines that could not be read, and the first of them
    for lineno, line in iter_lines(path):
        try:
            record = loads_line(line)
        except RecordError as exc:
            unread += 1
            first_unread = first_unread or f"{path}:{lineno}: {exc.field}: {exc.detail}"
            continue  # the sample may be on another line; if none has it, these are named
        if not isinstance(record, dict) or (sample_id is not None and str(record.get("id")) != sample_id):
            continue
        if "input_ids" in record:
            if dialect is not None:
                raise rows_file()
            if _other_choice(record, choice):
                continue
            return _checked_row(record, path, lineno, tok)  # the id or choice the row types wrong is named
        try:
            rows = reconstruct_record(record, tok, resolve_dialect(tok, dialect))
        except RECORD_ERRORS as exc:
            raise LookupError(f"{path}:{lineno}: {exc}") from None
        except RecursionError:  # parsed (orjson reads 1024 levels), too deep for Python to walk
            raise LookupError(f"{path}:{lineno}: nested too deeply to reconstruct") from None
        if choice < len(rows):
            return rows[choice]
    raise LookupError(_not_found(path, sample_id, choice) + _unread_note(unread, first_unread))


def _unread_note(unread: int, first: str) -> str:
    """What a search passed over: lines it could not read (the sample may be one of them;
    a cold tester's UTF-16 file and row with NaN both read as "no sample")."""
    if not unread:
        return ""
    return f"; {unread} line(s) could not be read, the sample may be among them (first: {first})"


def _other_choice(record: Mapping[str, Any], choice: int) -> bool:
    """Whether ``record`` is another choice of the sample: one whose choice is no count
    (``"0"``, -1, true) is not passed over as that, but held to the row contract, which
    names it (it was "no sample with choice 0", exit 2, for a sample that is there)."""
    given = record.get("choice", 0)
    return type(given) is int and 0 <= given != choice


def _not_found(path: Path, sample_id: str | None, choice: int) -> str:
    """No such sample: its id quoted (an empty ``--id ''`` was called "(first)")."""
    return f"{path}: no sample {'(first)' if sample_id is None else repr(sample_id)} with choice {choice}"


def _find_parquet_row(path: Path, sample_id: str | None, choice: int, tok: Tokenizer) -> Mapping[str, Any]:
    """As the JSONL path finds a row: the first whose id and choice match, held to the
    contract only then (another row's fault is not this sample's: it is passed over, as a
    bad line of a JSONL file is); a matched row that breaks the contract is a
    :class:`~tokenbridge.rows.RowError` (exit 1), as from JSONL. A file that is not
    readable Parquet is a LookupError (exit 2), as before."""
    from .rows import RowError, iter_parquet_records

    try:
        for number, record, problem in iter_parquet_records(path):
            if (sample_id is None or str(record.get("id")) == sample_id) and not _other_choice(record, choice):
                if problem is not None:
                    raise problem
                return _checked_row(record, path, number, tok)
    except RowError as exc:
        if exc.line is None:  # the file itself
            raise LookupError(str(exc)) from None
        raise
    raise LookupError(_not_found(path, sample_id, choice))


def _checked_row(record: Mapping[str, Any], path: Path, line: int, tok: Tokenizer) -> Mapping[str, Any]:
    """A row from disk held to the contract export holds it to (it may have been edited by
    hand): an ``ok`` row trainable, any row's status agreeing with its findings and its ids
    integers within this tokenizer's vocabulary (a rejected row is shown too: it is the
    one to look at); else :class:`~tokenbridge.rows.RowError` naming file, line and field."""
    from .export.validate import RowContract, stored_row_ids
    from .rows import RowError, check_row

    row = check_row(record, path, line)
    ids = stored_row_ids(row, path, line)
    bad = next((k for k, i in enumerate(ids) if type(i) is not int or i < 0), None)  # shown one by one below
    if bad is not None:
        raise RowError(path, line, "input_ids", f"holds {ids[bad]!r} at position {bad}, not a token id"[:200])
    # a row's texts may hold what no training file can (a lone surrogate: why the gate rejects
    # it, or flags it under a user's policy); reconstruct wrote it, and it is shown as it is, escaped
    RowContract(path, tok.vocab_size).check(row, line, ids, texts=False)
    _check_segment_shapes(row["segments"], len(ids), path, line)  # an ok row's are proven by stored_row_ids
    return row


def _check_segment_shapes(segments: list[Any], n: int, path: Path, line: int) -> None:
    """What :func:`render_row` reads of any row's ``segments`` (a flagged or rejected row's
    are not held to tiling, only an ``ok`` row's are): objects with a string ``kind`` and
    integer ``start`` <= ``end`` inside ``input_ids``; else :class:`~tokenbridge.rows.RowError`."""
    from .rows import RowError

    for k, seg in enumerate(segments):
        if (not isinstance(seg, Mapping) or not isinstance(seg.get("kind"), str)
                or not all(type(seg.get(key)) is int for key in ("start", "end"))):
            raise RowError(path, line, f"segments[{k}]", "must be an object with a string kind and integer start "
                           "and end")
        if not 0 <= seg["start"] <= seg["end"] <= n:
            raise RowError(path, line, f"segments[{k}]", f"spans {seg['start']}..{seg['end']}, outside input_ids "
                           f"(0..{n})")


def _kind_at(segments: list[Mapping[str, Any]]) -> list[str]:
    kinds: list[str] = []
    for seg in segments:
        kinds.extend([seg["kind"]] * (seg["end"] - seg["start"]))
    return kinds


def render_row(row: Mapping[str, Any], tok: Tokenizer, tokens: str | None = None) -> Group:
    """One sample for the terminal. Its id, provider, finish reason and findings quote API
    text and rows from disk: each line is built as plain text (never markup) with every
    control or invisible character escaped (:func:`~tokenbridge.display.printable`)."""
    ids = row["input_ids"]
    kinds = _kind_at(row["segments"])
    head = Text()
    head.append(printable(f"{row['id']} choice {row.get('choice', 0)}: "), style="bold")
    head.append(printable(row["status"]),
                style={"ok": "green", "flagged": "yellow", "rejected": "red"}.get(row["status"], ""))
    head.append(printable(
        f"  provider={row.get('provider')} finish={row.get('finish_reason')} "
        f"prompt={len(row['prompt_ids'])} completion={len(row['completion_ids'])} tokens"
    ))
    out: list[Any] = [head]
    if row.get("reconstruction"):
        out.append(Text(printable(
            f"  reconstruction: {row['reconstruction']} (the reading of the response the evidence proved)")))
    for f in row["findings"]:
        out.append(Text(printable(f"  {f['severity']}: {f['code']}: {f['message']}"),
                        style="red" if f["severity"] == "error" else "yellow"))
    seg_line = Text("  segments: ")
    for seg in row["segments"]:
        seg_line.append(printable(f"{seg['kind']}[{seg['start']}:{seg['end']}] "), style=_STYLE.get(seg["kind"], ""))
    out.append(seg_line)
    markers = tok.marker_ids
    n_prompt = len(row["prompt_ids"])
    for pos in range(max(0, n_prompt - 1), len(ids)):  # the last prompt marker, then the completion's
        tid = ids[pos]
        if tid in markers:
            kind = kinds[pos] if pos < len(kinds) else "?"
            out.append(Text(printable(f"  {markers[tid]} ({tid}) at position {pos} [{kind}]"), style=_STYLE.get(kind, "")))
    if tokens is not None:
        out.append(_token_table(ids, kinds, tok, tokens))
    return Group(*out)


def parse_span(span: str) -> tuple[int | None, int | None]:
    """``A:B``, ``A:``, ``:B`` or ``:`` → (start, stop); ValueError (a message) otherwise."""
    a, sep, b = span.partition(":")
    try:
        if not sep:
            raise ValueError
        start, stop = (int(a) if a else None, int(b) if b else None)
    except ValueError:
        raise ValueError("expected A:B (positions), A:, :B or ':'") from None
    if (start is not None and start < 0) or (stop is not None and stop < 0):
        raise ValueError("positions start at 0 (negative positions are not accepted)")
    return start, stop


def check_span(span: str, n_tokens: int) -> tuple[int, int]:
    """``span`` as (start, stop) within a sample of ``n_tokens``; ValueError when outside it."""
    a, b = parse_span(span)
    start = 0 if a is None else a
    stop = n_tokens if b is None else b
    if start >= n_tokens or stop > n_tokens:
        raise ValueError(f"the sample has {n_tokens} tokens, positions 0 to {n_tokens - 1}")
    if start >= stop:
        raise ValueError(f"empty span: {start} is not below {stop}")
    return start, stop


def _token_table(ids: Sequence[int], kinds: Sequence[str], tok: Tokenizer, span: str) -> Table:
    start, stop = check_span(span, len(ids))
    table = Table(show_header=True, box=None)
    for col in ("pos", "id", "token", "segment"):
        table.add_column(col, justify="right" if col in ("pos", "id") else "left")
    for pos in range(start, stop):
        tid = ids[pos]
        text = tok.token_bytes(tid).decode("utf-8", errors="backslashreplace")
        kind = kinds[pos] if pos < len(kinds) else "?"
        table.add_row(str(pos), str(tid), Text(repr(text)), Text(printable(kind)), style=_STYLE.get(kind, ""))
    return table
