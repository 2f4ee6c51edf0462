"""Prompt datasets: rows on disk -> :class:`Sample` (id + the messages to send).

Sources: a ``.jsonl`` file, a ``.parquet`` file, a Hugging Face ``save_to_disk`` folder
(``state.json`` + Arrow files, or a ``dataset_dict.json`` of splits), or a folder of
``.jsonl`` / ``.parquet`` files (read in name order).

Row shapes: OpenAI ``messages``; ShareGPT ``conversations`` (``from``/``value``, roles
human/gpt/system/tool); or ``prompt``; each with an optional ``system`` (the system turn
put in front, or the conversation's own when it equals that). A row holding its prompt
twice (UltraChat's ``prompt`` beside ``messages``) is read once where the copies agree
(the prompt is the first or the last user turn) and is a bad row where they differ. An
optional row-level ``tools`` list is kept (sent only with ``send_tools``; the run says
where it is not). A trailing assistant turn is dropped, so the model answers the last
user/tool turn. The sample id is ``<dataset>-<row id>`` (the row id alone when it
already starts ``<dataset>-``), or ``<dataset>-<content hash>`` when the row has no ``id``
(a repeated hash gets ``~2``, ``~3``... in row order).
Ids are unique over all datasets of a load: a row whose id is already taken (``a`` row
``x-1`` and ``a-x`` row ``1`` are both ``a-x-1``) is a bad row naming both places, and the
first one is kept. A string with a lone surrogate (``"\\ud800"`` in JSON) is a bad row,
also inside ``messages`` or ``tools`` stored as JSON text (checked as decoded). A line
with a number of more digits than Python reads (4300) is a bad line, not a crash. A
Parquet or Arrow string that is not UTF-8 (pyarrow checks none on write) is a bad row
naming its field (``messages[1].content``); an Arrow file whose offsets point outside its
data, or a Parquet page that cannot be decoded, is the whole file refused.

A bad row never stops the load: it becomes a :class:`RowError` naming file, line (or row
index) and field, and the other rows go on. What is sent must be plain JSON: strings,
finite numbers, booleans, null, lists and objects with string keys, nested at most
:data:`MAX_DEPTH` deep (the exchange readers parse 1024 levels; a prompt needs a handful);
a role, speaker, name or content part ``type`` is a string; a ``text`` part's ``text``
is a string.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeGuard
from collections.abc import Container, Iterable, Iterator, Sequence

from ..content import content_fault, role_fault, tool_calls_fault
from ..jsonl import JsonLineError, NotJsonlError, binary_kind, loads_document, loads_finite, loads_line, number_too_long
from .errors import GenerateError
from .settings import DatasetSpec

__all__ = ["SHOWN_BAD_ROWS", "LoadedPrompts", "PromptSourceError", "RowError", "Sample", "load_prompts", "sample_from_row",
           "unread_entries"]

MAX_DEPTH = 64
#: Bad rows a run or a dry run prints; then how many more, and where they are all listed.
SHOWN_BAD_ROWS = 20
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
#: The row keys a sample is made of; a dataset's other columns are never read.
_ROW_KEYS = ("id", "messages", "conversations", "prompt", "system", "tools")
# Message keys forwarded to the API; others (training weights, ids...) stay behind.
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning", "reasoning_details")


class PromptSourceError(GenerateError):
    """A whole source cannot be read (missing, unknown format): the run cannot start."""


@dataclass(frozen=True)
class RowError:
    """One bad row: where it is and what is wrong with it."""

    dataset: str
    file: str
    location: str  # "line 12" or "row 12"
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.location}: field '{self.field}': {self.message}"


@dataclass(frozen=True)
class Sample:
    """One prompt to send: the messages after normalisation, and where it came from."""

    id: str
    dataset: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    source: str = ""  # "file: line 12"


@dataclass
class LoadedPrompts:
    samples: list[Sample] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # dataset -> samples kept


class _BadRow(Exception):
    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name
        self.message = message


def load_prompts(specs: list[DatasetSpec] | tuple[DatasetSpec, ...], *, default_limit: int | None = None) -> LoadedPrompts:
    """All samples of all datasets in order; bad rows are collected, not raised."""
    out = LoadedPrompts()
    taken: dict[str, str] = {}  # sample id -> where first seen, over all datasets
    for spec in specs:
        limit = spec.limit if spec.limit is not None else default_limit
        seen: set[str] = set()  # this dataset's ids
        hash_counts: dict[str, int] = {}
        kept = 0
        for file, location, row in _source_rows(spec):
            if limit is not None and kept >= limit:
                break
            where = f"{file}: {location}"
            try:
                sample = sample_from_row(row, spec.name, source=where)
            except _BadRow as bad:
                out.errors.append(RowError(spec.name, file, location, bad.field, bad.message))
                continue
            except (TypeError, ValueError, RecursionError) as exc:  # a shape no check foresaw: still one bad row
                out.errors.append(RowError(spec.name, file, location, "<row>", f"cannot be read: {type(exc).__name__}"))
                continue
            explicit = isinstance(row, dict) and row.get("id") not in (None, "")
            if sample.id in seen and not explicit:  # same content, no id: number the repeats
                n = hash_counts.get(sample.id, 1) + 1
                hash_counts[sample.id] = n
                sample = Sample(f"{sample.id}~{n}", sample.dataset, sample.messages, sample.tools, sample.source)
            if sample.id in taken:
                what = (f"duplicate id {row['id']!r}" if explicit and sample.id in seen
                        else f"sample id {sample.id!r} collides with an earlier row's")
                out.errors.append(RowError(spec.name, file, location, "id", f"{what} (first at {taken[sample.id]})"))
                continue
            taken[sample.id] = where
            seen.add(sample.id)
            out.samples.append(sample)
            kept += 1
        out.counts[spec.name] = kept
    return out


def sample_from_row(row: Any, dataset: str, *, source: str = "") -> Sample:  # noqa: PLR0912 - a check per field of an untrusted row
    """One row -> :class:`Sample`; raises ``_BadRow`` (field + message) when malformed."""
    if isinstance(row, _Unparsable):
        raise _BadRow("<line>", f"not valid JSON: {row.reason}")
    if isinstance(row, _WithBadCell):
        bad = next(v for v in row.values() if isinstance(v, _BadCell))
        raise _BadRow(bad.field, bad.message)
    if not isinstance(row, dict):
        rows = " (an array of rows? one object a line)" if isinstance(row, list) and row and isinstance(row[0], dict) else ""
        raise _BadRow("<row>", f"expected a JSON object, got {type(row).__name__}{rows}")
    messages = _conversation(row)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages:
        raise _BadRow("messages", "no user or tool turn left to answer")
    if messages[-1]["role"] not in ("user", "tool"):
        raise _BadRow(f"messages[{len(messages) - 1}].role", f"conversation ends with a {messages[-1]['role']!r} turn")
    _check_plain_json(messages, "messages")
    tools = row.get("tools")
    if tools is not None:
        if isinstance(tools, str):  # parquet/arrow datasets often store tools as a JSON string
            tools = _json_field(tools, "tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise _BadRow("tools", "must be a list of tool objects")
        _check_plain_json(tools, "tools")
        tools = tools or None
    rid = row.get("id")
    if rid is not None and (not isinstance(rid, (str, int)) or isinstance(rid, bool)):
        raise _BadRow("id", f"must be a string or integer, got {type(rid).__name__}")
    if isinstance(row, _MaybeSurrogates):  # a JSONL line with \ud800-style escapes: check what is sent
        for key in _ROW_KEYS:
            if key in row:
                _check_utf8(row[key], key)
    if rid is None or rid == "":
        rid = content_hash(messages, tools)
    return Sample(id=sample_id(dataset, rid), dataset=dataset, messages=messages, tools=tools, source=source)


def sample_id(dataset: str, row_id: str | int) -> str:
    """``<dataset>-<row id>``, but a row id that already starts ``<dataset>-`` is kept as is.

    So the bundled ``chat`` rows ``chat-001`` stay ``chat-001``, not ``chat-chat-001``. A pure
    function of (dataset, row id): the same rows give the same ids on every resume.
    """
    rid = str(row_id)
    return rid if rid.startswith(f"{dataset}-") else f"{dataset}-{rid}"


def keep_stored_ids(
    rows: list[tuple[str, str, str, str]], stored: Container[str]
) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """``(id, dataset, ...)`` rows with the ids a run folder already holds, and the ids.

    Folders made before :func:`sample_id` stopped doubling the prefix hold
    ``chat-chat-001``: such a sample keeps its stored id, so resuming that folder sends
    (and bills) nothing again. New folders get the plain ids.
    """
    own = {row[0] for row in rows}  # a legacy id that is one of this run's own ids is that row's, not an old form
    out = []
    for row in rows:
        sid, dataset = row[0], row[1]
        legacy = f"{dataset}-{sid}"
        if sid.startswith(f"{dataset}-") and sid not in stored and legacy in stored and legacy not in own:
            row = (legacy, *row[1:])
        out.append(row)
    return out, [r[0] for r in out]


def _check_utf8(value: Any, path: str) -> None:
    """A lone surrogate (JSON ``"\\ud800"``) cannot be encoded, stored or sent: name its field."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _BadRow(path, f"lone surrogate {value[exc.start]!r} at character {exc.start}: not valid UTF-8") from None
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_utf8(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(k, f"{path}.<key>")
            _check_utf8(v, f"{path}.{k}")


class _NotJson(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _loads(text: str | bytes) -> Any:
    """JSON a dataset holds (a JSONL line, a field stored as JSON text), read as the row and
    exchange readers read it, NaN, Infinity and 1e400 refused: :class:`_NotJson` says why not."""
    try:
        return loads_finite(text, unique_keys=True)  # a key given twice: the stdlib keeps the last, silently
    except JsonLineError as exc:  # NaN, Infinity, 1e400: sent as they are, no API reads them
        raise _NotJson(exc.detail) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _NotJson(getattr(exc, "msg", str(exc))) from None
    except ValueError as exc:  # Python's int-string limit: a number of thousands of digits
        raise _NotJson(number_too_long(exc)) from None
    except RecursionError:
        raise _NotJson("nested too deep") from None


def _json_field(text: str, path: str) -> Any:
    """A field a dataset stores as JSON text (``messages``, ``tools``), decoded. What is
    decoded is what is sent, so a ``\\ud800`` escape inside that text is checked here: the
    row's own surrogate check only sees the outer string, which is plain ASCII."""
    try:
        value = _loads(text)
    except _NotJson as exc:
        raise _BadRow(path, f"not valid JSON: {exc.reason}") from None
    if _SURROGATE_ESCAPE.search(text.encode("utf-8", "surrogatepass")):
        _check_plain_json(value, path)  # bounded depth first: _check_utf8 recurses
        _check_utf8(value, path)
    return value


def _check_plain_json(value: Any, path: str) -> None:
    """Plain JSON at most MAX_DEPTH deep (iterative: a 100k-deep row must not blow the stack)."""
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        v, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _BadRow(where, f"nested more than {MAX_DEPTH} levels deep")
        if v is None or isinstance(v, (str, bool, int)):
            continue
        if isinstance(v, float):
            if v != v or v in (float("inf"), float("-inf")):
                raise _BadRow(where, f"{v!r} is not a JSON number")
            continue
        if isinstance(v, list):
            stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise _BadRow(where, f"key {k!r} is not a string")
                stack.append((x, f"{where}.{k}", depth + 1))
        else:
            raise _BadRow(where, f"a {type(v).__name__} is not a JSON value")


def content_hash(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """A stable 16-hex id for rows without one (same messages + tools -> same id)."""
    blob = json.dumps({"messages": messages, "tools": tools}, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _openai_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        value = _json_field(value, "messages")
    if not isinstance(value, list) or not value:
        raise _BadRow("messages", "must be a non-empty list of messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise _BadRow(f"messages[{i}]", "must be an object with role and content")
        why = role_fault(msg.get("role"))
        if why is not None:
            raise _BadRow(f"messages[{i}].role", why)
        clean = {k: msg[k] for k in _MESSAGE_KEYS if k in msg and msg[k] is not None}
        for key in ("name", "tool_call_id", "reasoning"):
            if key in clean and not isinstance(clean[key], str):
                raise _BadRow(f"messages[{i}].{key}", f"must be a string, got {type(clean[key]).__name__}")
        # the rule reconstruct holds the request to: a call it would refuse is never sent (and paid for)
        if fault := tool_calls_fault(clean):
            raise _BadRow(f"messages[{i}].{fault[0]}", fault[1])
        _check_content(clean, f"messages[{i}]", null="content" in msg)
        out.append(clean)
    return out


def _sharegpt_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _BadRow("conversations", "must be a non-empty list of turns")
    out = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise _BadRow(f"conversations[{i}]", "must be an object with 'from' and 'value'")
        who = turn.get("from")
        role = _SHAREGPT_ROLES.get(str(who).lower()) if who is not None else None
        if role is None:
            raise _BadRow(f"conversations[{i}].from", f"unknown speaker {who!r} (expected human, gpt, system or tool)")
        text = turn.get("value")
        if not isinstance(text, str):
            raise _BadRow(f"conversations[{i}].value", "must be a string")
        out.append({"role": role, "content": text})
    return out


#: The row keys that each hold a whole prompt, in the order one is read when several agree.
_SOURCES = ("messages", "conversations", "prompt")


def _conversation(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a row asks to send. A row may carry its prompt twice (UltraChat ships
    ``prompt`` beside ``messages``; LLaMA-Factory's ShareGPT rows a ``system`` column beside
    ``conversations``): where the copies agree, one is read; where they differ, which one
    the user meant is unknown, so the row is refused rather than one dropped in silence."""
    given = [k for k in _SOURCES if row.get(k) is not None]
    if not given:
        raise _BadRow("messages", "row has none of 'messages', 'conversations' or 'prompt'")
    filled = [k for k in given if row[k] not in ("", [])] or given[:1]  # an empty column beside a full one
    first = filled[0]
    if first == "prompt":
        messages = [{"role": "user", "content": _prompt_text(row)}]
    else:
        messages = _openai_messages(row[first]) if first == "messages" else _sharegpt_messages(row[first])
    for other in filled[1:]:
        if other == "conversations":
            _same_turns(messages, _sharegpt_messages(row[other]), first, other)
        else:
            prompt = _prompt_text(row).strip()  # edge whitespace is no disagreement: the conversation is sent
            users = [c.strip() for m in messages if m["role"] == "user" and isinstance(c := m.get("content"), str)]
            if prompt not in users[:1] + users[-1:]:
                raise _BadRow("prompt", f"differs from the first and the last user turn of '{first}': which to send is unclear")
    return _with_system(messages, row.get("system"))


def _prompt_text(row: dict[str, Any]) -> str:
    prompt = row["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise _BadRow("prompt", "must be a non-empty string")
    return prompt


def _same_turns(messages: list[dict[str, Any]], turns: list[dict[str, Any]], first: str, other: str) -> None:
    mine = [(m["role"], m.get("content")) for m in messages]
    theirs = [(t["role"], t["content"]) for t in turns]
    if mine != theirs:
        i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        raise _BadRow(f"{other}[{i}]", f"differs from '{first}' (turn {i}): which to send is unclear")


def _with_system(messages: list[dict[str, Any]], system: Any) -> list[dict[str, Any]]:
    """A row's ``system`` column: the system turn in front, or the one the conversation has."""
    if system is None or system == "":
        return messages
    if not isinstance(system, str):
        raise _BadRow("system", "must be a string")
    own = [m for m in messages if m["role"] in ("system", "developer")]
    if not own:
        return [{"role": "system", "content": system}, *messages]
    if own[0].get("content") != system or messages[0] is not own[0]:
        raise _BadRow("system", "differs from the conversation's own system turn: which to send is unclear")
    return messages


def _check_content(msg: dict[str, Any], where: str, *, null: bool = False) -> None:
    """``null``: the row gave ``content`` as null (``msg`` holds no nulls), not left it out."""
    content = msg.get("content")
    if content is None:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            return
        why = "null: only an assistant message with tool_calls may have no content" if null else "missing"
        raise _BadRow(f"{where}.content", why)
    fault = content_fault(content)  # the rules the row check holds exports to (tokenbridge.content)
    if fault is not None:
        raise _BadRow(f"{where}.content{fault[0]}", fault[1])


# --- reading sources -------------------------------------------------------------------


def _source_rows(spec: DatasetSpec) -> Iterator[tuple[str, str, Any]]:
    """:func:`_iter_rows`, a source that cannot be read one :class:`PromptSourceError` that
    names the dataset, then the file (a config with several datasets says which one)."""
    try:
        yield from _iter_rows(spec)
    except PromptSourceError as exc:
        raise PromptSourceError(f"dataset {spec.name!r}: {exc}") from None
    except OSError as exc:  # any other open, stat or read the readers below leave unguarded
        raise PromptSourceError(f"dataset {spec.name!r}: {_unreadable(exc.filename or spec.path, exc)}") from None


def _unreadable(path: str | Path, exc: OSError) -> PromptSourceError:
    """``PATH: unreadable (Permission denied)``: the system's words for the errno when there
    is one (pyarrow's own text for it repeats the path), else what the error says."""
    why = os.strerror(exc.errno) if exc.errno else str(exc)
    return PromptSourceError(f"{path}: unreadable ({why})")


def _iter_rows(spec: DatasetSpec) -> Iterator[tuple[str, str, Any]]:
    """(file, location, row) for every row of the source, in order."""
    path = spec.path
    if not path.exists():
        raise PromptSourceError(f"{path} does not exist")
    if path.is_file():
        yield from _iter_file(path)
        return
    if not path.is_dir():  # a device or a FIFO: reading one would never end
        raise PromptSourceError(f"{path} is not a file or a folder")
    try:  # a folder without read or search permission: the folder is what cannot be read
        saved = _saved_markers(path)
        files, _ = _folder_files(path)
    except OSError as exc:
        raise _unreadable(path, exc) from None
    if "dataset_dict.json" in saved:
        yield from _iter_arrow_folder(_pick_split(path, spec))
        return
    if "state.json" in saved:
        yield from _iter_arrow_folder(path)
        return
    if not files:
        raise PromptSourceError(f"{path} holds no .jsonl/.parquet files and no save_to_disk data")
    for f in files:
        yield from _iter_file(f)


def _saved_markers(folder: Path) -> list[str]:
    """Which of a ``save_to_disk`` folder's metadata files ``folder`` holds (a split dataset's
    ``dataset_dict.json``, one split's ``state.json``): it is read as that, not as files."""
    return [name for name in ("dataset_dict.json", "state.json") if (folder / name).exists()]


#: The prompt files a folder's listing reads, by suffix in any case (``A.JSONL`` too).
_FOLDER_SUFFIXES = (".jsonl", ".parquet", ".arrow")


def _folder_files(folder: Path) -> tuple[list[Path], list[str]]:
    """The prompt files of ``folder`` in name order (hidden ones too, as always), and the
    names of its other entries, which are not read (sub-folders end in ``/``; hidden ones,
    ``.DS_Store``, ``.git/``, are not named)."""
    files, other = [], []
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.suffix.lower() in _FOLDER_SUFFIXES:
            files.append(p)
        elif not p.name.startswith("."):
            other.append(p.name + ("/" if p.is_dir() else ""))
    return files, other


def unread_entries(spec: DatasetSpec) -> list[str]:
    """What a dataset folder of prompt files holds besides them, which is not read (a
    ``.json`` file, a sub-folder): said, so nothing is left out in silence. Nothing for a
    file or a ``save_to_disk`` folder (its metadata files are read through its state)."""
    path = spec.path
    try:
        if not path.is_dir() or _saved_markers(path):
            return []
        return _folder_files(path)[1]
    except OSError:  # the read says why
        return []


def _check_regular(path: Path) -> None:
    """``path`` must be a regular file (stat, never opened): a FIFO a folder's metadata
    names blocked ``pa.memory_map`` forever, deaf to Ctrl-C, holding the run's lock."""
    if not path.is_file():
        why = "does not exist" if not path.exists() else "is not a regular file (a folder, FIFO or device)"
        raise PromptSourceError(f"{path}: {why}")


def _read_meta(path: Path) -> Any:
    """A save_to_disk metadata file (state.json, dataset_dict.json), parsed at most
    :data:`~tokenbridge.jsonl.MAX_DEPTH` deep: 100,000 levels raised RecursionError."""
    _check_regular(path)
    try:
        return loads_line(path.read_bytes())
    except OSError as exc:
        raise PromptSourceError(f"{path}: unreadable ({exc.strerror or exc})") from None
    except JsonLineError as exc:
        raise PromptSourceError(f"{path}: unreadable ({exc.detail})") from None


def _iter_file(path: Path) -> Iterator[tuple[str, str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _iter_parquet(path)
    elif suffix == ".arrow":
        yield from _iter_arrow(path)
    elif suffix in (".jsonl", ".json"):
        yield from _iter_jsonl(path)
    else:
        raise PromptSourceError(f"{path}: unknown prompt file type (expected .jsonl, .parquet or .arrow)")


def _iter_jsonl(path: Path) -> Iterator[tuple[str, str, Any]]:
    if plainly := binary_kind(path):  # UTF-16 text (PowerShell's ">"), gzip, ...: every line a bad row in codec words
        raise PromptSourceError(str(NotJsonlError(path, plainly)))
    try:
        fh = path.open("rb")
    except OSError as exc:  # no permission; replaced by a folder or removed since it was listed
        raise _unreadable(path, exc) from None
    lineno, first = 0, True
    with fh:
        try:
            for lineno, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    row = _loads(raw)
                except _NotJson as exc:
                    if first and raw.removeprefix(codecs.BOM_UTF8).lstrip()[:1] in (b"[", b"{") and (
                            kind := _one_document(path)):
                        raise PromptSourceError(
                            f"{path}: one JSON {kind} over several lines, not JSON lines: prompts are read one "
                            f"object per line (`jq -c {'.[]' if kind == 'array' else '.'} FILE` writes it so)") from None
                    row = _Unparsable(exc.reason)
                else:
                    # only a \uD800-\uDFFF escape makes a lone surrogate (Arrow strings are decoded as UTF-8)
                    if isinstance(row, dict) and _SURROGATE_ESCAPE.search(raw):
                        row = _MaybeSurrogates(row)
                first = False
                yield str(path), f"line {lineno}", row
        except OSError as exc:  # a read error (EIO) part way: the rows after it are not there
            raise PromptSourceError(f"{path}: unreadable after line {lineno} "
                                    f"({os.strerror(exc.errno) if exc.errno else exc})") from None


#: The largest file read whole to tell whether it is one JSON document (a pretty-printed array).
_DOCUMENT_BYTES = 64 << 20


def _one_document(path: Path) -> str | None:
    """"array" or "object" where the whole file is one JSON value of that kind written over
    several lines (``json.dump(rows, f, indent=2)``), which read line by line gave a bad row
    a line and a sample of any line that happened to be an object; else None."""
    try:
        if path.stat().st_size > _DOCUMENT_BYTES:
            return None
        value = loads_document(path.read_bytes().removeprefix(codecs.BOM_UTF8))  # its shape only: a key twice is fine
    except (OSError, ValueError):  # JsonLineError: not one JSON document
        return None
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else None


def _iter_parquet(path: Path) -> Iterator[tuple[str, str, Any]]:
    import pyarrow as pa  # imported on use: JSONL-only runs skip its startup time and memory
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        _unique_columns(path, pf.schema_arrow.names)
        names = [n for n in dict.fromkeys(pf.schema_arrow.names) if n in _ROW_KEYS]
    except OSError as exc:
        if exc.errno:  # the file cannot be opened or read (pyarrow's errors say "Parquet" otherwise)
            raise _unreadable(path, exc) from None
        raise PromptSourceError(f"{path}: cannot read parquet: {exc}") from None
    except pa.ArrowException as exc:
        raise PromptSourceError(f"{path}: cannot read parquet: {exc}") from None
    # only the columns a row is read from: a damaged or odd column no row uses is not read
    yield from _batch_rows(path, _read_batches(path, pf.iter_batches(batch_size=1024, columns=names)))


def _unique_columns(path: Path, names: Sequence[str]) -> None:
    """A row column (``prompt``, ``messages``...) the file holds twice is no dataset to send:
    each row's value would be whichever the reader kept (the last, silently)."""
    twice = sorted({n for n in names if n in _ROW_KEYS and names.count(n) > 1})
    if twice:
        raise PromptSourceError(f"{path}: column(s) {', '.join(map(repr, twice))} appear twice: which to send is unclear")


def _read_batches(path: Path, batches: Iterator[Any]) -> Iterator[Any]:
    """``batches`` of a Parquet file, a page that cannot be decoded (damaged bytes: "Invalid
    BYTE_ARRAY value", a bad compressed block) one :class:`PromptSourceError` naming the file
    and where: the reader cannot go on past it, and a file cut short is no dataset to send."""
    import pyarrow as pa

    index = 0
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError, ValueError) as exc:  # ArrowInvalid is a ValueError too
            raise PromptSourceError(f"{path}: cannot read parquet: damaged at row {index} or after ({exc})") from None
        if batch is None:
            return
        yield batch
        index += batch.num_rows


def _iter_arrow(path: Path) -> Iterator[tuple[str, str, Any]]:
    # `save_to_disk` writes Arrow IPC *stream* files; plain `.arrow` files may be either kind.
    import pyarrow as pa
    import pyarrow.ipc

    try:
        with pa.memory_map(str(path)) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_file(source).read_all()
    except OSError as exc:
        if exc.errno:
            raise _unreadable(path, exc) from None
        raise PromptSourceError(f"{path}: cannot read Arrow data: {exc}") from None
    except pa.ArrowException as exc:
        raise PromptSourceError(f"{path}: cannot read Arrow data: {exc}") from None
    _unique_columns(path, table.schema.names)
    table = table.select([i for i, name in enumerate(table.schema.names) if name in _ROW_KEYS])
    # an IPC file's offsets are the file's bytes, unchecked: one out of bounds crashed to_pylist (SIGSEGV)
    yield from _batch_rows(path, table.to_batches(max_chunksize=1024), check_layout=True)


def _batch_rows(path: Path, batches: Iterable[Any], *, check_layout: bool = False) -> Iterator[tuple[str, str, Any]]:
    """(file, "row N", row) over Arrow record batches, N counted from 0 across batches.
    ``check_layout``: the batches come from the file's own buffers (Arrow IPC), so their
    offsets are checked before any value is read (Parquet's reader builds its own)."""
    index = 0
    for batch in batches:
        if check_layout:
            for name, column in zip(batch.schema.names, batch.columns):
                _check_layout(path, name, column, index)
        for row in _batch_values(path, batch, index):
            yield str(path), f"row {index}", row
            index += 1


def _conversion_errors() -> tuple[type[BaseException], ...]:
    """What converting Arrow values to Python raises for data it cannot take (invalid UTF-8
    is a UnicodeDecodeError, a ValueError; a timestamp out of Python's range an OverflowError)."""
    import pyarrow as pa

    return pa.ArrowException, ValueError, OverflowError, TypeError


def _batch_values(path: Path, batch: Any, first: int) -> list[Any]:
    """The rows of ``batch`` (its first is row ``first``) as dicts: the whole batch at once,
    or, when a value cannot be converted (a string column's bytes that are not UTF-8, which
    other writers than pyarrow store), column by column and then value by value: the row
    holding it becomes one bad row naming the field, the others go on."""
    try:
        rows: list[Any] = batch.to_pylist()
        return rows
    except _conversion_errors():
        pass
    rows = [{} for _ in range(batch.num_rows)]
    for name, column in zip(batch.schema.names, batch.columns):
        for row, value in zip(rows, _column_values(path, name, column, first)):
            row[name] = value
    return [_WithBadCell(row) if any(isinstance(v, _BadCell) for v in row.values()) else row for row in rows]


def _check_layout(path: Path, name: str, column: Any, first: int) -> Any:
    """``column`` viewed with its strings as bytes (same buffers), fully validated: offsets in
    bounds, so reading any value is safe whatever its bytes are. Damage there is the file's."""
    try:
        raw = column.view(_bytes_type(column.type))
        raw.validate(full=True)
    except _conversion_errors() as exc:
        raise PromptSourceError(f"{path}: column {name!r}, rows {first} to {first + len(column) - 1}: "
                                f"damaged ({exc})") from None
    return raw


def _column_values(path: Path, name: str, column: Any, first: int) -> list[Any]:
    """The values of one column: a :class:`_BadCell` (naming the field inside the value, as
    ``messages[1].content``) for each that cannot be read."""
    try:
        values: list[Any] = column.to_pylist()
        return values
    except _conversion_errors():
        pass
    raw = _check_layout(path, name, column, first)
    out: list[Any] = []
    for k in range(len(raw)):
        try:
            out.append(_decoded(raw[k].as_py(), column.type, name))
        except _BadRow as bad:
            out.append(_BadCell(bad.field, bad.message))
        except _conversion_errors() as exc:
            out.append(_BadCell(name, f"cannot be read ({type(exc).__name__}: {exc})"))
    return out


@lru_cache(maxsize=1)
def _text_types() -> dict[Any, Any]:
    """Each Arrow string type -> the binary type of the same layout."""
    import pyarrow as pa

    texts = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}
    if hasattr(pa, "string_view"):  # pyarrow 16+
        texts[pa.string_view()] = pa.binary_view()
    return texts


def _bytes_type(t: Any) -> Any:
    """``t`` with every string type the binary type of the same layout (a zero-copy view)."""
    import pyarrow as pa

    types, texts = pa.types, _text_types()
    if t in texts:
        return texts[t]
    if types.is_list(t) or types.is_large_list(t) or types.is_fixed_size_list(t):
        item = t.value_field.with_type(_bytes_type(t.value_type))
        if types.is_fixed_size_list(t):
            return pa.list_(item, t.list_size)
        return pa.large_list(item) if types.is_large_list(t) else pa.list_(item)
    if types.is_map(t):
        return pa.map_(_bytes_type(t.key_type), _bytes_type(t.item_type), keys_sorted=t.keys_sorted)
    if types.is_struct(t):
        return pa.struct([t.field(i).with_type(_bytes_type(t.field(i).type)) for i in range(t.num_fields)])
    if types.is_dictionary(t):
        return pa.dictionary(t.index_type, _bytes_type(t.value_type), t.ordered)
    return t


def _decoded(value: Any, t: Any, where: str) -> Any:
    """A value read through :func:`_bytes_type`'s view, its strings decoded as ``t`` says;
    ``_BadRow`` names the first that is not UTF-8."""
    import pyarrow as pa

    types = pa.types
    if value is None:
        return None
    if isinstance(value, bytes) and t in _text_types():
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _BadRow(where, f"not valid UTF-8 (byte 0x{value[exc.start]:02x} at byte {exc.start}: "
                                  f"{exc.reason})") from None
    if types.is_list(t) or types.is_large_list(t) or types.is_fixed_size_list(t):
        return [_decoded(v, t.value_type, f"{where}[{i}]") for i, v in enumerate(value)]
    if types.is_map(t):
        return [(_decoded(k, t.key_type, f"{where}.<key>"), _decoded(v, t.item_type, f"{where}[{i}]"))
                for i, (k, v) in enumerate(value)]
    if types.is_struct(t):
        fields = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
        return {k: _decoded(v, fields[k], f"{where}.{k}") for k, v in value.items()}
    if types.is_dictionary(t):
        return _decoded(value, t.value_type, where)
    return value


@dataclass(frozen=True)
class _BadCell:
    """An Arrow value that could not be read, and the field inside it that failed."""

    field: str
    message: str


class _WithBadCell(dict[str, Any]):
    """An Arrow row holding a :class:`_BadCell`: a bad row naming its field."""


def _iter_arrow_folder(folder: Path) -> Iterator[tuple[str, str, Any]]:
    files = [folder / name for name in _data_files(folder)]
    for f in files:
        _check_regular(f)
    for f in files:
        yield from _iter_arrow(f)


def _data_files(folder: Path) -> list[str]:
    """The Arrow files a ``save_to_disk`` folder's ``state.json`` lists, checked: each a file
    of this folder, named once. A name with a folder part (``/data/x.arrow``, ``../x``) read
    a file elsewhere as this dataset, and one listed twice read it twice."""
    where = folder / "state.json"
    state = _read_meta(where)
    listed = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(listed, list):
        got = (f"a top level that is {type(state).__name__}" if not isinstance(state, dict) else "no such key"
               if "_data_files" not in state else repr(listed)[:80])
        raise PromptSourceError(f"{where}: _data_files: must be a list of {{\"filename\": ...}} objects (what "
                                f"datasets' save_to_disk writes), got {got}")
    names: list[str] = []
    for i, entry in enumerate(listed):
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not _plain_name(name):
            raise PromptSourceError(f"{where}: _data_files[{i}].filename: must name a file in {folder} (no folder "
                                    f"part), got {name!r}"[:400])
        if name in names:
            raise PromptSourceError(f"{where}: _data_files[{i}].filename: {name!r} is listed twice (its rows would be "
                                    "read twice)"[:400])
        names.append(name)
    return names


def _plain_name(name: Any) -> TypeGuard[str]:  # Any: a value from a metadata file
    """Whether ``name`` names an entry of a folder: no folder part, not ``.`` or ``..``."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _pick_split(folder: Path, spec: DatasetSpec) -> Path:
    where = folder / "dataset_dict.json"
    data = _read_meta(where)
    found = data.get("splits") if isinstance(data, dict) else None
    if not isinstance(found, list) or not all(isinstance(s, str) for s in found):
        raise PromptSourceError(f"{where}: splits: must be a list of split names, got {found!r}")
    bad = next((s for s in found if not _plain_name(s)), None)  # "../other": another folder read as a split
    if bad is not None:  # ("" too: the folder itself)
        raise PromptSourceError(f"{where}: splits: {bad!r} names no folder in {folder}"[:400])
    splits: list[str] = found
    if spec.split:
        if spec.split not in splits:
            raise PromptSourceError(f"split {spec.split!r} not in {folder} (has {splits})")
        return folder / spec.split
    if len(splits) == 1:
        return folder / splits[0]
    if "train" in splits:
        return folder / "train"
    raise PromptSourceError(f"{folder} has splits {splits}; name one with split=")


class _MaybeSurrogates(dict[str, Any]):
    """A JSONL row whose text has surrogate escapes: checked field by field for lone ones."""


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class _Unparsable:
    """A JSONL line that is not JSON; turned into a RowError by sample_from_row."""

    reason: str

