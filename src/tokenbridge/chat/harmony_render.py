"""gpt-oss prompts as the ``openai_harmony`` stack renders them (vLLM, ``renderers``).

Written from the harmony format, not from the folder's template; the tests hold it
against ``renderers==0.1.12`` (``openai_harmony==0.0.4`` underneath). Against the HF
template (SGLang) it differs in three places: developer instructions with no tool
declaration after them end without ``\\n\\n``; a tool call's header has no `` json``
content type; a tool result is its text, not its ``tojson``. :func:`render` converts chat
messages as ``renderers`` does (which states vLLM parity); :func:`render_vllm` as vLLM 0.34
itself does (held against its own code), which differs where a system message is not first,
in a history's tool calls and in empty assistant turns:

* the system preamble as the template's (identity, knowledge cutoff, the serving day,
  ``Reasoning: low|medium|high``, the channel line, the ``functions`` routing line when
  tools are declared);
* the first system message (wherever it is) becomes the developer message's
  ``# Instructions``, followed by ``# Tools`` when tools are declared; a later system or
  developer message is a developer message of its own;
* an assistant turn is its analysis (only for a tool-call turn that no later final
  answer follows), its final text, then one ``<|start|>assistant to=functions.NAME
  <|channel|>commentary<|message|>ARGS<|call|>`` per call; an empty turn is an empty
  final message; a tool result is ``<|start|>functions.NAME to=assistant<|channel|>
  commentary<|message|>TEXT<|end|>``;
* the generation prompt is ``<|start|>assistant`` (``renderers`` prefills the analysis
  header after it, which vLLM does not).

Tool parameter types are rendered for strings (and their enums), numbers, integers,
booleans and arrays of those; any other schema is flagged ``tools_declared``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, UTC
from typing import Any

from .dialect import Message
from .shapes import checked, each_call, tool_function
from .template import TemplateError

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")
_PRIMITIVE = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean"}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return str(content)


def _system(day: str, effort: str, tools: bool) -> str:
    route = "\nCalls to these tools must go to the commentary channel: 'functions'." if tools else ""
    return (f"<|start|>system<|message|>{IDENTITY}\nKnowledge cutoff: {CUTOFF}\nCurrent date: {day}\n\n"
            f"Reasoning: {effort}\n\n# Valid channels: analysis, commentary, final. Channel must be included for "
            f"every message.{route}<|end|>")


def _type(spec: Mapping[str, Any]) -> str | None:
    """A parameter's TypeScript type, or None outside the reproduced subset."""
    kind = spec.get("type")
    if kind == "string" and isinstance(spec.get("enum"), list) and spec["enum"]:
        if not all(isinstance(v, str) for v in spec["enum"]):
            return None
        return " | ".join(f'"{v}"' for v in spec["enum"])
    if isinstance(kind, str) and kind in _PRIMITIVE and "enum" not in spec:
        return _PRIMITIVE[kind]
    items = spec.get("items")
    if kind == "array" and isinstance(items, Mapping):
        inner = _type(items)
        return f"{inner}[]" if inner in _PRIMITIVE.values() else None
    return None


def unproven_tools(tools: Sequence[Any]) -> str | None:
    """Why these tool declarations are outside what :func:`render` reproduces, or None."""
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            return "a tool without function.name"
        if not isinstance(fn.get("description", ""), str):
            return f"{fn['name']}: a non-string description"
        params = fn.get("parameters")
        if params is None or params == {}:
            continue
        props = params.get("properties") if isinstance(params, Mapping) else None
        if not isinstance(props, Mapping):
            return f"{fn['name']}: parameters without properties"
        for name, spec in props.items():
            if not isinstance(spec, Mapping) or _type(spec) is None:
                return f"{fn['name']}.{name}: a parameter type outside strings, numbers, booleans and their arrays"
            if not isinstance(spec.get("description", ""), str):
                return f"{fn['name']}.{name}: a non-string description"
    return None


def _tool(tool: Mapping[str, Any], at: str) -> str:
    fn = tool_function(tool, at)
    head = f"// {fn['description']}\n" if fn.get("description") else ""
    params = fn.get("parameters") or {}
    if not params:
        return f"{head}type {fn['name']} = (_: any) => any;\n\n"
    required = params.get("required") or []
    props = params.get("properties") or {}
    if not isinstance(props, Mapping):
        raise TemplateError(f"{at}.function.parameters.properties: must be an object, got {type(props).__name__}")
    if not isinstance(required, list):
        raise TemplateError(f"{at}.function.parameters.required: must be a list, got {type(required).__name__}")
    lines = []
    for name, spec in props.items():
        if not isinstance(spec, Mapping):
            raise TemplateError(f"{at}.function.parameters.properties.{name}: must be an object")
        note = f"// {spec['description']}\n" if spec.get("description") else ""
        default = f", // default: {json.dumps(spec['default'])}" if "default" in spec else ","
        lines.append(f"{note}{name}{'' if name in required else '?'}: {_type(spec) or 'any'}{default}\n")
    return f"{head}type {fn['name']} = (_: {{\n{''.join(lines)}}}) => any;\n\n"


def _developer(instructions: str | None, tools: Sequence[Mapping[str, Any]] | None) -> str:
    body = []
    if instructions:
        body.append(f"# Instructions\n\n{instructions}")
    if tools:
        body.append("# Tools\n\n## functions\n\nnamespace functions {\n\n" + "".join(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
                    + "} // namespace functions")
    return "<|start|>developer<|message|>" + "\n\n".join(body) + "<|end|>"


def _said(channel: str, text: str) -> str:
    """One assistant message of ``channel`` in a history, as harmony writes it."""
    return f"<|start|>assistant<|channel|>{channel}<|message|>{text}<|end|>"


def _keeps_analysis(messages: Sequence[Message], i: int) -> bool:
    if not messages[i].get("tool_calls"):
        return False
    return not any(m.get("role") == "assistant" and not m.get("tool_calls") and _text(m.get("content"))
                   for m in messages[i + 1:])


def _assistant(messages: Sequence[Message], i: int) -> str:
    m = messages[i]
    out = []
    reasoning = m.get("reasoning_content")
    if _keeps_analysis(messages, i) and isinstance(reasoning, str) and reasoning:
        out.append(_said("analysis", reasoning))
    text = _text(m.get("content"))
    if text:
        out.append(_said("final", text))
    for call in m.get("tool_calls") or ():
        fn = call["function"]
        name = str(fn.get("name", ""))
        args = fn.get("arguments", {})
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        recipient = name if name.startswith("functions.") else f"functions.{name}"
        out.append(f"<|start|>assistant to={recipient}<|channel|>commentary<|message|>{args}<|call|>")
    return "".join(out) or _said("final", "")


def _tool_name(messages: Sequence[Message], i: int) -> str:
    m = messages[i]
    if isinstance(m.get("name"), str) and m["name"]:
        return str(m["name"])
    for prev in reversed(messages[:i]):
        for call in prev.get("tool_calls") or ():
            if call.get("id") == m.get("tool_call_id"):
                return str(call["function"].get("name", ""))
    raise TemplateError(f"messages[{i}]: a tool result with no name and no matching tool call")


def _effort_and_day(kwargs: Mapping[str, Any]) -> tuple[str, str]:
    """The system message's reasoning effort and serving day (``strftime_now`` where given)."""
    effort = kwargs.get("reasoning_effort", "medium")
    if effort not in EFFORTS:
        raise TemplateError(f"reasoning_effort {effort!r}: openai_harmony knows {', '.join(EFFORTS)}")
    clock: Callable[[str], str] | None = kwargs.get("strftime_now")
    return str(effort), clock("%Y-%m-%d") if clock is not None else datetime.now(UTC).strftime("%Y-%m-%d")


@checked
def render(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    thinking: bool,
    kwargs: Mapping[str, Any],
) -> str:
    each_call(messages, need_name=False)
    effort, day = _effort_and_day(kwargs)
    first_system = next((i for i, m in enumerate(messages) if m.get("role") == "system"), None)
    out = [_system(day, effort, bool(tools))]
    if first_system is not None or tools:
        instructions = _text(messages[first_system].get("content")) if first_system is not None else None
        out.append(_developer(instructions, tools))
    for i, m in enumerate(messages):
        role = m.get("role")
        if i == first_system:
            continue
        if role == "user":
            out.append(f"<|start|>user<|message|>{_text(m.get('content'))}<|end|>")
        elif role in ("system", "developer"):
            out.append(_developer(_text(m.get("content")), None))
        elif role == "assistant":
            out.append(_assistant(messages, i))
        elif role == "tool":
            name = _tool_name(messages, i)
            recipient = name if name.startswith("functions.") else f"functions.{name}"
            out.append(f"<|start|>{recipient} to=assistant<|channel|>commentary<|message|>{_text(m.get('content'))}<|end|>")
        else:
            raise TemplateError(f"messages[{i}]: role {role!r} is not rendered by the gpt-oss-harmony dialect")
    out.append("<|start|>assistant")
    return "".join(out)


# --- vLLM 0.34's own conversion ---------------------------------------------------------------


def _flat(content: Any) -> str | None:
    """A system, developer or tool message's text as vLLM flattens it: a string as it is,
    the ``text`` of a list's parts joined (None where none has one)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [p if isinstance(p, str) else p.get("text") for p in content if isinstance(p, str | Mapping)]
    kept = [t for t in texts if isinstance(t, str)]
    return "".join(kept) if kept else None


def _parts(content: Any) -> list[str]:
    """A user or assistant message's text contents as vLLM builds them: one per list part
    (its ``text``, else empty), one for a string, one empty for nothing."""
    if isinstance(content, list):
        return [str(p.get("text", "")) if isinstance(p, Mapping) else "" for p in content]
    return [content or ""] if isinstance(content, str) or content is None else [str(content)]


def _vllm_messages(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """The conversation after the leading instructions as vLLM's harmony conversion writes
    it, each message as (channel or "", its rendered text)."""
    names = {call.get("id"): (call.get("function") or {}).get("name") for m in messages
             for call in m.get("tool_calls") or () if isinstance(call, Mapping)}
    out: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        reasoning = m.get("reasoning") if m.get("reasoning") is not None else m.get("reasoning_content")
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            text = _flat(m.get("content"))
            if text:
                out.append(("commentary", _said("commentary", text)))
            if reasoning:
                out.append(("analysis", _said("analysis", reasoning)))
            for call in calls:
                fn = call.get("function") or {}
                args = fn.get("arguments", "")
                if not isinstance(args, str):  # vLLM's request model refuses the request (a 400): never served
                    raise TemplateError(f"messages[{i}]: vLLM takes tool-call arguments as a string only")
                out.append(("commentary", f"<|start|>assistant to=functions.{fn.get('name', '')}<|channel|>commentary "
                                          f"json<|message|>{args}<|call|>"))
        elif role == "tool":
            name = names.get(m.get("tool_call_id", "")) or ""
            out.append(("commentary", f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>"
                                      f"{_flat(m.get('content')) or ''}<|end|>"))
        elif role == "assistant":
            if reasoning:
                out.append(("analysis", _said("analysis", reasoning)))
            parts = _parts(m.get("content"))
            if parts and parts[0]:  # vLLM looks at the first part only
                out.append(("final", _said("final", "".join(parts))))
        elif role in ("system", "developer"):
            text = _flat(m.get("content"))
            if text is not None:
                out.append(("", f"<|start|>developer<|message|># Instructions\n\n{text}<|end|>"))
        else:
            out.append(("", f"<|start|>{role}<|message|>{''.join(_parts(m.get('content')))}<|end|>"))
    # vLLM drops every analysis message before the last final answer (auto_drop_analysis_messages)
    last = max((k for k, (channel, _) in enumerate(out) if channel == "final"), default=-1)
    return [(c, t) for k, (c, t) in enumerate(out) if not (k < last and c == "analysis")]


@checked
def render_vllm(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    thinking: bool,
    kwargs: Mapping[str, Any],
) -> str:
    """The prompt vLLM 0.34 renders for a gpt-oss chat request (``_make_request_with_harmony``):
    only a *leading* system or developer message becomes the developer message's
    instructions (a later one stays where it is, as its own developer message, where
    :func:`render` moves the first system message up); a tool-call turn writes its text as
    a commentary message before its analysis, and each call's header with the ``json``
    content type; a tool result is named by the call it answers; an assistant turn with no
    text writes nothing; the analysis before the last final answer is dropped."""
    effort, day = _effort_and_day(kwargs)
    rest = list(messages)
    instructions = _flat(rest.pop(0).get("content")) if rest[0].get("role") in ("system", "developer") else None
    functions = [t for t in tools or () if t.get("type", "function") == "function"] or None
    out = [_system(day, effort, bool(functions))]
    if instructions or functions:
        out.append(_developer(instructions, functions))
    out += [text for _, text in _vllm_messages(rest)]
    out.append("<|start|>assistant")
    return "".join(out)
