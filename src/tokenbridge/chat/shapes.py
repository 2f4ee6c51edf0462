"""The request shapes the built-in renderers read, checked before they read them.

A request whose fields have the wrong type or lack a key the format needs cannot be
rendered (SGLang's request model refuses it with a 400); each check here raises
:class:`~.template.TemplateError` naming the field (``tools[0].function.name``), so
``reconstruct`` refuses that one record by name instead of stopping the whole file on a
``KeyError`` from deep inside a renderer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..jsonl import loads_document
from .dialect import Message, RenderFn
from .template import TemplateError

__all__ = ["call_arguments", "call_function", "checked", "checked_messages", "checked_tools", "each_call",
           "template_kwargs", "tool_function"]


def checked(render: RenderFn) -> RenderFn:
    """``render`` behind the checks every built-in renderer relies on (messages and tools
    in shape), whoever calls it."""

    def checked_render(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None, thinking: bool,
                       kwargs: Mapping[str, Any]) -> str:
        return render(checked_messages(messages), checked_tools(tools), thinking, kwargs)

    return checked_render


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def checked_messages(messages: Any) -> list[Message]:
    """``messages``: a non-empty list of objects with a string ``role``, ``content`` a
    string, a list or null, and ``tool_calls`` a list or null."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError(f"messages: must be a non-empty list, got {_kind(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TemplateError(f"messages[{i}]: must be an object, got {_kind(m)}")
        if not isinstance(m.get("role"), str):
            raise TemplateError(f"messages[{i}].role: must be a string, got {_kind(m.get('role'))}")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise TemplateError(f"messages[{i}].content: must be a string, a list of parts or null, got {_kind(content)}")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) and not isinstance(part, str):
                    raise TemplateError(f"messages[{i}].content[{j}]: must be an object, got {_kind(part)}")
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise TemplateError(f"messages[{i}].tool_calls: must be a list or null, got {_kind(calls)}")
    return messages


def checked_tools(tools: Any) -> list[Mapping[str, Any]] | None:
    """``tools``: null or a list of objects."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TemplateError(f"tools: must be a list or null, got {_kind(tools)}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TemplateError(f"tools[{i}]: must be an object, got {_kind(tool)}")
    return tools


def template_kwargs(request: Mapping[str, Any]) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` (an object or null)."""
    kwargs = request.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TemplateError(f"chat_template_kwargs: must be an object or null, got {_kind(kwargs)}")
    return dict(kwargs)


def tool_function(tool: Mapping[str, Any], at: str) -> Mapping[str, Any]:
    """A declared tool's ``function``: an object with a string ``name`` and
    ``parameters`` an object or null."""
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise TemplateError(f"{at}.function: missing or not an object ({_kind(fn)})")
    if not isinstance(fn.get("name"), str):
        raise TemplateError(f"{at}.function.name: missing or not a string ({_kind(fn.get('name'))})")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, Mapping):
        raise TemplateError(f"{at}.function.parameters: must be an object or null, got {_kind(params)}")
    return fn


def call_function(call: Any, at: str, need_name: bool = True) -> Mapping[str, Any]:
    """A history tool call's ``function``: an object with ``arguments`` (a string or an
    object) and, where the format prints it, a string ``name``."""
    if not isinstance(call, Mapping):
        raise TemplateError(f"{at}: must be an object, got {_kind(call)}")
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        raise TemplateError(f"{at}.function: missing or not an object ({_kind(fn)})")
    if need_name and not isinstance(fn.get("name"), str):
        raise TemplateError(f"{at}.function.name: missing or not a string ({_kind(fn.get('name'))})")
    if not isinstance(fn.get("arguments"), str | Mapping):
        raise TemplateError(f"{at}.function.arguments: must be a JSON string or an object, got {_kind(fn.get('arguments'))}")
    return fn


def call_arguments(fn: Mapping[str, Any], at: str) -> dict[str, Any]:
    """A history tool call's ``arguments`` as an object: a JSON string is parsed (SGLang
    refuses one that is not a JSON object)."""
    args = fn["arguments"]
    if isinstance(args, str):
        try:
            args = loads_document(args)
        except ValueError as exc:  # JsonLineError: nested too deeply to read too
            raise TemplateError(f"{at}.function.arguments: not JSON ({exc})") from None
    if not isinstance(args, Mapping):
        raise TemplateError(f"{at}.function.arguments: must be a JSON object, got {_kind(args)}")
    return dict(args)


def each_call(messages: Sequence[Mapping[str, Any]], need_name: bool = True) -> None:
    """Every history tool call in shape (:func:`call_function`)."""
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or ()):
            call_function(call, f"messages[{i}].tool_calls[{j}]", need_name)
