"""Kimi K2.5: the built-in dialect for folders that ship no chat template.

History rules follow the K2-Thinking template (the nearest published predecessor):
assistant turns up to the last one without tool calls are rendered as
``<think></think>`` + content (reasoning dropped); the trailing tool-call chain keeps its
``reasoning_content``. A default system message is added when none is given. K2.5
differs in two places: images use ``<|media_begin|>``, and the generation prompt opens
the think block itself (``<think>``; ``<think></think>`` in instant mode).

Tools are declared as K2.5's tokenizer code declares them: TypeScript-style, with the
JSON fallback where that code falls back (:mod:`.kimi_tools`).

Template switches (``chat_template_kwargs``): ``thinking`` (instant mode when false) and
``preserve_thinking`` (K2.5/K2.6 tokenizer code, default false): when true, every
earlier assistant turn keeps its ``reasoning_content`` instead of ``<think></think>``.
Any other key is reported by the gate (``template_kwarg_unknown``), never ignored
silently.

The default system message follows the K2 / K2-Thinking templates (and tinker-cookbook's
K2.5 renderer, which is tested against the K2.5 template); the ``renderers`` package
omits it. ``tests/test_chat_k25_oracle.py`` pins that difference.
"""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Mapping, Sequence

from .dialect import Dialect, Message, ToolMarkers
from .kimi_tools import declare_tools
from .shapes import checked, each_call

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

#: ``chat_template_kwargs`` keys this dialect renders (``enable_thinking`` is read by
#: :func:`.dialect.thinking_enabled`).
TEMPLATE_KWARGS = frozenset({"thinking", "enable_thinking", "preserve_thinking"})

TOOL_MARKERS = ToolMarkers(
    section_begin="<|tool_calls_section_begin|>",
    section_end="<|tool_calls_section_end|>",
    call_begin="<|tool_call_begin|>",
    argument_begin="<|tool_call_argument_begin|>",
    call_end="<|tool_call_end|>",
)

_IMAGE = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"


def _content(message: Message) -> str:
    c = message.get("content")
    if isinstance(c, str):
        return c
    if c is None:
        return ""
    out = []
    for part in c:
        if isinstance(part, str):  # the template's tests on a string: a substring test, and no 'text'
            out.append(_IMAGE if "image" in part else "")
        elif part.get("type") == "image" or "image" in part or "image_url" in part:
            out.append(_IMAGE)
        else:
            out.append(str(part.get("text", "")))
    return "".join(out)


def _header(message: Message) -> str:
    role = message["role"]
    name = message.get("name") or role
    tag = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}.get(role, "<|im_system|>")
    return f"{tag}{name}<|im_middle|>"


def _tool_calls(message: Message) -> str:
    out = [TOOL_MARKERS.section_begin]
    for call in message.get("tool_calls") or ():
        args = call["function"]["arguments"]
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append(f"{TOOL_MARKERS.call_begin}{call.get('id', '')}{TOOL_MARKERS.argument_begin}{args}{TOOL_MARKERS.call_end}")
    out.append(TOOL_MARKERS.section_end)
    return "".join(out)


@checked
def render(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    thinking: bool,
    kwargs: Mapping[str, Any],
) -> str:
    each_call(messages, need_name=False)
    last_plain = -1  # last assistant turn without tool calls: history ends there
    if kwargs.get("preserve_thinking") is not True:
        for idx in range(len(messages) - 1, -1, -1):
            if messages[idx]["role"] == "assistant" and not messages[idx].get("tool_calls"):
                last_plain = idx
                break
    out: list[str] = []
    if tools:
        out.append(f"<|im_system|>tool_declare<|im_middle|>{declare_tools(tools).text}<|im_end|>")
    if not messages or messages[0]["role"] != "system":
        out.append(f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM}<|im_end|>")
    for idx, m in enumerate(messages):
        out.append(_header(m))
        role = m["role"]
        if role == "assistant":
            reasoning = "" if idx <= last_plain else (m.get("reasoning_content") or "")
            out.append(f"<think>{reasoning}</think>{_content(m)}")
            if m.get("tool_calls"):
                out.append(_tool_calls(m))
        elif role == "tool":
            out.append(f"## Return of {m.get('tool_call_id', '')}\n{_content(m)}")
        elif m.get("content") is not None:
            out.append(_content(m))
        out.append("<|im_end|>")
    out.append("<|im_assistant|>assistant<|im_middle|>")
    out.append("<think>" if thinking else "<think></think>")
    return "".join(out)


def tools_unproven(tools: Sequence[Any]) -> str | None:
    """Why the tool declaration for ``tools`` is not proven, or None when it is
    (the TypeScript form, cross-checked against the oracles)."""
    decl = declare_tools(tools)
    if decl.form == "typescript":
        return None
    if decl.certain:
        return (f"declared as JSON, K2.5's fallback ({decl.reason}); the fallback's spacing (compact, as "
                "later Kimi templates print it) is not verified for K2.5")
    return f"declared as JSON; schema outside the subset reproduced exactly ({decl.reason})"


KIMI_K25 = Dialect(
    name="kimi-k2.5",
    render=render,
    end_token="<|im_end|>",
    think_open="<think>",
    think_close="</think>",
    eos_markers=frozenset({"<|im_end|>", "[EOS]", "[EOT]"}),
    tool_markers=TOOL_MARKERS,
    template_kwargs=TEMPLATE_KWARGS,
    tools_unproven=tools_unproven,
    argument_readings=True,
    stream_held_starts=tuple(m for m in (TOOL_MARKERS.section_begin, TOOL_MARKERS.call_begin) if m),
    stream_deletes=tuple(m for m in (TOOL_MARKERS.section_end, TOOL_MARKERS.call_end) if m),
    vllm_joins=True,
)
