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
from typing import Any, Literal

import jinja2
from jinja2 import nodes

from .template import compile_template

__all__ = ["ContentFormat", "sglang_content_format", "sglang_parts", "sglang_reading", "vllm_content_format", "vllm_parts",
           "vllm_reading"]

ContentFormat = Literal["string", "openai"]

#: Part types whose ``text`` each engine reads as text.
_SGLANG_TEXT = ("text", "input_text")
_VLLM_TEXT = ("text", "input_text", "output_text")


def _parsed(source: str) -> nodes.Template | None:
    try:
        return compile_template(source).environment.parse(source)
    except (jinja2.TemplateError, TypeError, ValueError, RecursionError):
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


def _content_loops(tree: nodes.Template) -> Iterator[nodes.For]:
    """vLLM 0.34's loops over a message's parts: over ``<message>.content`` where
    ``<message>`` is the target of a loop over ``messages`` (or an alias of it); over a
    macro's parameter that some call passes such a content; or, outside every macro, over
    a variable named ``content``."""
    messages = _aliases(tree, "messages")
    message_names = [loop.target.name for loop in tree.find_all(nodes.For)
                     if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, m) for m in messages)]
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
            yield loop


def vllm_content_format(source: str) -> ContentFormat:
    """vLLM 0.34's ``_detect_content_format`` (its default, ``string``, for a source Jinja
    cannot parse): ``openai`` when the template loops over a message's parts
    (:func:`_content_loops`)."""
    tree = _parsed(source)
    if tree is None:
        return "string"
    return "openai" if next(_content_loops(tree), None) is not None else "string"


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


def vllm_parts(messages: Sequence[Any], fmt: ContentFormat) -> list[Any]:
    """The messages as vLLM 0.34 hands the template their contents (see the module doc)."""
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            out.append(m)
            continue
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content if isinstance(content, list) else []
        texts_only = all(isinstance(p, Mapping) and p.get("type") in _VLLM_TEXT for p in parts)
        if fmt == "string" or (m.get("role") == "tool" and texts_only):
            out.append({**m, "content": "\n".join(_texts(parts, _VLLM_TEXT))})
        else:
            out.append({**m, "content": [{**p, "type": "text", "text": p["text"]} if p.get("type") in _VLLM_TEXT else p
                                         for p in parts if isinstance(p, Mapping)]})
    return out


def _tool_text_parts(messages: Sequence[Any], types: tuple[str, ...]) -> bool:
    """Whether a tool result is a list of text parts only (each engine joins those)."""
    return any(isinstance(m, Mapping) and m.get("role") == "tool" and isinstance(m.get("content"), list)
               and all(isinstance(p, Mapping) and p.get("type") in types for p in m["content"]) for m in messages)


def sglang_reading(messages: Sequence[Any], fmt: ContentFormat) -> tuple[list[Any], str | None]:
    """:func:`sglang_parts`, and the prompt reading's name for what it did: ``parts=space``
    (every list joined), ``tool_parts=space`` (a tool result's alone), None (the parts reach
    the template as sent)."""
    if fmt == "string":
        name: str | None = "parts=space"
    else:
        name = "tool_parts=space" if _tool_text_parts(messages, _SGLANG_TEXT) else None
    return sglang_parts(messages, fmt), name


def vllm_reading(messages: Sequence[Any], fmt: ContentFormat) -> tuple[list[Any], str]:
    """:func:`vllm_parts`, and the prompt reading's name for what it did: ``parts=newline``
    (every list joined), ``tool_parts=newline`` (a tool result's alone), else ``parts=vllm``
    (every content a list of parts)."""
    if fmt == "string":
        name = "parts=newline"
    else:
        name = "tool_parts=newline" if _tool_text_parts(messages, _VLLM_TEXT) else "parts=vllm"
    return vllm_parts(messages, fmt), name
