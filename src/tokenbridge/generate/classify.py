"""Decide what one HTTP attempt means: keep it, retry it, fail the sample, or stop.

Pure functions of (status, headers, body) so the table is tested without a server.

=========================================  ===============  ================================
what came back                             kind             error_class
=========================================  ===============  ================================
200 with choices, none ``finish_reason:    ok
error``, no ``error`` beside them
200 not JSON / no choices                  retry            bad_json / no_choices
(or JSON that cannot be re-emitted: see
:mod:`.body`)
200 choices reconstruct would refuse       retry            bad_choices
(:func:`~tokenbridge.exchanges.
check_response`: no message, a text
field, finish_reason or id out of shape,
a repeated index)
200 ``{"error": ...}`` (OpenRouter), with  by its code      api_error (or http_<code>)
choices beside it or not
200 a choice with ``finish_reason: error``  retry            choice_error
(or a ``native_finish_reason`` of
``abort`` / ``error``, or no
``finish_reason`` at all)
408 409 425 5xx                            retry            http_<status>
429                                        rate_limited     http_429 (shrinks concurrency)
3xx (a redirect: not followed)             fail             http_<status>
400 401 403 other 4xx                      fail             http_<status>
402                                        payment          http_402 (stops the run)
404 "No endpoints found"                   unavailable      no_endpoints (fails that routing)
timeout / connection error                 retry            timeout / connection
a body compressed past this install        fail             bad_encoding
(``Content-Encoding: br`` without
Brotli, ``zstd`` without backports.zstd)
malformed URL                              fail             bad_url
=========================================  ===============  ================================

``Outcome.maybe_billed`` marks failures after which the provider may have generated (and
billed) tokens without telling us: read/total timeouts, a connection dropped once the
request was out, a cut or garbled stream, a body compressed past this install
(``bad_encoding``), and a 200 that is not kept (``bad_json``,
``no_choices``, ``bad_choices``, ``choice_error``: the provider answered, so it billed; an
``error`` body with choices beside it too).
A refused or timed-out *connect* was never sent.

A 200 that is not kept still hands back what can be read of its body (JSON read leniently:
``NaN``, ``1e400``, lone surrogates, repeated indexes), so its ``usage`` is booked; only a
body that is not JSON at all comes back with nothing, and is booked at its reservation.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import email.message
import email.utils
import json
import time
from dataclasses import dataclass
from typing import Any, Literal
from collections.abc import Mapping

import aiohttp
import orjson
from aiohttp.http_exceptions import HttpProcessingError

from ..evidence import NATIVE_FAILED, native_finish, no_finish
from ..exchanges import RecordError, check_response
from ..jsonl import is_int, text_of
from .body import BodyError, check_body
from .secrets import ApiKey, scrub

__all__ = ["Outcome", "classify_exception", "classify_response", "classify_too_large", "parse_retry_after", "RETRY_STATUSES"]

Kind = Literal["ok", "retry", "rate_limited", "fail", "unavailable", "payment"]
RETRY_STATUSES = frozenset({408, 409, 425, 429})
#: 200s that are answers, yet not kept: billed all the same (an ``{"error": ...}`` body is not an answer)
_UNKEPT_ANSWERS = frozenset({"bad_json", "no_choices", "bad_choices", "choice_error"})
_MAX_MESSAGE = 500


@dataclass(frozen=True)
class Outcome:
    kind: Kind
    error_class: str | None = None
    message: str = ""
    status: int | None = None
    retry_after: float | None = None
    maybe_billed: bool = False
    #: an answer (a 200, or a stream that ended) whose choice gave no finish_reason: sent
    #: again like any choice_error, and counted apart (``RunSummary.no_finish``), since a
    #: provider that never sends one is paid ``max_attempts`` times for every prompt
    no_finish: bool = False

    @property
    def retryable(self) -> bool:
        return self.kind in ("retry", "rate_limited")


def classify_response(
    status: int, headers: Mapping[str, str], body: bytes | str, *, key: ApiKey | str | None = None
) -> tuple[Outcome, dict[str, Any] | None]:
    """The outcome of one finished HTTP exchange, and the parsed body when it is JSON.

    Messages quote the body's words clipped, each masked of ``key`` (the key the request
    sent) *before* it is clipped: a clip of a key is still most of a key, and decoding
    JSON can make a key out of a spelling no mask of the raw body took for one."""
    outcome, parsed = _classify(status, headers, body, key)
    if status == 200 and outcome.error_class in _UNKEPT_ANSWERS:  # the provider answered, so it billed
        outcome = dataclasses.replace(outcome, maybe_billed=True)
    return outcome, parsed


def _classify(  # noqa: PLR0911 - one outcome per kind of answer, in the order they are told apart
    status: int, headers: Mapping[str, str], body: bytes | str, key: ApiKey | str | None
) -> tuple[Outcome, dict[str, Any] | None]:
    retry_after = parse_retry_after(headers.get("Retry-After") or headers.get("retry-after"))
    if status != 200:
        text = _text(body, headers)
        # an error body's usage is booked too: its dearer reading; too deep to compare, as read
        parsed = _parse_json(text, highest=True) or _parse_json(text)
        message = _error_message(parsed, text, key) or f"HTTP {status}"
        if 300 <= status <= 399:
            message = _redirected(status, headers, key)
        return _by_status(status, message, retry_after), parsed
    try:  # a 200 is kept only if it can be re-emitted losslessly (see .body): the strict read first,
        # which nearly every 200 passes, so its body is parsed once
        parsed = check_body(body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass"))
    except BodyError as exc:  # not kept, but billed: its leniently read usage still counts
        text = _text(body, headers)
        lenient = _parse_json(text, highest=True)
        if lenient is None:
            return Outcome("retry", "bad_json", _not_json(body, headers, text, key), status), None
        return Outcome("retry", "bad_json", _clip(str(exc), key), status), lenient if isinstance(lenient, dict) else None
    if parsed.get("error") is not None:  # an error body, choices beside it or not
        return _error_body(parsed, _text(body, headers), key, retry_after), parsed
    choices = parsed.get("choices")
    if not isinstance(choices, list) or not choices:
        return Outcome("retry", "no_choices", "response has no choices", status), parsed
    try:  # the reader's own rules: a body kept here is one reconstruct reads
        check_response(parsed)
    except RecordError as exc:
        return Outcome("retry", "bad_choices", _clip(str(exc), key), status), parsed
    for choice in choices:
        if isinstance(choice, dict) and (choice.get("finish_reason") == "error" or _aborted(choice)):
            message = _error_message(choice, "", key) or _error_message(parsed, "", key) or (
                f"choice finished with native_finish_reason {native_finish(choice)!r}" if _aborted(choice)
                else "choice finished with error")
            return Outcome("retry", "choice_error", message, status), parsed
        if isinstance(choice, dict) and no_finish(reason := choice.get("finish_reason")):  # the gate rejects it (finish_error)
            said = "without finish_reason" if reason is None else f"with an empty finish_reason ({reason!r})"
            return Outcome("retry", "choice_error", f"a choice came {said}: it did not finish", status,
                           no_finish=True), parsed
    return Outcome("ok", status=status), parsed


#: What an upstream says of a choice it gave up on (``native_finish_reason``) under a
#: ``finish_reason`` that does not: the gate rejects it (``finish_error``), so it is sent
#: again. Not ``content_filter``: a filter refuses the same request again, billed each time.
_ABORTED = NATIVE_FAILED - {"content_filter"}


def _aborted(choice: Mapping[str, Any]) -> bool:
    return choice.get("finish_reason") != "length" and native_finish(choice) in _ABORTED


def _error_body(parsed: dict[str, Any], text: str, key: ApiKey | str | None, retry_after: float | None) -> Outcome:
    """A 200 that says it is an error (OpenRouter's ``{"error": ...}``): sorted by its code.
    Choices beside the error are what the upstream sent before it failed (an answer cut
    mid-word under ``finish_reason: stop``), so the body is still the error it says it is,
    only one the provider may have billed."""
    code = _error_code(parsed["error"])
    message = _error_message(parsed, text, key) or "error body"
    by_code = _by_status(code, message, retry_after) if code is not None else None
    if by_code is not None and (by_code.kind != "fail" or code in (400, 401, 403)) and by_code.kind != "retry":
        outcome = Outcome(by_code.kind, by_code.error_class, message, 200, by_code.retry_after)
    else:
        outcome = Outcome("retry", "api_error", message, 200, retry_after)
    return dataclasses.replace(outcome, maybe_billed=True) if parsed.get("choices") else outcome


def _text(body: bytes | str, headers: Mapping[str, str]) -> str:
    """The body as text, for messages and the lenient read (a kept answer never needs it):
    decoded by the charset its ``Content-Type`` declares (an error page sent as UTF-16 read
    as UTF-8 put a NUL beside every character, the key's too), else by its byte-order mark
    or the NULs of JSON's first characters (RFC 4627), else as UTF-8."""
    if isinstance(body, str):
        return body
    return body.decode(_charset(headers.get("Content-Type") or headers.get("content-type") or "", body),
                       errors="replace")


#: The charsets an error page is read in; any other declared one is read as UTF-8 (a text
#: codec Python knows is not thereby a charset a server meant, e.g. ``unicode_escape``).
_CHARSETS = frozenset({"utf-8", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be", "ascii",
                       "iso8859-1", "cp1252"})
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _charset(content_type: str, body: bytes) -> str:
    """The codec to read ``body`` with (see :func:`_text`)."""
    message = email.message.Message()
    message["Content-Type"] = content_type
    declared = message.get_param("charset")
    if isinstance(declared, str):
        try:
            name = codecs.lookup(declared.strip()).name
        except (LookupError, ValueError):
            name = ""
        if name in _CHARSETS:
            return "utf-8-sig" if name == "utf-8" else name  # a BOM is no character of the text
    for bom, name in _BOMS:
        if body.startswith(bom):
            return name
    head = body[:4]
    if len(head) == 4 and head.count(0) == 3:
        return "utf-32-be" if head[3] else "utf-32-le"
    if len(head) == 4 and head[0] == head[2] == 0:
        return "utf-16-be"
    if len(head) == 4 and head[1] == head[3] == 0:
        return "utf-16-le"
    return "utf-8"


def _not_json(body: bytes | str, headers: Mapping[str, str], text: str, key: ApiKey | str | None) -> str:
    """Why a 200 is not JSON, quoting its start; a gzip body left compressed is named, not
    quoted (its bytes are no text, and a clip of them is a clip of whatever it compressed,
    the key included)."""
    if isinstance(body, bytes) and body.startswith(b"\x1f\x8b"):
        coding = headers.get("Content-Encoding") or headers.get("content-encoding")
        said = f"says Content-Encoding {_clip(coding, key, 40)!r}, which was not undone" if coding else "says no Content-Encoding"
        return f"response is gzip-compressed but {said} ({len(body)} bytes)"
    return f"response is not JSON: {_clip(text, key)!r}"


def _redirected(status: int, headers: Mapping[str, str], key: ApiKey | str | None) -> str:
    """A redirect, which is not followed: aiohttp would send a 301-303's POST again as a
    body-less GET (and keep that GET's answer as this request's), and a changed host is
    where the key would go next; the base URL is what to fix."""
    where = headers.get("Location") or headers.get("location")
    to = f" to {_clip(where, key, 200)!r}" if where else ""
    return f"HTTP {status}: the API redirected{to}; redirects are not followed: set base_url to where it points"


#: What an HTTP attempt's transport can raise: aiohttp's errors, sockets and timeouts
#: (OSError), a body or stream that does not decode (ValueError). classify_exception sorts
#: these; anything else raised during an attempt is a bug.
TRANSPORT_FAILURES: tuple[type[Exception], ...] = (aiohttp.ClientError, HttpProcessingError, OSError, ValueError)


def classify_too_large(status: int | None, headers: Mapping[str, str], exc: Exception) -> Outcome:
    """A body refused for its size (:class:`~.body.ResponseTooLarge`): an error page is
    sorted by its status; a 200 was generated (and billed) in all likelihood, and fails,
    since a retry would be as large."""
    if status is not None and status != 200:
        by_status, _ = classify_response(status, headers, b"")
        return dataclasses.replace(by_status, message=f"HTTP {status}: {exc}")
    return Outcome("fail", "response_too_large", str(exc), status, maybe_billed=True)


def classify_exception(exc: BaseException) -> Outcome:
    """Timeouts and connection failures are worth retrying; the message is the exception text."""
    name = type(exc).__name__
    if isinstance(exc, aiohttp.InvalidURL):
        return Outcome("fail", "bad_url", f"{name}: {exc}")
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # never connected: nothing was sent
        return Outcome("retry", "timeout", f"{name}: {exc}".rstrip(": "))
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, aiohttp.ServerTimeoutError)):
        return Outcome("retry", "timeout", f"{name}: {exc}".rstrip(": "), maybe_billed=True)
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, DNS, TLS: nothing was sent
        return Outcome("retry", "connection", f"{name}: {exc}")
    if isinstance(exc, aiohttp.ClientResponseError) and _UNDECODABLE in str(exc.message).lower():
        return Outcome("fail", "bad_encoding", undecodable_message(str(exc.message)), maybe_billed=True)
    if isinstance(exc, (aiohttp.ClientError, ConnectionError, OSError)):
        return Outcome("retry", "connection", f"{name}: {exc}", maybe_billed=True)
    if isinstance(exc, (ValueError, UnicodeDecodeError)):
        return Outcome("retry", "bad_stream", f"{name}: {exc}", maybe_billed=True)
    return Outcome("fail", "client_error", f"{name}: {exc}")


#: What aiohttp says when an answer's ``Content-Encoding`` needs a package this install lacks
#: (``br``: Brotli, ``zstd``: backports.zstd), raised as a made-up 400 before the status is seen.
_UNDECODABLE = "can not decode content-encoding"


def undecodable_message(said: str) -> str:
    """Why an answer compressed past this install is failed, not retried: whatever the server
    answered was lost (and probably billed), and a retry would be compressed the same way."""
    return (f"the answer could not be read: {said} (aiohttp). Whatever it held was generated and probably billed; "
            "a retry would come compressed the same way, so the sample fails: install that package (or have "
            "the server honour Accept-Encoding: gzip, deflate) and run again")


def _by_status(status: int, message: str, retry_after: float | None) -> Outcome:
    cls = f"http_{status}"
    if status == 429:
        return Outcome("rate_limited", cls, message, status, retry_after)
    if status in RETRY_STATUSES or 500 <= status <= 599:
        return Outcome("retry", cls, message, status, retry_after)
    if status == 402:
        return Outcome("payment", cls, message, status)
    if status == 404 and "no endpoints found" in message.lower():
        return Outcome("unavailable", "no_endpoints", message, status)
    return Outcome("fail", cls, message, status)


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds (delta-seconds or an HTTP date); None when absent/garbled."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _highest(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose repeated keys keep their dearer reading (:func:`_dearer`): a usage
    that says ``cost`` twice, or comes twice, is booked at the higher cost, never lifting the cap."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        out[key] = _dearer(out[key], value) if key in out else value
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN


def _dearer(before: Any, value: Any) -> Any:
    """Of two readings of one key: the higher number; a number over what is not one (null, a
    string, NaN); ``true`` over anything else (``is_byok``: the upstream charge counts); two
    objects merged so, and an object over what is not one; else the later one."""
    if _is_number(before) or _is_number(value):
        return max(v for v in (before, value) if _is_number(v))
    if before is True or value is True:
        return True
    if isinstance(before, dict) and isinstance(value, dict):
        return {k: _dearer(before[k], value[k]) if k in before and k in value else value.get(k, before.get(k))
                for k in {**before, **value}}
    if isinstance(before, dict) or isinstance(value, dict):
        return before if isinstance(before, dict) else value
    return value


def _parse_json(text: str, *, highest: bool = False) -> Any:
    """The body as JSON, or None. json.loads reads what error pages send (NaN, lone
    surrogates) but recurses in C and raises RecursionError near 1000 levels; orjson reads
    the 1024 levels :func:`~.body.check_body` accepts. Too deep for both: not JSON.
    ``highest``: a repeated key keeps its dearer reading (:func:`_highest`); too deep for
    json.loads, nothing (orjson keeps the last reading)."""
    # OpenRouter pads slow non-streamed responses with whitespace to keep the connection open.
    stripped = text.strip()
    if not stripped:
        return None
    try:
        return json.loads(stripped, object_pairs_hook=_highest) if highest else json.loads(stripped)
    except ValueError:
        return None
    except RecursionError:
        if highest:  # too deep to compare (or orjson's: it keeps the last reading): no known cost
            return None
    try:
        return orjson.loads(stripped)
    except orjson.JSONDecodeError:
        return None


def _error_code(err: Any) -> int | None:
    """``error.code`` when it is a plausible HTTP status (100..599, an int or ASCII digits);
    anything else is no status, so the body is an ``api_error``."""
    if not isinstance(err, dict):
        return None
    code = err.get("code")
    if isinstance(code, str) and code.isascii() and code.isdigit() and len(code) == 3:
        code = int(code)
    return code if is_int(code) and 100 <= code <= 599 else None


def _error_message(parsed: Any, text: str, key: ApiKey | str | None) -> str:
    if isinstance(parsed, dict):
        err = parsed.get("error")
        if isinstance(err, dict):
            msg = _shown(err.get("message") or err.get("code") or "", key)
            raw = (err.get("metadata") or {}).get("raw") if isinstance(err.get("metadata"), dict) else None
            if raw:
                msg = f"{msg} ({_shown(raw, key, 200)})"
            if msg:
                return _clip(msg, key)
        if isinstance(err, str) and err:
            return _clip(err, key)
        if isinstance(parsed.get("message"), str):
            return _clip(parsed["message"], key)
    return _clip(text.strip(), key)


def _shown(value: Any, key: ApiKey | str | None, n: int = _MAX_MESSAGE, *, as_repr: bool = False) -> str:
    """``str(value)`` (or its repr) masked and clipped. A parsed body may nest 1024 levels
    and ``str`` of a list or dict recurses, raising RecursionError near 1000: such a value
    is shown by its type."""
    try:
        return _clip(repr(value) if as_repr else value if isinstance(value, str) else str(value), key, n)
    except RecursionError:
        return f"<{type(value).__name__} nested too deep to show>"


def _clip(text: str, key: ApiKey | str | None, n: int = _MAX_MESSAGE) -> str:
    """An API's words, kept as a message: masked of the key, then clipped, and lone
    surrogates (JSON can spell one) escaped, so the store, the summary and the report can
    write it."""
    text = scrub(text, key)
    return text_of(text if len(text) <= n else text[:n] + "…")
