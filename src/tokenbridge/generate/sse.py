"""Server-sent events: decode the byte stream, and fold chunks into one chat.completion.

:class:`SSEDecoder` follows the WHATWG event-stream rules (a leading BOM dropped, CR/LF/CRLF line ends, ``:``
comment lines such as OpenRouter's ``: OPENROUTER PROCESSING`` keep-alives, multi-line
``data``) and is fed arbitrary byte slices. :class:`StreamAssembler` merges
``chat.completion.chunk`` objects into the JSON a non-streamed call returns: text
fields concatenate (content, reasoning, tool-call arguments), list fields extend
(logprobs, per-choice ``token_ids``), and anything else keeps its last non-null value,
so fields we do not know about survive. Every shape it cannot fold (``choices`` that is not
a list, a choice, tool call or ``reasoning_details`` entry that is not an object, ``tool_calls``
or ``reasoning_details`` that is not a list, a ``function`` that is not an object) is a
:class:`StreamError`, never another exception: the stream was billed, and the engine books it.
"""

from __future__ import annotations

import codecs
import io
import re
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterator

import orjson

from ..evidence import no_finish
from ..jsonl import JsonLineError, is_count, is_int, repeated_key
from .secrets import ApiKey, scrub

__all__ = ["SSEDecoder", "SSEEvent", "StreamAssembler", "StreamError"]

_CHOICE_FIXED = ("index", "delta", "message", "finish_reason", "native_finish_reason", "logprobs")


class StreamError(ValueError):
    """The stream cannot be turned into a response (bad chunk JSON, truncated)."""


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str = "message"


#: A run of line ends (CRLF, LF or CR): one regex match, so a flood of bare CRs or blank
#: lines costs one C-level scan, not a Python step per line.
_EOLS = re.compile(r"[\r\n]+")
_ONE_EOL = frozenset({"\r", "\n", "\r\n"})
MAX_COMMENTS = 16  # comment lines kept as a sample; the raw stream holds them all
MAX_COMMENT_CHARS = 200


@dataclass
class SSEDecoder:
    """Incremental event-stream decoder: ``feed(bytes)`` yields complete events.

    Linear in the bytes fed: each chunk is scanned once, and a line that spans chunks is
    accumulated (never re-scanned or re-copied per chunk). Memory stays within a small
    multiple of the current line plus the current event's data: ``comments`` keeps only
    the first :data:`MAX_COMMENTS` (clipped), ``comment_count`` counts them all. A line in
    two pieces, or an event of one data line (the common cases), is a plain string; a
    third piece or a second line moves it into a :class:`io.StringIO`."""

    comments: list[str] = field(default_factory=list)
    comment_count: int = 0
    _decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("strict"))
    _partial: str | io.StringIO | None = None  # the current line's start, from earlier chunks
    _data: str | io.StringIO | None = None  # the current event's data lines, joined by LF
    _event: str = ""
    _pending_cr: bool = False
    _begun: bool = False  # text has come: a byte-order mark is looked for before the first only

    def feed(self, chunk: bytes) -> Iterator[SSEEvent]:
        """The events ``chunk`` completes. Bytes that do not decode raise
        :class:`UnicodeDecodeError`, but only after the events before them: a ``[DONE]`` and
        the usage ahead of junk are still delivered (the decoder keeps its state, so the
        bad bytes are skipped)."""
        held, _ = self._decoder.getstate()
        try:
            text = self._decoder.decode(chunk)
        except UnicodeDecodeError as exc:
            yield from self._scan((held + chunk)[: exc.start].decode("utf-8"))
            raise
        yield from self._scan(text)

    def close(self) -> Iterator[SSEEvent]:
        """End of stream: a last event without its blank line is still delivered."""
        yield from self._scan(self._decoder.decode(b"", final=True))
        if self._partial is not None:
            line = _text(self._partial)
            self._partial = None
            event = self._line(line)
            if event is not None:
                yield event
        if self._data is not None:
            yield self._dispatch()

    def _scan(self, text: str) -> Iterator[SSEEvent]:
        if not self._begun and text:
            self._begun = True
            if text[0] == "\ufeff":  # one leading BOM is no part of the stream (WHATWG): else the
                text = text[1:]  # first line's field is "\ufeffdata" and its event is lost
        pos = 0
        if text and self._pending_cr:
            self._pending_cr = False
            if text[0] == "\n":
                pos = 1  # the LF of a CRLF split across two reads
        if "\r" not in text and "\n\n\n" not in text:  # what servers send: LF ends, one blank line between events
            yield from self._lf_lines(text[pos:] if pos else text)
            return
        for m in _EOLS.finditer(text, pos):
            event = self._line(self._completed(text[pos : m.start()]))
            if event is not None:
                yield event
            ends = m.group()
            if ends not in _ONE_EOL:  # two or more line ends: a blank line (more are no-ops)
                event = self._line("")
                if event is not None:
                    yield event
            pos = m.end()
            self._pending_cr = pos == len(text) and ends[-1] == "\r"
        if pos < len(text):
            self._hold(text[pos:])

    def _lf_lines(self, text: str) -> Iterator[SSEEvent]:
        """:meth:`_scan` of text whose line ends are all LF, never three in a row: one C-level
        split (half the time per event of the run scan), the same events."""
        lines = text.split("\n")
        rest = lines.pop()  # after the last LF: the next line's start ("" when the text ends a line)
        if lines:
            lines[0] = self._completed(lines[0])
        for line in lines:
            event = self._line(line)
            if event is not None:
                yield event
        if rest:
            self._hold(rest)

    def _completed(self, end: str) -> str:
        """The line that ``end`` ends: with its start from earlier chunks, if any."""
        held, self._partial = self._partial, None
        if held is None:
            return end
        return held + end if isinstance(held, str) else _text(_joined(held, end))

    def _hold(self, rest: str) -> None:
        """Keep ``rest``, a line's start with no line end yet, after what is held."""
        self._partial = rest if self._partial is None else _joined(self._partial, rest)

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            if self._data is not None:
                return self._dispatch()
            self._event = ""
            return None
        if line[0] == ":":
            self.comment_count += 1
            if len(self.comments) < MAX_COMMENTS:
                self.comments.append(line[1:].strip()[:MAX_COMMENT_CHARS])
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data = value if self._data is None else _joined(self._data, "\n", value)
        elif name == "event":
            self._event = value
        return None

    def _dispatch(self) -> SSEEvent:
        data = _text(self._data) if self._data is not None else ""
        event = SSEEvent(data, self._event or "message")
        self._data = None
        self._event = ""
        return event


def _joined(held: str | io.StringIO, *more: str) -> io.StringIO:
    """``held`` with ``more`` after it, in a buffer: a plain string is copied once, when a
    second piece arrives; a buffer grows in place."""
    if isinstance(held, str):
        buf = io.StringIO()
        buf.write(held)
        held = buf
    for piece in more:
        held.write(piece)
    return held


def _text(held: str | io.StringIO) -> str:
    return held if isinstance(held, str) else held.getvalue()


@dataclass
class StreamAssembler:
    """Fold ``chat.completion.chunk`` objects into one ``chat.completion`` dict.

    A chunk that is refused is quoted in the error, masked of ``key`` (the key the request
    sent) before it is clipped: a clip can cut a key short of what a later mask finds."""

    top: dict[str, Any] = field(default_factory=dict)
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)
    messages: dict[int, dict[str, Any]] = field(default_factory=dict)
    tool_calls: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)
    reasoning_details: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    errors: list[Any] = field(default_factory=list)
    done: bool = False
    chunks: int = 0
    key: ApiKey | str | None = field(default=None, repr=False)

    def add_event(self, event: SSEEvent) -> None:
        """Fold one event. Chunks come as ``message`` events (no ``event:`` line); an
        ``event: error`` is the server's error, as an ``error`` object in a chunk is; an event
        of another type (a ping) is passed over, unless it carries ``choices``, text that
        would be lost (then the stream is refused), or ``usage`` or ``error`` (folded, as a
        chunk's: the answer's cost, or its failure)."""
        data = event.data.strip()
        if not data:
            return
        if data == "[DONE]":
            self.done = True
            return
        if event.event == "error":
            try:
                value: Any = orjson.loads(data)
            except ValueError:
                value = {"message": scrub(data, self.key)[:200]}
            self.errors.append(value.get("error", value) if isinstance(value, dict) else {"message": value})
            return
        try:
            chunk = orjson.loads(data)  # strict, as every reader downstream: no NaN, 1e400, lone surrogate
        except ValueError as exc:
            if event.event != "message":
                return
            raise StreamError(f"stream chunk is not JSON ({exc}): {self._quoted(data)}") from None
        if event.event != "message":
            if isinstance(chunk, dict) and chunk.get("choices"):
                raise StreamError(f"an event of type {scrub(event.event, self.key)[:40]!r} carries choices: "
                                  f"{self._quoted(data)}")
            if not (isinstance(chunk, dict) and ("usage" in chunk or "error" in chunk)):
                return  # a ping; one with usage or an error still says what the answer cost, or that it failed
        if not isinstance(chunk, dict):
            raise StreamError(f"stream chunk is not an object: {self._quoted(data)}")
        try:  # a chunk that is read gives each key once: which of two values counts, no reader can say
            repeated_key(chunk, data)
        except JsonLineError as exc:
            raise StreamError(f"stream chunk{' at ' + exc.field if exc.field else ''}: {exc.detail}: "
                              f"{self._quoted(data)}") from None
        self.add(chunk)

    def add_late(self, event: SSEEvent) -> None:
        """An event after ``[DONE]`` in the same read: no part of the response, but a usage
        chunk a server sends that late still says what the answer cost (it went unbooked,
        and a run under ``--max-cost`` stopped as if answers carried no cost)."""
        try:
            chunk = orjson.loads(event.data)
            repeated_key(chunk, event.data)  # a key given twice: the cost is unknown, as for no chunk at all
        except ValueError:  # JsonLineError too
            return
        if (isinstance(chunk, dict) and not chunk.get("choices") and isinstance(chunk.get("usage"), dict)
                and self.top.get("usage") is None):
            self.top["usage"] = chunk["usage"]

    def _quoted(self, data: str) -> str:
        return repr(scrub(data, self.key)[:200])

    def add(self, chunk: dict[str, Any]) -> None:
        """Fold one chunk. Its top-level fields (``usage`` among them) are taken before its
        choices are checked, so a chunk refused for its choices still says what it cost."""
        self.chunks += 1
        for key, value in chunk.items():
            if key == "choices":
                continue
            if key == "error":
                if value is not None:
                    self.errors.append(value)
                continue
            if value is not None or key not in self.top:
                self.top[key] = value
        for choice in _objects(chunk.get("choices"), "choices", "a choice"):
            self._add_choice(choice)

    def _add_choice(self, choice: dict[str, Any]) -> None:
        idx = choice.get("index") or 0
        if not is_count(idx):
            raise StreamError(f"stream chunk has choice index {idx!r}, not a non-negative integer")
        out = self.choices.setdefault(idx, {"index": idx})
        msg = self.messages.setdefault(idx, {})
        delta = choice.get("delta") or choice.get("message") or {}
        if not isinstance(delta, dict):
            raise StreamError(f"stream chunk has a choice delta that is a {type(delta).__name__}, not an object")
        for key, value in delta.items():
            if key == "tool_calls":
                self._add_tool_calls(idx, _objects(value, "tool_calls", "a tool call"))
            elif key == "reasoning_details":
                self._add_reasoning_details(idx, _objects(value, "reasoning_details", "a reasoning_details entry"))
            elif key == "role":
                if value:
                    msg["role"] = value
            else:
                msg[key] = _merge_value(msg.get(key), value, concat=True)
        for key in ("finish_reason", "native_finish_reason"):  # a later null or "" does not undo a finish
            if key in choice and (not no_finish(choice[key]) or key not in out):
                out[key] = choice[key]
        if "logprobs" in choice:
            out["logprobs"] = _merge_logprobs(out.get("logprobs"), choice["logprobs"])
        for key, value in choice.items():
            if key in _CHOICE_FIXED:
                continue
            if key == "error" and value is not None:
                self.errors.append(value)
            out[key] = _merge_value(out.get(key), value, concat=False)

    def _add_tool_calls(self, idx: int, calls: list[dict[str, Any]]) -> None:
        slots = self.tool_calls.setdefault(idx, {})
        for pos, call in enumerate(calls):
            k = call.get("index", len(slots) if call.get("id") else max(slots, default=pos))
            if not is_int(k):
                raise StreamError(f"stream chunk has tool call index {k!r}, not an integer")
            slot = slots.setdefault(k, {"index": k})
            for key, value in call.items():
                if key == "index":
                    continue
                if key == "function" and value is not None:
                    if not isinstance(value, dict):
                        raise StreamError(f"stream chunk has a tool call function of type {type(value).__name__}, "
                                          "not an object")
                    fn = slot.setdefault("function", {})
                    for fk, fv in value.items():
                        fn[fk] = _merge_value(fn.get(fk), fv, concat=fk in ("name", "arguments"))
                elif value is not None:
                    slot[key] = value

    def _add_reasoning_details(self, idx: int, items: list[dict[str, Any]]) -> None:
        acc = self.reasoning_details.setdefault(idx, [])
        for item in items:
            target = None
            if "index" in item:
                target = next((d for d in acc if d.get("index") == item["index"]), None)
            elif acc and acc[-1].get("type") == item.get("type") and "index" not in acc[-1]:
                target = acc[-1]
            if target is None:
                acc.append(dict(item))
                continue
            for key, value in item.items():
                if key in ("text", "summary", "data", "signature"):
                    target[key] = _merge_value(target.get(key), value, concat=True)
                elif value is not None:
                    target[key] = value

    def result(self) -> dict[str, Any]:
        """The assembled ``chat.completion`` (raises :class:`StreamError` if nothing arrived)."""
        if not self.chunks:
            raise StreamError("stream ended before any chunk")
        out: dict[str, Any] = {}
        for key, value in self.top.items():
            out[key] = "chat.completion" if key == "object" else value
        out.setdefault("object", "chat.completion")
        choices = []
        for idx in sorted(self.choices):
            choice = self.choices[idx]
            msg = {"role": "assistant", **self.messages.get(idx, {})}
            msg.setdefault("content", None)
            if idx in self.tool_calls:
                msg["tool_calls"] = [self.tool_calls[idx][k] for k in sorted(self.tool_calls[idx])]
            if idx in self.reasoning_details:
                msg["reasoning_details"] = self.reasoning_details[idx]
            built = {"index": idx, "message": msg}
            built.update({k: v for k, v in choice.items() if k != "index"})
            built.setdefault("finish_reason", None)
            choices.append(built)
        usage = out.pop("usage", None)
        out["choices"] = choices
        if usage is not None or "usage" in self.top:
            out["usage"] = usage
        return out

    @property
    def finished(self) -> bool:
        """Every choice got a finish_reason (a stream cut short has none)."""
        return bool(self.choices) and all(c.get("finish_reason") for c in self.choices.values())


def _objects(value: Any, name: str, what: str) -> list[dict[str, Any]]:
    """``value`` as a list of objects (null: none), else :class:`StreamError`: the one check of
    a list-valued chunk field, so no shape reaches the folding code that it would trip on."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise StreamError(f"stream chunk has {name} of type {type(value).__name__}, not a list")
    for item in value:
        if not isinstance(item, dict):
            raise StreamError(f"stream chunk has {what} of type {type(item).__name__}, not an object")
    return value


def _merge_value(old: Any, new: Any, *, concat: bool) -> Any:
    if new is None:
        return old
    if old is None:
        return list(new) if isinstance(new, list) else new
    if isinstance(old, list) and isinstance(new, list):
        return old + new
    if concat and isinstance(old, str) and isinstance(new, str):
        return old + new
    return new


def _merge_logprobs(old: Any, new: Any) -> Any:
    if not isinstance(new, dict):
        return old if new is None else new
    if not isinstance(old, dict):
        return {k: (list(v) if isinstance(v, list) else v) for k, v in new.items()}
    merged = dict(old)
    for key, value in new.items():
        merged[key] = _merge_value(merged.get(key), value, concat=False)
    return merged
