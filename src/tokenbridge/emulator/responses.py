"""Response bodies in OpenRouter's shape: one ``chat.completion`` or a list of SSE events.

Both are built from the same :class:`ChoiceView` list, so a streamed response carries
exactly what the non-streamed one does: reasoning, content, tool calls, finish reasons,
usage, provider and (with ``return_token_ids``) the prompt and completion ids, the latter
spread over the chunks so that their concatenation is the choice's ``token_ids``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator

from .choices import ChoiceView

__all__ = ["Envelope", "completion_body", "error_body", "sse_events", "usage_body", "dumps"]

PROCESSING = ": OPENROUTER PROCESSING"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class Envelope:
    """The fields every body and chunk shares."""

    id: str
    created: int
    model: str
    provider: str


def error_body(code: int, message: str, **metadata: Any) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    if metadata:
        err["metadata"] = metadata
    return {"error": err}


def usage_body(prompt_tokens: int, choices: list[ChoiceView], prompt_price: float, completion_price: float,
               ) -> dict[str, Any]:
    completion = sum(len(c.native_ids) for c in choices)
    cost = (prompt_tokens * prompt_price + completion * completion_price) / 1e6
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "cost": round(cost, 12),
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens for c in choices)},
    }


def _details(text: str) -> list[dict[str, Any]]:
    """OpenRouter's ``reasoning_details`` form of plain reasoning text."""
    return [{"type": "reasoning.text", "text": text, "index": 0, "format": "unknown"}]


def _message(c: ChoiceView) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": None if c.null_content and not c.content else c.content}
    if c.has_reasoning_key:
        msg[c.reasoning_key] = c.reasoning
    if c.details != "none" and c.reasoning:
        msg["reasoning_details"] = _details(c.reasoning)
    if c.tool_calls:
        msg["tool_calls"] = [dict(t) for t in c.tool_calls]
    return msg


def _choice_extras(c: ChoiceView, finishing: bool) -> dict[str, Any]:
    """Engine-specific choice fields: SGLang's ``matched_stop`` (on the finishing chunk)."""
    if c.engine == "sglang" and finishing:
        return {"matched_stop": c.matched_stop}
    return {}


def completion_body(
    env: Envelope,
    choices: list[ChoiceView],
    usage: dict[str, Any],
    prompt_ids: list[int] | None,
) -> dict[str, Any]:
    """The non-streamed body; ``prompt_ids`` given means ``return_token_ids`` was asked."""
    out: list[dict[str, Any]] = []
    for c in choices:
        item: dict[str, Any] = {
            "index": c.index,
            "message": _message(c),
            "finish_reason": c.finish_reason,
            "native_finish_reason": c.finish_reason,
            "logprobs": {"content": list(c.logprobs)} if c.logprobs is not None else None,
            **_choice_extras(c, True),
        }
        if c.error is not None:
            item["error"] = c.error
        if prompt_ids is not None:
            item["token_ids"] = list(c.native_ids)
        out.append(item)
    body: dict[str, Any] = {
        "id": env.id,
        "provider": env.provider,
        "model": env.model,
        "object": "chat.completion",
        "created": env.created,
        "choices": out,
        "usage": usage,
    }
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    return body


# --- streaming -------------------------------------------------------------------------


#: Marker text (``<|...|>``, ``<think>``, ``</think>``) is never cut across chunks, as a
#: token-by-token stream would never cut it.
_MARKER = re.compile(r"<\|[^|<>\s]{1,64}\|>|</?think>")


def _pieces(text: str, size: int) -> list[str]:
    if "<" not in text:
        return [text[i : i + size] for i in range(0, len(text), size)]
    out: list[str] = []
    pos = 0
    for m in _MARKER.finditer(text):
        out += [text[i : min(i + size, m.start())] for i in range(pos, m.start(), size)]
        out.append(m.group(0))
        pos = m.end()
    out += [text[i : i + size] for i in range(pos, len(text), size)]
    return out


def _deltas(c: ChoiceView, size: int) -> list[dict[str, Any]]:
    """The deltas of one choice, before the finishing one."""
    out: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if c.reasoning:
        for p in _pieces(c.reasoning, size):
            delta: dict[str, Any] = {"role": "assistant", "content": ""}
            if c.has_reasoning_key:
                delta[c.reasoning_key] = p
            if c.details != "none":
                delta["reasoning_details"] = _details(p)
            out.append(delta)
    out += [{"role": "assistant", "content": p} for p in _pieces(c.content, size)]
    for t in c.tool_calls:
        fn = t["function"]
        out.append({"role": "assistant", "content": "", "tool_calls": [
            {"index": t["index"], "id": t["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}
        ]})
        out += [{"role": "assistant", "content": "", "tool_calls": [{"index": t["index"], "function": {"arguments": p}}]}
                for p in _pieces(fn["arguments"], size)]
    return out


def sse_events(
    env: Envelope,
    choices: list[ChoiceView],
    usage: dict[str, Any],
    prompt_ids: list[int] | None,
    *,
    chunk_chars: int,
) -> Iterator[tuple[str, Any, int]]:
    """``(kind, payload, n_ids)`` events: kind ``comment`` (text) or ``data`` (a chunk dict).

    ``n_ids`` is how many completion ids the chunk carries (for pacing). The last data
    chunk holds the last choice's ``finish_reason`` and the usage; ``[DONE]`` is the
    caller's to send.
    """
    yield "comment", PROCESSING, 0
    with_ids = prompt_ids is not None
    first = True
    for ci, c in enumerate(choices):
        deltas = _deltas(c, chunk_chars)
        ids = list(c.native_ids)
        per = -(-len(ids) // (len(deltas) + 1)) if ids else 0  # spread ids over all chunks
        for di, delta in enumerate(deltas + [None]):
            part = ids[di * per : (di + 1) * per] if di < len(deltas) else ids[di * per :]
            finishing = delta is None
            choice: dict[str, Any] = {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""} if finishing else delta,
                "finish_reason": c.finish_reason if finishing else None,
                "native_finish_reason": c.finish_reason if finishing else None,
                "logprobs": None,
                **_choice_extras(c, finishing),
            }
            if c.logprobs is not None:
                lo = di * per
                hi = (di + 1) * per if di < len(deltas) else len(ids)
                choice["logprobs"] = {"content": list(c.logprobs[lo:hi])}
            if finishing and c.error is not None:
                choice["error"] = c.error
            if with_ids:
                choice["token_ids"] = part
            chunk: dict[str, Any] = {
                "id": env.id,
                "provider": env.provider,
                "model": env.model,
                "object": "chat.completion.chunk",
                "created": env.created,
                "choices": [choice],
            }
            if first and with_ids:
                chunk["prompt_token_ids"] = prompt_ids
            if finishing and ci == len(choices) - 1:
                chunk["usage"] = usage
            first = False
            yield "data", chunk, len(part)
            if di % 25 == 7:
                yield "comment", PROCESSING, 0
