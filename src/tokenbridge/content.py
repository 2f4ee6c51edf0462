"""A chat message's ``content`` as APIs send it: a string, a list of typed parts, or null.

:func:`content_text` is the one reading of it as text, for the completion we rebuild,
the readings the evidence weighs, the Qwen3 prompt and the conversations export.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["ROLES", "content_fault", "content_text", "is_text_parts", "reasoning_fault", "request_parts", "role_fault",
           "tools_fault"]

#: The roles a message may have: what prompt loading sends (:mod:`tokenbridge.generate.prompts`)
#: and what the row check lets into an export (:func:`tokenbridge.rows.check_row`).
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def content_text(content: object) -> str:
    """The text of ``content``: a string as it is, a list of parts as the text of the parts
    that carry one (``{"type": "text", "text": ...}``; an image part adds nothing), joined
    with nothing between them; null (or anything else) as ``""``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


def request_parts(request: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every content part (a mapping in a list ``content``) of a request's messages, in
    order; a message or part of another shape is passed over."""
    messages = request.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, Mapping) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, Mapping):
                yield part


def is_text_parts(content: object) -> bool:
    """A list of parts that are all ``type: text`` (so the list says nothing its text does not)."""
    return isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content)


def role_fault(role: object) -> str | None:
    """Why ``role`` is not a message role the project sends or exports, or None."""
    if isinstance(role, str) and role in ROLES:
        return None
    return f"unknown role {role!r} (expected one of {sorted(ROLES)})"[:200]


def content_fault(content: object) -> tuple[str, str] | None:
    """Why ``content`` is not a message content the project reads, as (the sub-field after
    ``content``, why), or None: a string, null, or a list of part objects each with a
    string ``type``, a ``text`` part's ``text`` present and a string (:func:`content_text` reads those,
    and the conversations export writes what it reads)."""
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, list):
        return "", f"must be a string, null or a list of content parts, got {type(content).__name__}"
    for k, part in enumerate(content):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            return f"[{k}]", "must be a content part object with a string 'type'"
        if part["type"] == "text" and "text" not in part:  # OpenAI's text part holds its text: a prompt with none is lost
            return f"[{k}].text", "missing (a text part holds its text)"
        if "text" in part and not isinstance(part["text"], str):
            return f"[{k}].text", f"must be a string, got {type(part['text']).__name__}"
    return None


def reasoning_fault(message: Mapping[str, object]) -> tuple[str, str] | None:
    """Why a history message's reasoning is not what the conversations export writes as the
    turn's reasoning, as (the field, why), or None: ``reasoning_content`` and ``reasoning``
    each a string or null."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            return key, f"must be a string or null, got {type(value).__name__}"
    return None


def tool_calls_fault(message: Mapping[str, object]) -> tuple[str, str] | None:
    """Why a history message's ``tool_calls`` is not what every renderer and the
    conversations export read (null, or a list of calls each with a ``function`` object
    holding ``arguments``), as (the field, why), or None."""
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list):
        return "tool_calls", f"must be a list or null, got {type(calls).__name__}"
    for j, call in enumerate(calls):
        if not isinstance(call, Mapping):
            return f"tool_calls[{j}]", f"must be a tool call object, got {type(call).__name__}"
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            return f"tool_calls[{j}].function", "missing or not an object"
        if "arguments" not in fn:
            return f"tool_calls[{j}].function.arguments", "missing"
    return None


def tools_fault(tools: object) -> tuple[str, str] | None:
    """Why a list of tool declarations holds one that is not an object, as (the sub-field
    after ``tools``, why), or None."""
    for k, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, Mapping):
            return f"[{k}]", f"must be a tool object, got {type(tool).__name__}"
    return None
