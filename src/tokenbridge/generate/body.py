"""The network boundary: what a response body and its ``usage`` must be to be kept.

A body is kept only if it can be stored and re-emitted, byte for byte, as one line of
``exchanges.jsonl`` that every reader downstream parses (they use orjson). Accepted:
  * after stripping the ASCII whitespace around it (OpenRouter pads slow responses), it
    is valid UTF-8 and one JSON *object* by RFC 8259 as orjson reads it: no BOM, no
    ``NaN``/``Infinity``, no number that overflows a double (``1e400``), no lone
    surrogate escape (``"\\ud800"``), nesting at most 1024 deep;
  * line breaks anywhere: a CR or LF in valid JSON can only be whitespace between tokens
    (inside strings they must be escaped), so :func:`one_line` turns them into spaces
    and the line is the received bytes otherwise;
  * no object gives a key twice (readers differ on which value counts).
Anything else is a ``bad_json`` attempt error (retried; after ``max_attempts`` the
sample fails with the reason), never a stored response. It was paid for all the same:
its attempt row keeps the bytes, and its ``usage``, as far as it can be read, is booked.

``usage`` is the provider's account, not the answer: a bad field never costs the
response. Per field (:func:`checked_usage`):
  * ``prompt_tokens`` / ``completion_tokens``: an integer 0..10^9 (an integral float
    like ``12.0`` counts); anything else (string, bool, negative, fraction, absurd)
    is dropped from the stored accounting usage and the response counts as one
    without usage (its reservation is booked as possible spend, as for a stream
    cut before its usage chunk);
  * ``cost``: a finite number 0..:data:`MAX_PLAUSIBLE_COST` USD; anything else is
    dropped, so the cost comes from ``[prices]`` (or the no-prices reservation path);
  * ``is_byok``: ``true`` makes the spend ``cost`` (OpenRouter's fee, often 0) plus
    ``cost_details.upstream_inference_cost`` (what the user's own provider key was
    charged), which must then be a plausible cost too; a non-boolean ``is_byok``, or a
    BYOK answer whose upstream charge is missing or unusable, has no known spend: its
    ``cost`` is dropped with the bad field (the fee alone would let ``--max-cost`` pass);
  * any other field nested more than :data:`MAX_USAGE_DEPTH` deep is dropped from the
    stored usage (which is written with ``json.dumps``, and that recurses);
  * ``usage`` that is not an object is absent.
Every dropped field is reported (``RunSummary.bad_usage``: count and first examples).
The body itself is stored as received: reconstruct reads usage from it and flags it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from ..jsonl import JsonLineError, repeated_key
from .secrets import ApiKey, scrub

if TYPE_CHECKING:
    import aiohttp

__all__ = ["BodyError", "MAX_PLAUSIBLE_COST", "MAX_PLAUSIBLE_TOKENS", "CheckedUsage", "ResponseTooLarge", "checked_usage",
           "check_body", "one_line", "read_capped"]

MAX_PLAUSIBLE_TOKENS = 10**9
MAX_PLAUSIBLE_COST = 1000.0  # USD for one response; more is a provider bug, not a price
MAX_USAGE_DEPTH = 64  # json.dumps recurses: a usage field deeper than this is dropped from the stored usage
_WS = b" \t\r\n"
_ACCOUNTING = ("prompt_tokens", "completion_tokens", "cost")


class BodyError(ValueError):
    """The body cannot be kept (see the module docstring); the message says why."""


class ResponseTooLarge(Exception):
    """A body or stream passed ``max_response_bytes`` while being read."""


async def read_capped(resp: aiohttp.ClientResponse, cap: int, into: bytearray | None = None) -> bytes:
    """The whole body, refused as soon as it passes ``cap`` bytes (never buffered past it).
    The count is of the bytes as read, after any ``Content-Encoding`` is undone, so a small
    gzip body that inflates to gigabytes stops at the cap too. ``into``: the caller's buffer,
    which keeps what came when the read fails (a reset or a deadline after the whole answer
    arrived: a paid answer is then still there to keep)."""
    if resp.content_length is not None and resp.content_length > cap:
        raise ResponseTooLarge(f"response of {resp.content_length} bytes is over max_response_bytes={cap}")
    buf = bytearray() if into is None else into
    async for chunk in resp.content.iter_any():
        buf += chunk
        if len(buf) > cap:
            raise ResponseTooLarge(f"response passed max_response_bytes={cap} while being read")
    return bytes(buf)


def check_body(body: bytes, *, keys_once: bool = True) -> dict[str, Any]:
    """The parsed body if it can be kept and re-emitted losslessly, else :class:`BodyError`.
    ``keys_once=False`` lets an object give a key twice (a body stored before that was
    checked is written out as it is; reconstruct names the key)."""
    stripped = body.strip(_WS)
    if not stripped:
        raise BodyError("empty body")
    try:
        stripped.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"body is not valid UTF-8 (byte 0x{stripped[exc.start]:02x} at offset {exc.start})") from None
    try:
        parsed = orjson.loads(stripped)
    except orjson.JSONDecodeError as exc:
        raise BodyError(f"body is not JSON that can be re-read ({exc})") from None
    if not isinstance(parsed, dict):
        raise BodyError(f"body is a JSON {type(parsed).__name__}, not an object")
    try:
        if keys_once:
            repeated_key(parsed, stripped)
    except JsonLineError as exc:
        raise BodyError(f"body{' at ' + exc.field if exc.field else ''}: {exc.detail}") from None
    return parsed


def one_line(body: bytes) -> bytes:
    """A kept body as one JSONL line's value: the received bytes, line breaks as spaces."""
    stripped = body.strip(_WS)
    if b"\n" in stripped or b"\r" in stripped:
        stripped = stripped.replace(b"\r", b" ").replace(b"\n", b" ")
    return stripped


@dataclass
class CheckedUsage:
    """The usage fields accounting may rely on; ``problems`` names what was dropped."""

    usage: dict[str, Any] | None  # the usage object less its bad accounting fields
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def tokens_ok(self) -> bool:
        return self.prompt_tokens is not None and self.completion_tokens is not None


def checked_usage(parsed: Any, *, key: ApiKey | str | None = None) -> CheckedUsage:
    """Validate ``parsed["usage"]`` field by field (see the module docstring); a problem
    quotes the value masked of ``key`` (the key the request sent) before clipping it."""
    if not isinstance(parsed, dict) or "usage" not in parsed or parsed["usage"] is None:
        return CheckedUsage(None)
    usage = parsed["usage"]
    if not isinstance(usage, dict):
        return CheckedUsage(None, problems=[f"usage is a {type(usage).__name__}, not an object"])
    kept: dict[str, Any] = dict(usage)  # out.usage: what passes the checks below
    out = CheckedUsage(kept)
    for name in _ACCOUNTING[:2]:
        if name not in usage:
            continue
        n = _token_count(usage[name])
        if n is None:
            out.problems.append(f"usage.{name} = {_show(usage[name], key)}")
            del kept[name]
        else:
            kept[name] = n
            setattr(out, name, n)
    for name in [k for k, v in usage.items() if k not in _ACCOUNTING and _too_deep(v)]:  # json.dumps recurses
        out.problems.append(f"usage.{name} is nested more than {MAX_USAGE_DEPTH} deep")
        del kept[name]
    if "cost" in usage and usage["cost"] is not None:
        out.cost = _usd(usage["cost"])
        if out.cost is None:
            out.problems.append(f"usage.cost = {_show(usage['cost'], key)}")
            del kept["cost"]
    if usage.get("is_byok") is not None and usage["is_byok"] is not False:
        _add_byok(out, usage["is_byok"], key)
    return out


def _usd(v: Any) -> float | None:
    """A plausible USD figure (a finite number 0..:data:`MAX_PLAUSIBLE_COST`), else None. An
    integer is compared as it is: ``math.isfinite(10**400)`` raises OverflowError, which lost
    the paid answer, on every rerun."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or isinstance(v, float) and not math.isfinite(v):
        return None
    return float(v) if 0 <= v <= MAX_PLAUSIBLE_COST else None


def _add_byok(out: CheckedUsage, byok: Any, key: ApiKey | str | None) -> None:
    """Make ``out.cost`` a BYOK response's whole spend: OpenRouter's ``cost`` is then only its
    fee (often $0), and ``cost_details.upstream_inference_cost`` is what the user's own provider
    account was charged. A BYOK answer whose upstream charge cannot be read has no known cost:
    its ``cost`` is dropped too (booking the fee alone would let ``--max-cost`` pass unnoticed)."""
    kept = out.usage
    assert kept is not None
    details = kept.get("cost_details")
    upstream = details.get("upstream_inference_cost") if isinstance(details, dict) else None
    if byok is not True:
        out.problems.append(f"usage.is_byok = {_show(byok, key)}")
        kept.pop("is_byok", None)
    elif upstream is None:
        out.problems.append("usage.is_byok is true without usage.cost_details.upstream_inference_cost")
    elif _usd(upstream) is None:
        out.problems.append(f"usage.cost_details.upstream_inference_cost = {_show(upstream, key)}")
        assert isinstance(details, dict)
        kept["cost_details"] = {k: v for k, v in details.items() if k != "upstream_inference_cost"}
    elif out.cost is not None and out.cost + upstream <= MAX_PLAUSIBLE_COST:
        out.cost += upstream
        return
    elif out.cost is not None:
        out.problems.append(f"usage.cost + usage.cost_details.upstream_inference_cost = {out.cost + upstream:g}")
    if out.cost is not None:
        out.cost = None
        del kept["cost"]


def _too_deep(v: Any) -> bool:
    """Nested more than :data:`MAX_USAGE_DEPTH` lists/objects deep (checked without recursing)."""
    level: list[Any] = [v]
    for _ in range(MAX_USAGE_DEPTH + 1):
        level = [c for x in level for c in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())]
        if not level:
            return False
    return True


def _token_count(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        return None
    n = int(v)
    return n if 0 <= n <= MAX_PLAUSIBLE_TOKENS else None


def _show(v: Any, key: ApiKey | str | None) -> str:
    """A short rendering for a report. orjson writes 255 levels at most and ``repr``
    raises RecursionError near 1000, while a kept body may nest 1024 deep."""
    try:
        text = orjson.dumps(v, option=orjson.OPT_NON_STR_KEYS).decode() if _dumpable(v) else repr(v)
    except RecursionError:
        text = f"<{type(v).__name__} nested too deep to show>"
    text = scrub(text, key)
    return text if len(text) <= 40 else text[:37] + "..."


def _dumpable(v: Any) -> bool:
    try:
        orjson.dumps(v, option=orjson.OPT_NON_STR_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return False
    return True
