"""JSON lines as tokenbridge reads and writes them, and the checks on JSON numbers.

Every JSONL file (exchange records, reconstructed rows, exports) goes through this pair:

* :func:`loads_line` parses with orjson and falls back to the stdlib for what orjson
  refuses: a lone surrogate escape (``"\\ud800"``) is not valid UTF-8, but it is what the
  API sent and the gate must still see it. The fallback refuses what orjson refuses and
  JSON does not have: ``NaN``, ``Infinity`` and a number that overflows a double
  (``1e400``), which every writer would turn into ``null`` or a literal no reader takes;
* :func:`loads_document` reads a whole JSON file (a tokenizer's config, a provider
  profile, a marker) as the stdlib does, every way it can fail one :class:`JsonLineError`:
  a document nested deeper than Python's stack raised RecursionError, which was exit 8;
* :func:`dumps_line` writes compact JSON with orjson, and ASCII-escapes (stdlib) when the
  value holds lone surrogates, so the file stays valid UTF-8;
* :func:`iter_lines` gives the non-blank lines of a file with their numbers (bytes that
  are no UTF-8 kept as surrogate escapes, so that :func:`loads_line` names the field
  holding them where the line is read);
* :func:`json_text` is a value as the compact JSON text Parquet columns hold;
* :func:`value_key` is a key that tells JSON values apart, for caches of what is derived
  from one (the tool declarations a whole dataset repeats).

JSON has one number type, and Python reads ``true`` as a bool, which is an ``int``:
:func:`is_int` / :func:`is_count` are the one test for "an integer" / "a non-negative
integer" of a value from outside.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any, TypeGuard
from collections.abc import Callable, Iterator

import orjson

__all__ = ["MAX_DEPTH", "JsonLineError", "NotJsonlError", "binary_kind", "dumps_document", "dumps_line", "is_count", "is_int", "iter_lines", "json_text",
           "loads_document", "loads_finite", "loads_line", "not_text", "number_too_long", "path_step", "repeated_key", "text_of", "unencodable",
           "value_key"]


class JsonLineError(ValueError):
    """A line (or a document, :func:`loads_document`) that is not valid JSON; ``detail``
    says where in it, and ``field`` is the dotted path of the value at fault where one is
    known (the object that gives a key twice; ``""`` for the line's own object), else None."""

    def __init__(self, detail: str, field: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field = field


#: The deepest nesting a line may have: orjson's own limit, and what the API bodies
#: generate stores may hold (:mod:`tokenbridge.generate.body`).
MAX_DEPTH = 1024


# Any: a JSON line holds any JSON value; callers check its shape.
def loads_line(line: str | bytes) -> Any:
    """Parse one JSON line: orjson for speed, the stdlib for what orjson refuses (lone
    surrogate escapes, which the gate must still see). A leading UTF-8 byte order mark
    (what Windows tools write at a file's start) is dropped, for text and bytes alike: the
    stdlib skipped it on bytes only, so export read a line that inspect and reconstruct
    refused. An object that gives a key twice is refused (:func:`repeated_key`): orjson
    keeps the last value, other readers the first. So is a line that holds bytes which are
    no UTF-8, naming the field they are in (:func:`_raw_bytes`). Raises :class:`JsonLineError`."""
    line = _without_bom(line)
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        pass
    else:
        repeated_key(value, line)
        return value
    text = line if isinstance(line, str) else bytes(line).decode("utf-8", "surrogateescape")
    if (refused := _raw_bytes(text)) is not None:
        raise refused
    try:
        return loads_finite(line, unique_keys=True)
    except JsonLineError as exc:
        if exc.field is not None:  # valid JSON, a key given twice: said as it is
            raise
        raise JsonLineError(f"not valid JSON ({exc.detail})") from None
    except json.JSONDecodeError as exc:
        # the stdlib's message may end in "at" already ("Invalid control character at")
        raise JsonLineError(f"not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise JsonLineError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:  # orjson stops at 1024 levels, the stdlib at Python's stack
        raise JsonLineError(f"nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:  # Python's int-string limit: a ValueError, not a JSONDecodeError
        raise JsonLineError(f"not valid JSON ({number_too_long(exc)})") from None


def loads_finite(text: str | bytes, *, unique_keys: bool = False) -> Any:  # Any: any JSON value
    """The stdlib's ``json.loads``, refusing what JSON has no spelling for (``NaN``,
    ``Infinity``, a float past a double such as ``1e400``, which the stdlib reads and
    every writer then turns into null or a literal ``NaN`` no reader takes): a
    :class:`JsonLineError` naming the number and its field. The stdlib's own errors
    (JSONDecodeError, RecursionError, the int-string limit's ValueError) propagate."""
    hook = _unique_object if unique_keys else None
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float, object_pairs_hook=hook)
    except _NotFinite:
        raise JsonLineError(_not_finite_where(text)) from None
    except _RepeatedKey:
        _refuse_repeated(text)  # raises, naming where
        raise JsonLineError("a key appears twice in one object") from None  # pragma: no cover - the same parse met it


def _raw_bytes(line: str) -> JsonLineError | None:
    """The error for a line that held bytes which are no UTF-8, read as bytes or from a file
    with ``surrogateescape`` (:func:`iter_lines`), or None: JSON text is UTF-8 (RFC 8259), so the file
    is damaged or in another encoding, as the same line read as bytes says. Each such byte
    is a stand-in character (U+DC80-U+DCFF) in the text; a lone surrogate the sender escaped
    (``"\\udcff"``) is six ASCII characters there, JSON the gate must see. The field holding
    the first byte is named where the line is JSON otherwise and escapes no such surrogate
    (then a stand-in in a string can only be a byte)."""
    if line.isascii():
        return None
    try:
        raw = line.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate no file read gave: the parse decides
        return None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        detail = f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start}: {exc.reason})"
    else:
        return None
    field = None
    if not _ESCAPED_STAND_IN.search(line):
        try:
            found = _find(json.loads(line), _holds_stand_in)
        except (ValueError, RecursionError):
            found = None
        if found is not None:
            where, item = found
            field = where if isinstance(item, str) else f"{where or '<top>'} (a key)"
    return JsonLineError(detail, field)


#: What ``surrogateescape`` makes of a byte that is no UTF-8, and the JSON escape of one.
_STAND_IN = re.compile("[\udc80-\udcff]")
_ESCAPED_STAND_IN = re.compile(r"\\u[dD][cC][89a-fA-F][0-9a-fA-F]")


def _holds_stand_in(item: Any) -> bool:  # Any: any JSON value
    if isinstance(item, str):
        return _STAND_IN.search(item) is not None
    return isinstance(item, dict) and any(_STAND_IN.search(k) for k in item)


def repeated_key(value: Any, line: str | bytes | memoryview) -> None:  # Any: the value orjson read from ``line``
    """Raise :class:`JsonLineError` if an object in ``line`` gives a key twice: orjson
    kept the last value, the stdlib does too, other readers keep the first, and which one
    the sender meant no reader can tell. ``value`` is what orjson read from ``line``.

    Cheap where it can be, in three steps, each taken only if the one before cannot tell:

    1. a line that is ``value`` as orjson writes it (compact, as our writers, the emulator
       and most servers write) holds each key once: writing ``value`` again costs a third
       of reading it;
    2. the line's key ends are counted (:func:`_key_ends`, at least the keys it has), and
       it repeats none when that is the number of keys ``value`` has: the stdlib's
       ``", "`` form, ``\\u00e9`` escapes, about as much as reading it again;
    3. else (a string that starts with a colon, a long run of backslashes) the stdlib
       parses it again, seeing every pair: five times orjson's read."""
    if isinstance(line, str):
        line = line.strip(_JSON_SPACE).encode("utf-8", "surrogateescape")
    else:
        line = bytes(line).strip(_JSON_SPACE_BYTES)
    try:
        if _may_be_compact(line) and orjson.dumps(value) == line:
            return
    except TypeError:  # not expected from orjson's own read: then the next steps decide
        pass
    if _key_ends(line) == _key_count(value):
        return
    _refuse_repeated(line)


def _may_be_compact(line: bytes) -> bool:
    """False where ``line`` is surely not as orjson writes it: whitespace follows its first
    ``":`` (the stdlib's ``": "``), so step 1 would only cost a write. A ``":`` inside a
    string is escaped, so the first one ends a key unless it is ``\\":`` in one: then
    step 2 decides what step 1 might have, no slower than now and no less exact."""
    at = line.find(b'":')
    return at < 0 or line[at + 2 : at + 3] not in _JSON_SPACE_ONE


#: One byte of JSON whitespace, as ``bytes`` slices give it.
_JSON_SPACE_ONE = frozenset((b" ", b"\t", b"\r", b"\n"))

#: A quote, JSON whitespace, a colon: where every key ends (see :func:`_key_ends`).
_KEY_END = re.compile(rb'"[ \t\r\n]*:')
_BACKSLASH = 0x5C


def _key_ends(line: bytes) -> int:
    """At least the number of keys in the JSON ``line``, or -1 (a run of more than
    :data:`_LONG_RUN` backslashes before a key end's quote). Every key ends with an unescaped
    quote, JSON whitespace, a colon: a :data:`_KEY_END` of its own. A quote is escaped
    when an odd run of backslashes stands before it (each pair is one escaped backslash,
    in a string, the only place JSON has them): not counted. A quote that opens a string
    starting with a colon (``":"``) is counted too, which only makes the count larger."""
    count = 0
    for found in _KEY_END.finditer(line):
        at = found.start()
        if at > 0 and line[at - 1] == _BACKSLASH:
            run = 1
            while run < at and line[at - run - 1] == _BACKSLASH:
                run += 1
                if run > _LONG_RUN:  # walked a byte at a time: a crafted run costs the stdlib's parse, no more
                    return -1
            if run % 2:
                continue
        count += 1
    return count


#: The longest run of backslashes before a quote :func:`_key_ends` counts (a key's own
#: text rarely ends in more than a few); past it the line goes to the stdlib's parse.
_LONG_RUN = 64


def _key_count(value: Any) -> int:  # Any: any JSON value
    """How many keys the objects in ``value`` have, all told."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:  # orjson's own types: no subclass to miss
            count += len(item)
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)
    return count


#: JSON's whitespace (RFC 8259): what may stand around a value on its line.
_JSON_SPACE = " \t\r\n"
_JSON_SPACE_BYTES = _JSON_SPACE.encode()


class _RepeatedKey(Exception):
    pass


class _Twice(dict[str, Any]):
    """An object that gave ``key`` twice, marked in the stdlib's parse while
    :func:`_refuse_repeated` finds its path."""

    key = ""


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict, or :class:`_RepeatedKey` where a key is given twice
    (``unique_keys``; :func:`_refuse_repeated` then names it)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _RepeatedKey
    return out


def _first_repeated(pairs: list[tuple[str, Any]]) -> str:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    raise AssertionError("no key repeats")  # pragma: no cover - called only when one does


def _refuse_repeated(text: str | bytes) -> None:
    """Parse ``text`` with the stdlib, which sees every pair, and raise
    :class:`JsonLineError` naming the first object (by its path) that gives a key twice;
    return if none does. A line too deep or with too long a number for the stdlib is
    refused as unreadable: orjson read it, but nothing can say its keys are unique."""
    marked: list[_Twice] = []

    def mark(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            out = _Twice(out)
            out.key = _first_repeated(pairs)
            marked.append(out)
        return out

    try:
        value = _stdlib_pairs(text, mark)
    except RecursionError:
        raise JsonLineError(f"nested too deeply to check that no key is given twice (more than {MAX_DEPTH} "
                            "levels)") from None
    except ValueError as exc:  # orjson read it: only the stdlib's own limits are left
        raise JsonLineError(f"not valid JSON ({number_too_long(exc)})") from None
    if not marked:
        return
    found = _find(value, lambda item: isinstance(item, _Twice))
    where, item = found if found is not None else ("", marked[0])
    raise JsonLineError(f"the key {_clipped(item.key)!r} appears twice in one object: which value is meant is "
                        "unclear (readers keep the first or the last)", where)


def _stdlib_pairs(text: str | bytes, hook: Callable[[list[tuple[str, Any]]], Any]) -> Any:  # Any: any JSON value
    """``text`` read by the stdlib with ``hook`` seeing every object's pairs. The stdlib
    recurses once per level and stops at Python's recursion limit (1000 frames, less the
    caller's): a line as deep as orjson reads (:data:`MAX_DEPTH`) is read again with the
    limit raised by that much, for this call only."""
    try:
        return json.loads(text, object_pairs_hook=hook)
    except RecursionError:
        pass
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + MAX_DEPTH + 64)
    try:
        return json.loads(text, object_pairs_hook=hook)
    finally:
        sys.setrecursionlimit(limit)


def _find(value: Any, test: Callable[[Any], bool]) -> tuple[str, Any] | None:  # Any: any JSON value
    """The first item of ``value`` (depth first, in order) that passes ``test``, with its
    path (:func:`_path`; ``""`` for ``value`` itself), or None. Each item visited keeps
    its parent and its key or index, and only the found one's path is written: a path
    string per item cost a long key's length once per element of a list below it."""
    steps: list[tuple[int, str | int]] = []
    stack: list[tuple[Any, int, str | int]] = [(value, -1, "")]
    while stack:
        item, parent, step = stack.pop()
        steps.append((parent, step))
        here = len(steps) - 1
        if test(item):
            return _path(steps, here), item
        if isinstance(item, dict):
            stack.extend((v, here, k) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((item[i], here, i) for i in range(len(item) - 1, -1, -1))
    return None


#: The longest key a path or a message quotes in full, and the longest path.
_KEY_SHOWN, _PATH_SHOWN = 40, 200


def _clipped(key: str) -> str:
    return key if len(key) <= _KEY_SHOWN else key[:_KEY_SHOWN] + "…"


def path_step(step: str | int) -> str:
    """One step of a value's path as messages name it: ``[0]`` for an index, ``.key``, and a
    key that is empty or holds ``.``, ``[``, ``]`` or ``"`` quoted (``["b.c"]``), a long one
    clipped. Joined, less the leading dot: ``choices[0].message``, ``a["b.c"]``."""
    if isinstance(step, int):
        return f"[{step}]"
    if step and not any(c in step for c in '.[]"'):
        return "." + _clipped(step)
    return f"[{json.dumps(_clipped(step), ensure_ascii=False)}]"


def _path(steps: list[tuple[int, str | int]], at: int) -> str:
    """The path of item ``at`` in :func:`_find`'s steps (:func:`path_step`), a path past
    200 characters kept at its end."""
    out: list[str] = []
    while at > 0:
        at, step = steps[at]
        out.append(path_step(step))
    path = "".join(reversed(out)).removeprefix(".")
    return path if len(path) <= _PATH_SHOWN else "…" + path[-_PATH_SHOWN:]


def loads_document(text: str | bytes, *, unique_keys: bool = False) -> Any:  # Any: any JSON value
    """A whole JSON document from outside (a tokenizer folder's config, a provider profile,
    a report, a marker), read by the stdlib as it is (``NaN`` too, which Python's own
    writers put in configs). Every way it can fail is one :class:`JsonLineError` (a
    ValueError) saying why, for the caller to name the file: not JSON (with its line and
    column), not UTF-8, a number of more digits than Python reads, or nested deeper than
    Python's stack (the stdlib recurses per level: ``[`` * 100,000 raised RecursionError,
    which no caller expected, and the command ended as an internal error).

    ``unique_keys``: an object that gives a key twice is refused by its path (a file a
    user writes or edits; one read as its own tools read it, a tokenizer folder's config
    as transformers does, keeps the last value as they do)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonLineError(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise JsonLineError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise JsonLineError("nested too deeply to read") from None
    except ValueError as exc:  # Python's int-string limit: a ValueError, not a JSONDecodeError
        raise JsonLineError(f"not valid JSON ({number_too_long(exc)})") from None
    if unique_keys:  # read again, every pair seen (a small file: what else is wrong in it is said first)
        _refuse_repeated(text)
    return value


def _without_bom(line: str | bytes) -> str | bytes:
    """``line`` without a leading byte order mark (orjson refuses one)."""
    if isinstance(line, str):
        return line[1:] if line.startswith("\ufeff") else line
    return line[3:] if line.startswith(b"\xef\xbb\xbf") else line


class _NotFinite(Exception):
    """A number JSON has no spelling for (the stdlib's ``NaN`` / ``Infinity``, or a float
    literal past a double's range); raised from inside ``json.loads``."""


class _Bad:
    """Stands for a non-finite number while :func:`_not_finite_where` finds its field."""

    def __init__(self, text: str) -> None:
        self.text = text


def _refuse_constant(name: str) -> Any:
    raise _NotFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: orjson refuses it, the stdlib reads inf
        raise _NotFinite(text)
    return value


def _placeholder_float(text: str) -> float | _Bad:
    value = float(text)
    return value if math.isfinite(value) else _Bad(text)


def _not_finite_where(line: str | bytes) -> str:
    """What :func:`loads_line` says of a line holding a non-finite number: the number and
    the field that holds it (``usage.cost``), found by parsing again with placeholders.
    Only on the error path, so the happy path pays nothing."""
    value = json.loads(line, parse_constant=_Bad, parse_float=_placeholder_float)
    found = _find(value, lambda item: isinstance(item, _Bad))
    if found is None:  # pragma: no cover - the first parse found one
        return "a number that is not finite"
    where, item = found
    return f"{item.text[:40]}{' at ' + where if where else ''}: JSON has no NaN or infinity"


def unencodable(value: Any, *, numbers: bool = True) -> str | None:  # Any: any JSON value
    """Where ``value`` (what the stdlib read) holds what neither JSON nor UTF-8 can carry,
    in words naming its path, or None: a string or key with a lone surrogate (``"\\ud800"``
    reads, but no prompt holding it can be encoded) or, with ``numbers``, a number that is
    not finite (``NaN``, ``1e400``). For readers that must keep what the stdlib keeps (big
    integers exact, a byte order mark) and refuse what a strict one refuses.

    One orjson write proves the common case in C: it refuses a lone surrogate, and writes a
    non-finite number as ``null``, so a write without ``null`` holds none. Only a value it
    cannot prove is walked in Python, for the path to name (about 30 us for a small request)."""
    try:
        written = orjson.dumps(value)
    except TypeError:  # a lone surrogate, or an integer past 64 bits (which is fine): the walk tells
        pass
    else:
        if not numbers or b"null" not in written:
            return None
    found = _find(value, _unencodable_item)
    if found is None:
        return None
    where, item = found
    what = "a number that is not finite" if isinstance(item, float) else "a lone surrogate (not UTF-8)"
    return f"{where or '<top>'}: holds {what}"


def _unencodable_item(item: Any) -> bool:  # Any: any JSON value
    if isinstance(item, str):
        return not_text(item) is not None
    if isinstance(item, float):
        return not math.isfinite(item)
    return isinstance(item, dict) and any(not_text(k) is not None for k in item)


def number_too_long(exc: ValueError) -> str:
    """What ``json.loads``'s other ValueError means: a number of more digits than Python
    converts (``sys.get_int_max_str_digits``; orjson refuses it too). Said as a fault of
    the line, which it is, not as the interpreter's advice to raise the limit."""
    if "integer string conversion" in str(exc):
        return f"a number of more than {sys.get_int_max_str_digits()} digits"
    return str(exc)


def dumps_line(obj: Any) -> bytes:  # Any: any JSON value
    """One compact JSON line (no newline) as UTF-8 bytes; ASCII-escaped when the text
    holds lone surrogates (or anything else orjson refuses), so the file stays valid UTF-8."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def json_text(value: Any) -> str:  # Any: any JSON value
    """A JSON value as compact JSON text (the lone-surrogate fallback included)."""
    return dumps_line(value).decode("utf-8")


def value_key(value: Any) -> bytes | None:  # Any: any JSON value
    """Equal for two JSON values exactly when they are equal with every object's keys in
    sorted order, types included (``1``, ``1.0`` and ``true`` differ; a tuple is the array
    it is sent as); None for what is not JSON. A cache key for what depends on a value
    only through its sorted form. orjson's sorted dump where it is exact (0.6 us for a
    tool list); it writes NaN and the infinities as ``null``, which the stdlib's (written
    ``NaN``, ``Infinity``, 15x slower) keeps apart, so a dump that holds ``null``
    anywhere, or that orjson refuses (lone surrogates, integers past 64 bits), is the
    stdlib's. The two forms never meet: one leads with a byte saying which."""
    try:
        fast = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        fast = b"null"
    if b"null" not in fast:
        return b"o" + fast
    try:  # the stdlib writes a key 1 as "1": such a value is not JSON, and has no key
        text = json.dumps(value, sort_keys=True, ensure_ascii=True, allow_nan=True)
    except (TypeError, ValueError):  # not JSON (a set, a cycle, keys of mixed types)
        return None
    return b"s" + text.encode("ascii") if _string_keys(value) else None


def _string_keys(value: Any) -> bool:
    """Whether every object in ``value`` has only string keys (no cycles: the caller's dump
    has refused those)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if not all(isinstance(k, str) for k in item):
                return False
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return True


def iter_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-blank lines of a JSONL file, lazily; bytes that are
    not UTF-8 stay in the text as surrogate escapes (:func:`loads_line` refuses them, by field)."""
    with open(path, encoding="utf-8", errors="surrogateescape") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                yield lineno, line


def is_int(value: object) -> TypeGuard[int]:
    """A JSON integer: an ``int`` that is not a bool (``true`` reads as ``1``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: object) -> TypeGuard[int]:
    """A JSON count: a non-negative integer, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: A UTF-16 surrogate on its own: JSON can spell one (``"\\ud800"``), but it is not text.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def not_text(value: object) -> str | None:
    """Why a string read from JSON is not text (a lone surrogate, which no UTF-8 output can
    write), or None: for the names every row carries (id, dataset, provider, model)."""
    if isinstance(value, str) and not value.isascii() and (m := _LONE_SURROGATE.search(value)):
        return f"holds a lone surrogate (U+{ord(m.group()):04X} at character {m.start()}): not text, and no output can write it"
    return None


def text_of(value: str) -> str:
    """``value`` with each lone surrogate written as its escape (``\\ud800``): text every
    output can write, for a message quoting an API's words."""
    if value.isascii() or not _LONE_SURROGATE.search(value):
        return value
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def dumps_document(value: Any, indent: int = 2) -> str:  # Any: any JSON value
    """``value`` as a JSON file a person reads (indented, non-ASCII as it is, a final
    newline), any lone surrogate kept as its ``\\u`` escape: a path with bytes that are
    not UTF-8, or an API's words, can always be written."""
    return text_of(json.dumps(value, indent=indent, ensure_ascii=False)) + "\n"


#: File types a JSONL input is sometimes by mistake, by their first bytes: (magic, name, what to do).
_MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"\x1f\x8b", "a gzip file", "decompress it first (gunzip)"),
    (b"BZh", "a bzip2 file", "decompress it first (bunzip2)"),
    (b"\xfd7zXZ\x00", "an xz file", "decompress it first (unxz)"),
    (b"\x28\xb5\x2f\xfd", "a zstd file", "decompress it first (unzstd)"),
    (b"PK\x03\x04", "a zip archive", "extract it first"),
    (b"PAR1", "a Parquet file", "give it a .parquet name where the command reads Parquet"),
    (b"ARROW1", "an Arrow file", "write it out as JSONL"),
    (b"SQLite format 3\x00", "an SQLite database", "give the JSONL file (a run's exchanges.jsonl, not its state.sqlite)"),
    # text in a wide encoding (PowerShell's ">" writes UTF-16): by its byte-order mark, or a
    # line's opening brace beside a NUL; UTF-32's marks first (UTF-16's is the start of one)
    *((magic, f"{name} text", f"convert it to UTF-8 first (iconv -f {name} -t UTF-8)") for magic, name in (
        (b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"), (b"{\x00\x00\x00", "UTF-32LE"),
        (b"\x00\x00\x00{", "UTF-32BE"), (b"\xff\xfe", "UTF-16LE"), (b"\xfe\xff", "UTF-16BE"), (b"{\x00", "UTF-16LE"),
        (b"\x00{", "UTF-16BE"))),
)


class NotJsonlError(ValueError):
    """An input that is plainly not JSONL (:func:`binary_kind`): the message names it
    (``name``, the path the user gave) and what to do."""

    def __init__(self, name: object, kind: tuple[str, str]) -> None:
        super().__init__(f"{name}: {kind[0]}, not JSONL: {kind[1]}")


def binary_kind(path: str | Path) -> tuple[str, str] | None:
    """(what the file is, what to do) when its first bytes say it is a compressed, Parquet,
    Arrow or SQLite file rather than text; None for anything else (JSONL, or unreadable:
    the reader then says why). A JSON line never starts with these bytes. Only a regular
    file is looked at: a pipe's bytes, once read, are gone for the reader after."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return None
    for magic, name, todo in _MAGIC:
        if head.startswith(magic):
            return name, todo
    return None
