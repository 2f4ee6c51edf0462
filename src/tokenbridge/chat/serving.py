"""What the serving engine may have done to a request before its template saw it.

Engines differ, and the API text does not say which one served: SGLang 0.5.23 dumps the
tools through its pydantic ``Tool`` model (in the order sent) and turns a last assistant
message into a user message (``_handle_last_assistant_message``, without
``continue_final_message``); vLLM 0.34 dumps the tools through its own model, in its
fields' order (:func:`vllm_tools`), and keeps the last message; other stacks render both
as sent. :func:`serving_variants` lists the request as SGLang renders it where that
differs from as sent; ``usage.prompt_tokens`` or ground-truth prompt ids pick one
(``reconstruct._prompt``), and when none can, the gate says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..jsonl import loads_document
from .parts import without_billing_header
from .template import parsed_call

__all__ = ["serving_variants", "sglang_history", "sglang_last_assistant", "sglang_tools", "vllm_history",
           "vllm_postprocessed", "vllm_reasoning", "vllm_tools", "with_change"]

#: SGLang 0.5.23's ``Function`` fields, in declaration order (what ``model_dump`` writes
#: before it restores the order the client sent): name, then the optional ones.
_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


#: The strings pydantic's lax ``bool`` reads (case-insensitive), as both engines' tool models do.
_TRUE, _FALSE = frozenset({"1", "on", "t", "true", "y", "yes"}), frozenset({"0", "off", "f", "false", "n", "no"})
#: A value a tool model refuses (the engine answered an error: no reading of its own).
_REFUSED: Any = object()


def _lax_bool(value: Any) -> Any:
    """``bool | None`` as pydantic reads it outside strict mode (``1``, ``1.0``, ``"yes"``,
    ``"off"``...), which SGLang's and vLLM's tool models are; :data:`_REFUSED` otherwise."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    return _REFUSED


def _tool_function(tool: Any) -> tuple[Mapping[str, Any], Any, Any, Any] | None:
    """A tool's function, the tool's ``defer_loading`` and the function's ``strict`` and
    ``defer_loading`` as both engines' tool models read them (:func:`_lax_bool`); None where
    either model refuses it for what they both check: no function object, a name that is not
    a string, a description that is not a string or null, a flag not read as a boolean."""
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("description"),
                                                                                             str | None):
        return None
    flags = _lax_bool(tool.get("defer_loading")), _lax_bool(fn.get("strict")), _lax_bool(fn.get("defer_loading"))
    return None if any(f is _REFUSED for f in flags) else (fn, *flags)


def _function_dump(fn: Mapping[str, Any], defer: Any, strict: Any, own: Any) -> dict[str, Any]:
    """``Function.model_dump()`` of a function :func:`_tool_function` took (``own``: its
    ``defer_loading``, else the tool's ``defer``): known fields only, ``description`` /
    ``parameters`` null when absent, ``strict`` / ``defer_loading`` dropped when null, in the
    order sent with the absent ones after."""
    data: dict[str, Any] = {k: fn.get(k) for k in _FUNCTION_FIELDS} | {"strict": strict, "defer_loading": own}
    if data["defer_loading"] is None:
        data["defer_loading"] = defer
    for key in ("strict", "defer_loading"):
        if data[key] is None:
            del data[key]
    order = [k for k in fn if k in data] + [k for k in data if k not in fn]
    return {k: data[k] for k in order}


def sglang_tools(request: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools SGLang 0.5.23 hands the template (``[tool.model_dump() ...]``): each
    ``{"type", "function", "defer_loading"}``, null keys kept; none for ``tool_choice:
    "none"``, only the named one for a named ``tool_choice``. None when its request
    model would refuse a tool (the reading does not exist)."""
    tools = request.get("tools")
    if not isinstance(tools, list) or not tools or request.get("tool_choice") == "none":
        return []
    out = []
    for tool in tools:
        taken = _tool_function(tool)
        if taken is None or not isinstance(tool.get("type", "function"), str):
            return None
        fn, defer, strict, own = taken
        out.append({"type": tool.get("type", "function"), "function": _function_dump(fn, defer, strict, own),
                    "defer_loading": defer})
    choice = request.get("tool_choice")
    if isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        out = [t for t in out if t["function"]["name"] == choice["function"].get("name")]
    return out


def vllm_tools(request: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, bool]:
    """The tools vLLM 0.34 hands any template (``[tool.model_dump() ...]`` of its
    ``ChatCompletionToolsParam``), where that is not the JSON sent, and whether its model
    refuses them (vLLM answered an error: it served no prompt). Each is ``{"type",
    "function"[, "defer_loading"]}``, the function ``{"name", "description", "parameters"[,
    "strict"][, "defer_loading"]}`` in that order, ``description`` / ``parameters`` null when
    absent, the flags read as pydantic reads booleans, other keys dropped."""
    tools = request.get("tools")
    if not isinstance(tools, list) or not tools:
        return None, False
    out = []
    for tool in tools:
        taken = _tool_function(tool)
        # (vLLM's model is stricter on the type and the parameters)
        if taken is None or tool.get("type", "function") != "function" or not isinstance(taken[0].get("parameters"),
                                                                                          Mapping | None):
            return None, True
        fn, defer, strict, own = taken
        dumped: dict[str, Any] = {"name": fn["name"], "description": fn.get("description"),
                                  "parameters": fn.get("parameters")}
        if strict is not None:
            dumped["strict"] = strict
        if own is not None or defer is not None:  # the tool's is handed to a function with none
            dumped["defer_loading"] = own if own is not None else defer
        out.append({"type": "function", "function": dumped, **({} if defer is None else {"defer_loading": defer})})
    # as JSON: a template prints key order and types (True is == 1 to Python, not to tojson)
    return (None if json.dumps(out) == json.dumps(tools) else out), False


def sglang_last_assistant(messages: list[Any]) -> list[Any] | None:
    """The messages with a last assistant message of text (or null) content turned into
    a user message holding that text, as SGLang 0.5.23 does; None when it does nothing."""
    last = messages[-1] if messages else None
    if not isinstance(last, Mapping) or last.get("role") != "assistant":
        return None
    content = last.get("content")
    if not isinstance(content, str | None):
        return None  # list content is left as it is
    return [*messages[:-1], {"role": "user", "content": content or ""}]


def serving_variants(request: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], str]]:
    """(request as a stack renders it, the reading's name) other than as sent: with
    SGLang's tool dump and/or its last-assistant handling where they change anything."""
    if request.get("continue_final_message") is True:
        return  # SGLang then continues the message as a prefix: not reproduced, as sent only
    tools = sglang_tools(request)
    messages = request.get("messages")
    last = sglang_last_assistant(messages) if isinstance(messages, list) else None
    tool_forms: list[tuple[Any, str | None]] = [(request.get("tools"), None)]
    if tools is not None and (tools or request.get("tools")):
        tool_forms.append((tools or None, "tools=sglang"))
    message_forms: list[tuple[Any, str | None]] = [(messages, None)]
    if last is not None:
        message_forms.append((last, "last_assistant=user"))
    for msgs, m_name in message_forms:
        for tls, t_name in tool_forms:
            names = [n for n in (t_name, m_name) if n]
            if names:
                yield {**request, "messages": msgs, "tools": tls}, "+".join(names)


def vllm_reasoning(request: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], str]]:
    """The request as vLLM 0.34 hands a template its assistant history: a message's
    ``reasoning`` (OpenRouter's name for it, and vLLM's own) reaches the template as
    ``reasoning_content`` too (``parse_chat_message_content``), where SGLang's message model
    drops the key; a template that writes the history's reasoning (Qwen3's and GLM's after
    the last user turn) then renders it (``reasoning=vllm``)."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        return
    out = [_vllm_reasoning(m) for m in messages]
    if any(a is not b for a, b in zip(out, messages)):
        yield {**request, "messages": out}, "reasoning=vllm"


def _vllm_reasoning(message: Any) -> Any:
    """An assistant message as vLLM 0.34 hands it a template: its ``reasoning``, where given,
    wins over a ``reasoning_content`` (``_normalize_messages_before`` drops that one) and
    reaches the template under both names; else the message as it is."""
    if not (isinstance(message, Mapping) and message.get("role") == "assistant"
            and isinstance(message.get("reasoning"), str) and message.get("reasoning_content") != message["reasoning"]):
        return message
    return {**message, "reasoning_content": message["reasoning"]}


def sglang_history(request: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], str]]:
    """The request's messages as SGLang 0.5.23 hands them to a template that writes them
    itself (Kimi's built-in renderer), where that changes any: an assistant call's
    JSON-string ``arguments`` parsed into the object they encode (the template then writes
    it as ``tojson`` does, spaced: ``{"city": "Paris"}`` for ``{"city":"Paris"}``, one token
    more; ``tool_args=parsed``), a user message's ``name`` dropped (its message model
    has none, so the header says ``user``; ``user_name=dropped``), and a tool result sent as
    a list of text parts joined with a space (``normalize_tool_content``; the template
    joins them with nothing, the same count for ``20C`` + ``sunny``: ``tool_parts=space``), and
    a last assistant message made a user's (``_handle_last_assistant_message``, without
    ``continue_final_message``: ``last_assistant=user``). One reading, all applied, named by
    what changed."""
    for variant, name in _history(request, drop_user_name=True, joins={"tool": " "}, name="tool_parts=space",
                                  always=True):
        last = None if request.get("continue_final_message") is True else sglang_last_assistant(variant["messages"])
        if last is not None:
            variant, name = {**variant, "messages": last}, with_change(name, "last_assistant=user")
        if name:
            yield variant, name


def vllm_history(request: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], str]]:
    """The request's messages as vLLM 0.34 hands them to Kimi's template, where that
    changes any: ``arguments`` parsed (``_postprocess_messages``; what is not a JSON object
    becomes ``{}``, :func:`_vllm_call`),
    names kept, every content sent as a list of text parts joined with a newline (the
    template's content format detects as ``string``, and a tool result is joined so in
    any case; ``parts=newline``), and a turn's ``reasoning`` handed over as
    ``reasoning_content`` (``reasoning=vllm``, :func:`vllm_reasoning`). Its name says
    ``history=vllm`` too: the arguments alone are parsed by both engines, and a user's
    ``name`` kept is what sets it apart."""
    for variant, name in _history(request, drop_user_name=False, joins=None, name="parts=newline",
                                  always=True, parse=_vllm_call, billing=True):
        messages = [_vllm_reasoning(m) for m in variant["messages"]]
        if any(a is not b for a, b in zip(messages, variant["messages"])):
            variant, name = {**variant, "messages": messages}, with_change(name, "reasoning=vllm")
        if name:
            yield variant, f"history=vllm+{name}"


def vllm_postprocessed(request: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``request`` with its history's tool calls as vLLM 0.34 hands them to any template
    (``_postprocess_messages``): an empty ``tool_calls`` dropped, and arguments parsed
    (:func:`_vllm_call`: an object for a JSON string of one, ``{}`` for anything else); None
    where nothing changes. A template that adds arguments to text (DeepSeek V3.1's) then
    fails, and vLLM answers an error; one that takes objects may print ``{}`` where the
    string was ``"[]"``."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        return None
    out, changed = [], False
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, Mapping) and m.get("role") == "assistant" else None
        if isinstance(calls, list) and not calls:
            m, changed = {k: v for k, v in m.items() if k != "tool_calls"}, True
        elif isinstance(calls, list):
            parsed = [_vllm_call(c) for c in calls]
            if any(p is not c for p, c in zip(parsed, calls)):
                m, changed = {**m, "tool_calls": parsed}, True
        out.append(m)
    return {**request, "messages": out} if changed else None


def with_change(name: str, change: str) -> str:
    """A reading's name (changes joined by ``+``, sorted; ``""``: none yet) with ``change`` too."""
    return "+".join(sorted(filter(None, (*name.split("+"), change))))


def _vllm_call(call: Any) -> Any:
    """A history tool call as vLLM 0.34 hands it a template (``_postprocess_messages``):
    ``arguments`` that are an object stay, a JSON string of an object becomes it, and
    anything else (no arguments, ``""``, invalid JSON, ``"[]"``, ``"42"``) becomes ``{}``
    (SGLang refuses those; :func:`~.template.parsed_call` keeps them as sent)."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping):
        return call
    args = fn.get("arguments")
    if isinstance(args, dict):
        return call
    parsed: Any = None
    if isinstance(args, str) and args:
        try:
            parsed = loads_document(args)
        except ValueError:  # invalid JSON (or nested too deeply to read): vLLM coerces it
            parsed = None
    return {**call, "function": {**fn, "arguments": parsed if isinstance(parsed, dict) else {}}}


def _history(request: Mapping[str, Any], *, drop_user_name: bool, joins: Mapping[str, str] | None,
             name: str, always: bool = False, parse: Callable[[Any], Any] = parsed_call,
             billing: bool = False) -> Iterator[tuple[Mapping[str, Any], str]]:
    """The messages with the changes one engine makes before a template that writes them
    itself; ``joins``: role -> the text a list of text parts is joined with (None: every
    role, with a newline); ``parse``: a history tool call as the engine hands it over;
    ``billing``: a system message's Claude Code attribution line dropped (vLLM,
    ``billing_header=dropped``). Yielded where anything changed, or ``always`` (named
    ``""`` then), for the caller to change more."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        return
    out, changes = [], []
    for m in messages:
        if billing and (stripped := without_billing_header(m)) is not None:
            m = stripped
            if "billing_header=dropped" not in changes:
                changes.append("billing_header=dropped")
        if drop_user_name and isinstance(m, Mapping) and m.get("role") == "user" and m.get("name") is not None:
            m = {k: v for k, v in m.items() if k != "name"}
            if "user_name=dropped" not in changes:
                changes.append("user_name=dropped")
        calls = m.get("tool_calls") if isinstance(m, Mapping) and m.get("role") == "assistant" else None
        if isinstance(calls, list):
            parsed = [parse(c) for c in calls]
            if any(p is not c for p, c in zip(parsed, calls)):
                m = {**m, "tool_calls": parsed}
                if "tool_args=parsed" not in changes:
                    changes.append("tool_args=parsed")
        joined = _joined_parts(m, joins)
        if joined is not None:
            m = {**m, "content": joined}
            if name not in changes:
                changes.append(name)
        out.append(m)
    if changes or always:
        yield {**request, "messages": out}, "+".join(sorted(changes))


def _joined_parts(message: Any, joins: Mapping[str, str] | None) -> str | None:
    """``message``'s content of two or more parts, all text, joined as the engine joins
    them (``joins``: by role; None: a newline for every role); None where it keeps the list."""
    if not isinstance(message, Mapping):
        return None
    content = message.get("content")
    sep = "\n" if joins is None else joins.get(str(message.get("role")))
    if sep is None or not isinstance(content, list) or len(content) < 2:
        return None
    if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return None
    return sep.join(p["text"] for p in content)
