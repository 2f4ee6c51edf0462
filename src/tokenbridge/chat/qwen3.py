"""Qwen3 (hybrid thinking; ChatML with ``<think>`` blocks and ``<tool_call>`` JSON calls).

The generation prompt is ``<|im_start|>assistant\\n``; in thinking mode the model writes
``<think>`` itself, in instant mode (``enable_thinking: false``) the prompt carries an
empty ``<think>\\n\\n</think>\\n\\n``. A tool call is ``<tool_call>\\n{"name": ...,
"arguments": ...}\\n</tool_call>`` inside the content, one section per call (SGLang's
``qwen25`` detector); the turn ends with ``<|im_end|>``.

The official folder ships its chat template, which :func:`..resolve_dialect` renders; the
built-in renderer below is for folders without one and follows that template (earlier
assistant turns drop their reasoning; tool results are wrapped in ``<tool_response>``
inside a user turn; tools are declared in the system turn).
"""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Mapping, Sequence

from ..content import content_text
from .dialect import Dialect, Message, ToolMarkers
from .shapes import call_function, checked
from .template import serving_messages

#: One call per section: ``<tool_call>`` JSON ``</tool_call>``, no markers inside.
TOOL_MARKERS = ToolMarkers(section_begin="<tool_call>", section_end="</tool_call>", unit=(), min_units=0)


def _text(message: Message) -> str:
    return content_text(message.get("content"))


def _tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _last_query(messages: Sequence[Message]) -> int:
    """The last user turn that is not a bare ``<tool_response>`` (the template's
    ``last_query_index``); reasoning is kept only on assistant turns after it."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        c = m.get("content")
        if m["role"] == "user" and isinstance(c, str) and not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
            return i
    return len(messages) - 1


def _assistant(m: Message, keep_reasoning: bool, last: bool, at: str) -> str:
    content = _text(m)
    reasoning = m.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    if keep_reasoning and (last or reasoning):
        out = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
    else:
        out = content
    for n, call in enumerate(m.get("tool_calls") or ()):
        fn = call_function(call, f"{at}.tool_calls[{n}]")
        args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"], ensure_ascii=False)
        sep = "\n" if (n or content) else ""
        out += f'{sep}<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args}}}\n</tool_call>'
    return out


@checked
def render(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    thinking: bool,
    kwargs: Mapping[str, Any],
) -> str:
    messages = serving_messages(messages, parse_tool_arguments=True)
    out: list[str] = []
    first_system = bool(messages) and messages[0]["role"] == "system"
    if tools:
        system = _text(messages[0]) + "\n\n" if first_system else ""
        out.append(f"<|im_start|>system\n{system}{_tools_block(tools)}<|im_end|>\n")
    elif first_system:
        out.append(f"<|im_start|>system\n{_text(messages[0])}<|im_end|>\n")
    last_query = _last_query(messages)
    n = len(messages)
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "user" or (role == "system" and i):
            out.append(f"<|im_start|>{role}\n{_text(m)}<|im_end|>\n")
        elif role == "assistant":
            turn = _assistant(m, i > last_query, i == n - 1, f"messages[{i}]")
            out.append(f"<|im_start|>assistant\n{turn}<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{_text(m)}\n</tool_response>")
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                out.append("<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    if not thinking:
        out.append("<think>\n\n</think>\n\n")
    return "".join(out)


QWEN3 = Dialect(
    name="qwen3",
    render=render,
    thinking_keys=("enable_thinking",),
    serving_readings=True,
    end_token="<|im_end|>",
    think_open="<think>",
    think_close="</think>",
    eos_markers=frozenset({"<|im_end|>", "<|endoftext|>"}),
    tool_markers=TOOL_MARKERS,
    template_kwargs=frozenset({"thinking", "enable_thinking"}),
    stream_held_starts=(TOOL_MARKERS.section_end,),  # qwen25's detector holds what may begin </tool_call>
    stream_held_min=1,
    stream_deletes=(TOOL_MARKERS.section_end,),
)
