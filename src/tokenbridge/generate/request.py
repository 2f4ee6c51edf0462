"""Build the JSON body for one sample.

The stored request is the *canonical* body: everything that shapes the answer (model,
messages, sampling, reasoning, provider routing, ``usage: {include: true}``, extra_body).
Transport-only keys (``stream``, ``stream_options``) are added by :func:`wire_body` at
send time, so the same stored request can be resumed streamed or not.
"""

from __future__ import annotations

import copy
import json
from typing import Any
from collections.abc import Mapping

from ..exchanges import RecordError, check_request
from .prompts import Sample
from .settings import ConfigError, RequestSettings

__all__ = ["build_request", "deep_merge", "extra_body_overlaps", "request_problem", "routing_key", "wire_body"]

#: A stand-in prompt: the request checks look at the settings' fields, not at a row's messages.
_PROBE = Sample(id="config", dataset="config", messages=[{"role": "user", "content": "hi"}])


def build_request(sample: Sample, rs: RequestSettings) -> dict[str, Any]:
    """The canonical request body for ``sample`` (no key, no headers, no stream flags).

    The body shares the sample's message and tool lists (it is serialised right away).
    :class:`~.settings.ConfigError` when ``extra_body`` would replace a value a setting
    sets (:func:`extra_body_overlaps`; a config or flags are refused so at load, this
    guards settings built in Python).
    """
    body = _own_body(sample, rs)
    if not rs.extra_body:
        return body
    overlaps = _overlaps(body, rs.extra_body)
    if overlaps:
        raise ConfigError("; ".join(f"request.extra_body.{_dotted(p)}: also set by request.{_dotted(p)}; set it in "
                                    "one place (extra_body would silently replace it)" for p in overlaps))
    return deep_merge(body, rs.extra_body)


def extra_body_overlaps(rs: RequestSettings) -> list[tuple[str, ...]]:
    """The places (``("reasoning", "enabled")``, ``("provider", "only")``) that ``extra_body``
    sets and a setting sets too: merged last, extra_body replaced the setting's (a flag's)
    value in every body without a word. Tables merge; anything else set in both is an overlap."""
    return _overlaps(_own_body(_PROBE, rs), rs.extra_body) if rs.extra_body else []


def _overlaps(base: Mapping[str, Any], extra: Mapping[str, Any], at: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for key, value in extra.items():
        if key not in base:
            continue
        if isinstance(value, Mapping) and isinstance(base[key], Mapping):
            out += _overlaps(base[key], value, (*at, key))
        else:
            out.append((*at, key))
    return out


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def _own_body(sample: Sample, rs: RequestSettings) -> dict[str, Any]:
    """What the settings put in the body, before ``extra_body`` is merged in."""
    body: dict[str, Any] = {"model": rs.model, "messages": sample.messages}
    if rs.send_tools and sample.tools:
        body["tools"] = sample.tools
    for key in ("max_tokens", "temperature", "top_p", "seed", "n"):
        value = getattr(rs, key)
        if value is not None:
            body[key] = value
    if rs.reasoning is not None:
        body["reasoning"] = dict(rs.reasoning)
    if rs.provider:
        body["provider"] = {k: copy.deepcopy(v) for k, v in rs.provider.items() if v is not None}
    body["usage"] = {"include": True}
    return body


def request_problem(rs: RequestSettings) -> tuple[tuple[str | int, ...], str] | None:
    """Where (a place in the settings, like ``("request", "extra_body", "extra_body")``) and
    why the request these settings send breaks the exchange reader's rules
    (:func:`~tokenbridge.exchanges.check_request`), else None. Checked at load: otherwise
    every paid record would be refused by reconstruct for the settings' own value.
    Settings whose ``extra_body`` overlaps them (:func:`extra_body_overlaps`) are the
    caller's to refuse first."""
    try:
        check_request(deep_merge(_own_body(_PROBE, rs), rs.extra_body))
    except RecordError as exc:
        parts: list[str | int] = list(exc.field.split(".")[1:])  # past "request"
        key = parts[0] if parts else ""
        inner = rs.extra_body.get(key) if isinstance(key, str) else None
        from_extra = key in rs.extra_body and (len(parts) == 1 or not isinstance(inner, Mapping)
                                                or parts[1] in inner)
        return ("request", "extra_body", *parts) if from_extra else ("request", *parts), exc.detail
    return None


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in: nested mappings merge, anything else is replaced."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def wire_body(request_json: str, *, stream: bool) -> bytes:
    """The bytes to POST: the stored request, plus the stream flags when streaming."""
    if not stream:
        return request_json.encode("utf-8")
    body = json.loads(request_json)
    body["stream"] = True
    # OpenRouter sends usage in the last chunk anyway; OpenAI-compatible servers need this.
    body.setdefault("stream_options", {"include_usage": True})
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def routing_key(request: Mapping[str, Any]) -> str:
    """What decides which endpoints can serve a request, for remembering a 404 "No endpoints
    found": every body field by value (model, provider, max_tokens, reasoning, tool_choice,
    response_format, ...: the same for every sample of a run) except the per-row ones,
    ``messages`` (left out) and ``tools`` (by presence only: "support tool use")."""
    fields = {k: v for k, v in request.items() if k not in ("messages", "tools")}
    fields["tools"] = bool(request.get("tools"))
    return json.dumps(fields, sort_keys=True, ensure_ascii=False, default=str)
