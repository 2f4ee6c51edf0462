"""How a serving engine hands a chat template a message whose content is a list of parts.

An API message may carry ``content`` as a list of typed parts
(``[{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]``). Neither
engine passes that list to the template as it came: each first decides, from the
template's own Jinja source, whether the template reads content as a string or iterates
its parts (the *content format*), and then

* SGLang 0.5.23 (``process_content_for_template_format``): ``string`` joins the text of
  the ``text`` / ``input_text`` parts with a space; ``openai`` keeps the parts, each text
  part as ``{"type": "text", "text": ...}`` only; a string content stays a string;
* vLLM 0.34 (``parse_chat_message_content``): ``string`` joins the text parts with a
  newline; ``openai`` makes every content a list of parts, a string content one text
  part; a tool result of text parts only is joined with a newline in either format.

Qwen3's template, handed the list as sent, writes an empty user turn; DeepSeek V3.1's
raises. The two engines' prompts differ (a space against a newline): each is a prompt
reading (:meth:`~tokenbridge.chat.dialect.Dialect.prompt_readings`), and the evidence
picks. Each engine's detection is reimplemented here from its rules, and held against the
engines' own code in the tests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, TypeGuard

import jinja2
from jinja2 import nodes

from .template import TemplateError, compile_template

__all__ = ["ContentFormat", "has_parts", "sglang_content_format", "sglang_parts", "sglang_reading", "vllm_content_format",
           "vllm_differs", "vllm_parts", "vllm_reading", "without_billing_header"]

ContentFormat = Literal["string", "openai"]

#: Part types whose ``text`` each engine reads as text.
_SGLANG_TEXT = ("text", "input_text")


def _parsed(source: str) -> nodes.Template | None:
    try:
        return compile_template(source).environment.parse(source)
    except (jinja2.TemplateError, TypeError, ValueError, RecursionError, SyntaxError):  # the engines: any Exception
        return None


def _names(node: nodes.Node, name: str) -> bool:
    """``node`` reads the variable ``name`` (``ns.rest`` for a dotted name)."""
    if isinstance(node, nodes.Name):
        return node.ctx == "load" and node.name == name
    if isinstance(node, nodes.Getattr) and "." in name:
        base, _, attr = name.rpartition(".")
        return node.attr == attr and _names(node.node, base)
    return False


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` reads ``name`` (or its ``key``: ``name['key']``, ``name.key``), through
    filters, tests and slices (``messages[1:]``, ``message.content | trim``)."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _names(node, name)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _names(node.node, name)
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _names(node.node, name)
    return False


def sglang_content_format(source: str) -> ContentFormat:
    """SGLang 0.5.23's ``detect_jinja_template_content_format``: ``openai`` for a template
    that names a medium anywhere (``image``, ``audio``, ``video``, ``vision``) or loops over
    ``message`` / ``msg`` / ``m``'s ``content``; else (a source Jinja cannot parse too) ``string``."""
    if any(word in source for word in ("image", "audio", "video", "vision")):
        return "openai"
    tree = _parsed(source)
    if tree is None:
        return "string"
    for loop in tree.find_all(nodes.For):
        if any(_reads(loop.iter, name, "content") for name in ("message", "msg", "m")):
            return "openai"
    return "string"


def _aliases(tree: nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it, or from one of those, in any order
    (``{% set msgs = messages[1:] %}``, ``namespace(rest=messages)``, ``ns.rest = messages``):
    vLLM's scope-blind search."""
    found, queue = [name], deque([name])
    while queue:
        current = queue.popleft()
        for assign in tree.find_all(nodes.Assign):
            target, value = assign.target, assign.node
            new: list[str] = []
            if isinstance(target, nodes.Name) and _reads(value, current):
                new.append(target.name)
            if (isinstance(target, nodes.Name) and isinstance(value, nodes.Call)
                    and isinstance(value.node, nodes.Name) and value.node.name == "namespace"):
                new += [f"{target.name}.{kw.key}" for kw in value.kwargs if _reads(kw.value, current)]
            elif isinstance(target, nodes.Getattr | nodes.NSRef) and _reads(value, current):
                dotted = _dotted(target)
                new += [dotted] if dotted is not None else []
            for alias in new:
                if alias not in found:
                    found.append(alias)
                    queue.append(alias)
    return found


def _dotted(node: nodes.Node) -> str | None:
    if isinstance(node, nodes.NSRef):
        return f"{node.name}.{node.attr}"
    attrs = []
    while isinstance(node, nodes.Getattr):
        attrs.append(node.attr)
        node = node.node
    return ".".join([node.name, *reversed(attrs)]) if isinstance(node, nodes.Name) else None


class _Unsure(Exception):
    """vLLM's search met a loop whose target is not one name (``for a, b in ...``): its
    ``assert`` fails, and it takes its default, ``string``."""


def _content_loops(tree: nodes.Template) -> Iterator[nodes.For]:
    """vLLM 0.34's loops over a message's parts: over ``<message>.content`` where
    ``<message>`` is the target of a loop over ``messages`` (or an alias of it); over a
    macro's parameter that some call passes such a content; or, outside every macro, over
    a variable named ``content``. A loop of either kind with a tuple target raises
    :class:`_Unsure` where vLLM's search meets it (every loop over the messages is
    searched first; a loop over parts only until one is found)."""
    messages = _aliases(tree, "messages")
    message_names = []
    for loop in tree.find_all(nodes.For):
        if any(_reads(loop.iter, m) for m in messages):
            if not isinstance(loop.target, nodes.Name):
                raise _Unsure
            message_names.append(loop.target.name)
    content_params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in tree.find_all(nodes.Macro):
        params = {arg.name for arg in macro.args}
        passed: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            passed |= {macro.args[i].name for i, arg in enumerate(call.args)
                       if i < len(macro.args) and any(_reads(arg, m, "content") for m in message_names)}
            passed |= {kw.key for kw in call.kwargs
                       if kw.key in params and any(_reads(kw.value, m, "content") for m in message_names)}
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if passed:
                content_params[id(loop)] = passed
    for loop in tree.find_all(nodes.For):
        named = loop.iter.name if isinstance(loop.iter, nodes.Name) else None
        if (any(_reads(loop.iter, m, "content") for m in message_names)
                or (named is not None and named in content_params.get(id(loop), ()))
                or (named == "content" and id(loop) not in in_macros)):
            if not isinstance(loop.target, nodes.Name):
                raise _Unsure
            yield loop


def vllm_content_format(source: str) -> ContentFormat:
    """vLLM 0.34's ``_detect_content_format`` (its default, ``string``, for a source Jinja
    cannot parse): ``openai`` when the template loops over a message's parts
    (:func:`_content_loops`)."""
    tree = _parsed(source)
    if tree is None:
        return "string"
    try:
        return "openai" if next(_content_loops(tree), None) is not None else "string"
    except _Unsure:
        return "string"


def _texts(parts: Sequence[Any], types: tuple[str, ...]) -> list[str]:
    return [p["text"] for p in parts if isinstance(p, Mapping) and p.get("type") in types and isinstance(p.get("text"), str)]


#: The part SGLang 0.5.23's ``openai`` format hands the template for each media part type.
_SGLANG_MEDIA = {"image_url": "image", "input_image": "image", "video_url": "video", "audio_url": "audio"}


def _sglang_part(part: Any) -> Any | None:
    """A part as SGLang's ``openai`` format keeps it: text as ``{type, text}`` only, a medium
    as its bare type, a ``tool_reference`` as it is; any other part is dropped (None)."""
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    if kind in _SGLANG_TEXT:
        return {"type": "text", "text": part.get("text")}
    if kind in _SGLANG_MEDIA:
        return {"type": _SGLANG_MEDIA[kind]}
    return part if kind == "tool_reference" else None


def sglang_parts(messages: Sequence[Any], fmt: ContentFormat) -> list[Any]:
    """The messages as SGLang 0.5.23 hands the template their list contents (see the module
    doc): its ``process_content_for_template_format``, then ``normalize_tool_content``,
    which joins a tool result still made of text parts only with a space. Applying it twice
    changes nothing more."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list):
            if fmt == "string":
                content = " ".join(_texts(content, _SGLANG_TEXT))
            else:
                content = [kept for kept in map(_sglang_part, content) if kept is not None]
                if m.get("role") == "tool" and all(p.get("type") == "text" for p in content):
                    content = " ".join(p["text"] if isinstance(p.get("text"), str) else "" for p in content)
            m = {**m, "content": content}
        out.append(m)
    return out


#: vLLM 0.34's text-like part types and the key each holds its text under (``MM_PARSER_MAP``).
_VLLM_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "thinking": "thinking",
                   "refusal": "refusal"}
#: vLLM 0.34's media part types and the part its ``openai`` format hands the template for each.
_VLLM_MEDIA = {"image_url": "image", "input_image": "image", "image_pil": "image", "image_embeds": "image",
               "audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio", "video_url": "video",
               "video_embeds": "video"}
#: The keys of vLLM 0.34's content-part types: a part's other keys reach the template with it.
_VLLM_PART_FIELDS = frozenset({"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
                               "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text",
                               "thinking", "type", "uuid", "video_embeds", "video_url"})
#: The first line vLLM 0.34 drops from a system message's text (``_strip_claude_code_billing_header``).
_BILLING_HEADER = "x-anthropic-billing-header"


def _vllm_part(part: Any, fmt: ContentFormat) -> Any:
    """A part as vLLM's ``parse_chat_message_content_part`` hands it on: its text
    (``string``) or ``{type: text, text, ...its other keys}`` (``openai``); a medium as its
    bare type (``openai``; ``string``: its placeholder, not modelled: such a prompt is not
    proved); None for a part vLLM skips."""
    if isinstance(part, str):
        return part if fmt == "string" else {"type": "text", "text": part}
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    extra = {k: v for k, v in part.items() if k not in _VLLM_PART_FIELDS}
    if kind in _VLLM_TEXT_KEYS:
        text = part.get(_VLLM_TEXT_KEYS[kind])
        if text is None and (fmt == "string" or kind in ("text", "refusal")):
            return None
        if fmt != "string":
            return {"type": "text", "text": text, **extra}  # as it is: the template takes what it can
        if not isinstance(text, str):  # the join of the texts raises (a TypeError): vLLM served no prompt
            raise TemplateError(f"a {kind!r} content part's {_VLLM_TEXT_KEYS[kind]!r} is not a string")
        return text
    if kind == "tool_reference":
        return part.get("name") if fmt == "string" else {"type": "tool_reference", "name": part.get("name")}
    if fmt == "string" or kind not in _VLLM_MEDIA:
        return None
    return {"type": _VLLM_MEDIA[kind], **extra}


def _without_billing_header(parts: list[Any]) -> tuple[list[Any], bool]:
    """A system message's parts without the Claude Code attribution line vLLM drops, and whether it was there."""
    out, dropped = [], False
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        dropped = True
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out, dropped


def _vllm_message(m: Mapping[str, Any], fmt: ContentFormat) -> tuple[dict[str, Any], bool]:
    content = m.get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content) if isinstance(content, list) else []
    dropped = False
    if m.get("role") == "system":
        parts, dropped = _without_billing_header(parts)
    served = [kept for kept in (_vllm_part(p, fmt) for p in parts) if kept]  # vLLM keeps what is truthy
    if fmt == "string":
        return {**m, "content": "\n".join(served)}, dropped
    if m.get("role") == "tool" and all(isinstance(p, Mapping) and p.get("type") == "text" for p in served):
        return {**m, "content": "\n".join(p.get("text", "") for p in served)}, dropped
    return {**m, "content": served}, dropped


def vllm_parts(messages: Sequence[Any], fmt: ContentFormat) -> list[Any]:
    """The messages as vLLM 0.34 hands the template their contents (see the module doc;
    a system message without a Claude Code attribution first line, as vLLM drops it)."""
    return vllm_reading(messages, fmt)[0]


def has_parts(messages: Any) -> TypeGuard[list[Any]]:
    """Whether ``messages`` is a list in which some content is a list of parts."""
    return isinstance(messages, list) and any(isinstance(m, Mapping) and isinstance(m.get("content"), list)
                                              for m in messages)


def vllm_differs(messages: Any) -> bool:
    """Whether vLLM hands a template these messages otherwise than as sent where no content
    is a list: a system message opening with the Claude Code attribution line."""
    return isinstance(messages, list) and any(without_billing_header(m) is not None for m in messages)


def without_billing_header(message: Any) -> dict[str, Any] | None:
    """A system message as vLLM 0.34 hands it on without Claude Code's attribution line
    (``_strip_claude_code_billing_header``, on a string content as on each text part; a
    string stays a string), or None where it has none."""
    if not isinstance(message, Mapping) or message.get("role") != "system":
        return None
    content = message.get("content")
    if not isinstance(content, str | list):
        return None
    parts, dropped = _without_billing_header([content] if isinstance(content, str) else content)
    if not dropped:
        return None
    return {**message, "content": (parts[0] if parts else "") if isinstance(content, str) else parts}


def _joined(messages: Sequence[Any], types: tuple[str, ...], role: str | None = None) -> bool:
    """Whether some content (of ``role``'s messages) is a list of two or more parts of
    ``types``: where joining them with a space, a newline or nothing differs."""
    return any(isinstance(m, Mapping) and (role is None or m.get("role") == role) and isinstance(m.get("content"), list)
               and sum(isinstance(p, Mapping) and p.get("type") in types for p in m["content"]) > 1 for m in messages)


def sglang_reading(messages: Sequence[Any], fmt: ContentFormat) -> tuple[list[Any], str | None]:
    """:func:`sglang_parts`, and the prompt reading's name for what it did where that is
    SGLang's own: ``parts=space`` (two or more text parts joined), ``tool_parts=space``
    (a tool result's, parts kept otherwise), None (each list's text is what its parts say)."""
    if fmt == "string":
        name = "parts=space" if _joined(messages, _SGLANG_TEXT) else None
    else:
        name = "tool_parts=space" if _joined(messages, ("text",), "tool") else None
    return sglang_parts(messages, fmt), name


def vllm_reading(messages: Sequence[Any], fmt: ContentFormat) -> tuple[list[Any], str]:
    """The messages as vLLM 0.34 hands them to the template, and the prompt reading's
    name: ``parts=newline`` (lists joined), ``tool_parts=newline`` (a tool result's, parts
    kept otherwise), ``billing_header=dropped`` (a system message lost its first line), or
    else ``parts=vllm`` (every content a list of parts)."""
    out, dropped = [], False
    for m in messages:
        if isinstance(m, Mapping):
            m, cut = _vllm_message(m, fmt)
            dropped = dropped or cut
        out.append(m)
    names = ["billing_header=dropped"] if dropped else []
    if has_parts(messages) and fmt == "string":
        names.append("parts=newline")
    elif has_parts(messages) and _joined(messages, tuple(_VLLM_TEXT_KEYS), "tool"):
        names.append("tool_parts=newline")
    return out, "+".join(sorted(names)) or "parts=vllm"
