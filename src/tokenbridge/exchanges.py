"""Exchange records: one request and the response exactly as the API returned it.

Validation happens here, once, so that every error names the field that is wrong
(``request.messages[2].role``) and the reader can add the file and line.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NotRequired, TypedDict
from collections.abc import Callable, Iterator, Mapping

from . import jsonl
from .content import content_fault, reasoning_fault, role_fault, tool_calls_fault, tools_fault
from .jsonl import is_int, iter_lines, not_text

__all__ = ["CheckedResponse", "Exchange", "ExchangeRecord", "RecordError", "check_request", "check_response", "choice_index",
           "iter_lines", "iter_objects", "keys_once", "loads_line", "parse_exchange", "repeated_id"]


class RecordError(ValueError):
    """A record is malformed; ``field`` is a dotted path into the record."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message
        self.line: int | None = None


class NativeIds(TypedDict, total=False):
    prompt: list[int] | None
    choices: list[list[int] | None]


class ExchangeRecord(TypedDict):
    """An exchange record as it sits on disk (one line of ``exchanges.jsonl``): the request
    as sent and the response exactly as returned. Untrusted: :func:`parse_exchange` checks
    it and gives an :class:`Exchange`."""

    id: str | int
    dataset: NotRequired[str | None]
    request: dict[str, Any]  # messages (non-empty), tools?, chat_template_kwargs?, ...
    response: dict[str, Any]  # choices, or an error body
    native_ids: NotRequired[list[int] | NativeIds | None]  # ground truth: completion ids, or {prompt, choices}
    meta: NotRequired[dict[str, Any]]  # generate's provider, latency_s, cost, attempts, started_at, ...


@dataclass(frozen=True)
class Exchange:
    id: str
    request: Mapping[str, Any]
    response: Mapping[str, Any]
    dataset: str | None
    meta: Mapping[str, Any]
    native_prompt: list[int] | None
    native_choices: list[list[int] | None]


def _check_content(content: Any, field: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RecordError(field, "must be a string, a list of parts or null")
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise RecordError(f"{field}[{k}]", "must be an object ({type: text, text: ...} or an image part)")
        if "text" in part and not isinstance(part["text"], str):
            raise RecordError(f"{field}[{k}].text", "must be a string")


#: The string field each ``reasoning_details`` entry type carries.
_DETAIL_FIELDS = {"reasoning.text": "text", "reasoning.summary": "summary", "reasoning.encrypted": "data"}


def _check_details(details: Any, field: str) -> None:
    """OpenRouter's ``reasoning_details``: a list of typed objects (unknown types pass)."""
    if details is None:
        return
    if not isinstance(details, list):
        raise RecordError(field, "must be a list or null")
    for k, entry in enumerate(details):
        if not isinstance(entry, dict):
            raise RecordError(f"{field}[{k}]", "must be an object")
        kind = entry.get("type")
        key = _DETAIL_FIELDS.get(kind) if isinstance(kind, str) else None
        if key is not None and entry.get(key) is not None and not isinstance(entry[key], str):
            raise RecordError(f"{field}[{k}].{key}", "must be a string or null")
        index = entry.get("index")
        if index is not None and not is_int(index):
            raise RecordError(f"{field}[{k}].index", "must be an integer")


#: One past the largest token id any tokenizer can have: engines and tokenizers hold ids
#: as unsigned 32-bit integers, so a larger (or negative) one is no id at all.
ID_LIMIT = 2**32


def _int_list(value: Any, field: str) -> list[int]:
    """A list of token ids from the API: integers in ``[0, 2**32)``. Whether each id is in
    this tokenizer's vocabulary is the gate's question (``native_mismatch``), not a shape error."""
    if not isinstance(value, list) or not all(is_int(i) for i in value):
        raise RecordError(field, "must be a list of integers")
    if value and (min(value) < 0 or max(value) >= ID_LIMIT):
        pos, bad = next((k, i) for k, i in enumerate(value) if not 0 <= i < ID_LIMIT)
        shown = str(bad) if bad.bit_length() <= 64 else f"a {'negative ' if bad < 0 else ''}{bad.bit_length()}-bit integer"
        raise RecordError(field, f"item {pos} is {shown}: a token id is an integer from 0 to {ID_LIMIT - 1}")
    return value


def parse_exchange(record: Any) -> Exchange:
    """Check an exchange record's shape (:class:`ExchangeRecord`) and pull out what reconstruction needs."""
    if not isinstance(record, dict):
        raise RecordError("<record>", f"must be a JSON object, got {type(record).__name__}")
    if "id" not in record:
        raise RecordError("id", "missing")
    rid = record["id"]
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise RecordError("id", "must be a string or an integer")
    if rid == "":
        raise RecordError("id", "must not be empty (every row is named by it)")
    request = check_request(record.get("request"))
    checked = check_response(record.get("response"))
    response = checked.response
    native_prompt, native_choices = _native_ids(record, checked)
    meta = record.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise RecordError("meta", f"must be an object or null, got {type(meta).__name__}")
    dataset = record.get("dataset")
    if dataset is not None and not isinstance(dataset, str):
        raise RecordError("dataset", f"must be a string or null, got {type(dataset).__name__}")
    for field, value in (("id", rid), ("dataset", dataset), ("request.model", request.get("model")),
                         ("meta.provider", (meta or {}).get("provider"))):
        _check_names_text(field, value)
    return Exchange(
        id=str(rid),
        request=request,
        response=response,
        dataset=dataset,
        meta=meta or {},
        native_prompt=native_prompt,
        native_choices=native_choices,
    )


def _check_names_text(field: str, value: Any) -> None:
    """A name every row carries (id, dataset, provider, model) must be text: one holding a
    lone surrogate could be written by no output (UTF-8 JSON, Parquet, the dataset card,
    the report), so it is refused here, by name, not left to break each of them later."""
    if why := not_text(value):
        raise RecordError(field, why)


def check_request(request: Any) -> dict[str, Any]:
    """``request``: an object with non-empty ``messages`` (each with a string role, its
    content and tool calls in shape), ``tools`` a list, ``chat_template_kwargs`` an object,
    the thinking switches reconstruction reads booleans. The one set of rules for a request:
    a stored one here, and the one a config would send (generate checks it at load, before
    a request is paid for, so no paid record is refused for its request)."""
    if not isinstance(request, dict):
        raise RecordError("request", "missing" if request is None else "must be an object")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RecordError("request.messages", "missing" if messages is None else "must be a non-empty list")
    for i, m in enumerate(messages):
        _check_message(m, f"request.messages[{i}]")
    tools = request.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RecordError("request.tools", "must be a list")
    if fault := tools_fault(tools):  # as the row check exports by
        raise RecordError(f"request.tools{fault[0]}", fault[1])
    for key in ("chat_template_kwargs", "extra_body", "reasoning"):  # read for the thinking switch and stop
        value = request.get(key)
        if value is not None and not isinstance(value, dict):
            raise RecordError(f"request.{key}", f"must be an object or null, got {type(value).__name__}")
    _check_switches(request)
    n = request.get("n")
    if n is not None and not (is_int(n) and n >= 1):
        raise RecordError("request.n", f"must be a positive integer or null, got {n!r}"[:200])
    return request


#: The ``chat_template_kwargs`` switches :func:`~tokenbridge.chat.dialect.thinking_enabled` reads.
_SWITCH_KEYS = ("thinking", "enable_thinking")


def _check_switches(request: dict[str, Any]) -> None:
    """The thinking switches are booleans or null: a quoted ``"false"`` is neither on nor
    off to the reader (it compares with ``False``), so the prompt would be rendered in a
    mode the provider may not have run in."""
    reasoning = request.get("reasoning") or {}
    if reasoning.get("enabled") is not None and not isinstance(reasoning["enabled"], bool):
        raise RecordError("request.reasoning.enabled", f"must be true, false or null, got {reasoning['enabled']!r}"[:200])
    extra = request.get("extra_body") or {}
    nested = extra.get("chat_template_kwargs")
    if nested is not None and not isinstance(nested, dict):
        raise RecordError("request.extra_body.chat_template_kwargs",
                          f"must be an object or null, got {type(nested).__name__}")
    for at, kwargs in (("request", request.get("chat_template_kwargs")), ("request.extra_body", nested)):
        for key in _SWITCH_KEYS:
            value = (kwargs or {}).get(key)
            if value is not None and not isinstance(value, bool):
                raise RecordError(f"{at}.chat_template_kwargs.{key}", f"must be true, false or null, got {value!r}"[:200])


def _check_message(m: Any, at: str) -> None:
    """A request message by the rules prompt loading sends and the row check exports by
    (:mod:`.content`): a record whose prompt an export would refuse (a ``human`` role, a
    content part without ``type``) is a bad line here, not an ``ok`` row that stops every
    export of the file."""
    if not isinstance(m, dict):
        raise RecordError(at, "must be an object")
    if "role" not in m:
        raise RecordError(f"{at}.role", "missing")
    if why := role_fault(m["role"]):
        raise RecordError(f"{at}.role", why)
    if fault := content_fault(m.get("content")):
        raise RecordError(f"{at}.content{fault[0]}", fault[1])
    for fault in (reasoning_fault(m), tool_calls_fault(m)):
        if fault is not None:
            raise RecordError(f"{at}.{fault[0]}", fault[1])


def choice_index(choice: Mapping[str, Any], position: int) -> int:
    """The index a choice's rows carry: its ``index`` where that is a count Parquet's int32
    holds, else its place in ``choices`` (a negative, huge or non-integer index is no index)."""
    index = choice.get("index")
    return index if is_int(index) and 0 <= index < 2**31 else position


def _checked_choices(response: dict[str, Any]) -> list[dict[str, Any]]:
    """``response.choices`` (empty for an error body), each an object whose message has its
    text fields in shape."""
    choices = response.get("choices")
    if choices is None:
        if "error" not in response:
            raise RecordError("response.choices", "missing (and the response carries no error)")
        return []
    if not isinstance(choices, list):
        raise RecordError("response.choices", "must be a list")
    indexes: dict[int, int] = {}
    for i, c in enumerate(choices):
        if not isinstance(c, dict):
            raise RecordError(f"response.choices[{i}]", "must be an object")
        index = choice_index(c, i)  # a row is named by (id, choice): one choice an index
        if index in indexes:
            raise RecordError(f"response.choices[{i}].index", f"{index} is also the index of choices[{indexes[index]}]")
        indexes[index] = i
        finish = c.get("finish_reason")
        if finish is not None and not isinstance(finish, str):
            raise RecordError(f"response.choices[{i}].finish_reason", f"must be a string or null, got {type(finish).__name__}")
        msg = c.get("message")
        at = f"response.choices[{i}].message"
        if not isinstance(msg, dict):
            raise RecordError(at, "missing or not an object")
        _check_content(msg.get("content"), f"{at}.content")
        for key in ("reasoning", "reasoning_content"):
            if msg.get(key) is not None and not isinstance(msg[key], str):
                raise RecordError(f"{at}.{key}", "must be a string or null")
        if msg.get("tool_calls") is not None and not isinstance(msg["tool_calls"], list):
            raise RecordError(f"{at}.tool_calls", "must be a list or null")
        _check_details(msg.get("reasoning_details"), f"{at}.reasoning_details")
    return choices


@dataclass(frozen=True)
class CheckedResponse:
    """A response in the shape the reader takes (:func:`check_response`): its choices, and
    the ground-truth ids it carries itself (vLLM's ``prompt_token_ids`` / ``choices[].token_ids``,
    SGLang's ``choices[].prompt_token_ids`` / ``choices[].response_token_ids``)."""

    response: dict[str, Any]
    choices: list[dict[str, Any]]
    prompt_ids: list[int] | None
    choice_ids: list[list[int] | None]


def check_response(response: Any) -> CheckedResponse:
    """``response``: an object whose choices (none only for an error body) are objects with
    a message whose text fields are in shape, a string or null ``finish_reason``, one index
    each, ids that are token ids, and a provider and model that are text. The one set of
    rules for a response: a stored one here, and every 200 generate keeps (it refuses one
    that breaks them as ``bad_choices``, retried and billed), so no paid answer is stored
    as done that reconstruct would then refuse as a bad line."""
    if not isinstance(response, dict):
        raise RecordError("response", "missing" if response is None else "must be an object")
    choices = _checked_choices(response)
    prompt_ids = _agreed_ids(None, response.get("prompt_token_ids"), "response.prompt_token_ids", "")
    choice_ids: list[list[int] | None] = [None] * len(choices)
    for i, c in enumerate(choices):
        at = f"response.choices[{i}]"
        prompt_ids = _agreed_ids(prompt_ids, c.get("prompt_token_ids"), f"{at}.prompt_token_ids", "the prompt ids before it")
        ids = _agreed_ids(None, c.get("token_ids"), f"{at}.token_ids", "")
        choice_ids[i] = _agreed_ids(ids, c.get("response_token_ids"), f"{at}.response_token_ids", f"{at}.token_ids")
    for field in ("provider", "model"):
        _check_names_text(f"response.{field}", response.get(field))
    return CheckedResponse(response, choices, prompt_ids, choice_ids)


def _agreed_ids(known: list[int] | None, value: Any, field: str, known_from: str) -> list[int] | None:
    """``value`` (ids as one engine names them) read as token ids, where ``known`` (the same
    ids as another field gave them) is None or the same list; ids that differ are no evidence."""
    if value is None:
        return known
    ids = _int_list(value, field)
    if known is not None and ids != known:
        raise RecordError(field, f"differs from {known_from}: the engine gave two different id lists for the same text")
    return ids


def _native_ids(record: dict[str, Any], checked: CheckedResponse) -> tuple[list[int] | None, list[list[int] | None]]:
    """Ground-truth ids: vLLM's inside the response, then the record's ``native_ids`` (a
    list: the first choice's; an object: ``prompt`` and ``choices``), which win."""
    n = len(checked.choices)
    native_prompt = checked.prompt_ids
    native_choices = list(checked.choice_ids)
    native = record.get("native_ids")
    if isinstance(native, list):
        if n:
            native_choices[0] = _int_list(native, "native_ids")
    elif isinstance(native, dict):
        unknown = sorted(set(native) - {"prompt", "choices"})
        if unknown:
            raise RecordError(f"native_ids.{unknown[0]}"[:200], "unknown key: native_ids holds prompt and choices")
        if native.get("prompt") is not None:
            native_prompt = _int_list(native["prompt"], "native_ids.prompt")
        if native.get("choices") is not None and not isinstance(native["choices"], list):
            raise RecordError("native_ids.choices", "must be a list (one id list or null per choice)")
        for i, ids in enumerate(native.get("choices") or ()):
            if i < n and ids is not None:
                native_choices[i] = _int_list(ids, f"native_ids.choices[{i}]")
    elif native is not None:
        raise RecordError("native_ids", "must be a list of ids or {prompt, choices}")
    return native_prompt, native_choices


def loads_line(line: str) -> Any:
    """Parse one JSONL line (:func:`tokenbridge.jsonl.loads_line`, which keeps lone
    surrogate escapes for the gate); a line that is not JSON raises RecordError."""
    try:
        return jsonl.loads_line(line)
    except jsonl.JsonLineError as exc:
        raise RecordError(exc.field or "<line>", exc.detail) from None


def keys_once(value: Any, line: bytes | memoryview) -> Any:  # Any: any JSON value
    """``value``, what orjson read from ``line``, if no object in the line gives a key
    twice (:func:`tokenbridge.jsonl.repeated_key`), else RecordError naming the object."""
    try:
        jsonl.repeated_key(value, line)
    except jsonl.JsonLineError as exc:
        raise RecordError(exc.field or "<line>", exc.detail) from None
    return value


def repeated_id(seen: dict[bytes, int], record_id: str, line: int) -> str | None:
    """Why the record on ``line`` is left out: an earlier line has its id (``seen``: id
    digests -> their lines, noted here the first time), or None. Each record is read once:
    its rows are named by id and choice, and export takes each once."""
    # 128 bits: a collision would drop a record as a repeat; at a million ids, odds of 1e-27
    digest = hashlib.blake2b(record_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    earlier = seen.setdefault(digest, line)
    if earlier == line:
        return None
    return f"{record_id!r} is also the id of line {earlier}: each record once (its rows are named by id and choice)"


def iter_objects(path: str | Path, on_bad: Callable[[RecordError], None] | None = None,
                 ) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a JSONL file, lazily; a line
    that is not a JSON object raises RecordError with field ``<line>`` (its ``line`` set),
    or, given ``on_bad``, is handed to it and skipped."""
    for lineno, line in iter_lines(path):
        try:
            obj = loads_line(line)
        except RecordError as exc:
            err = exc
        else:
            if isinstance(obj, dict):
                yield lineno, obj
                continue
            err = RecordError("<line>", f"must be a JSON object, got {type(obj).__name__}")
        err.line = lineno
        if on_bad is None:
            raise err
        on_bad(err)


