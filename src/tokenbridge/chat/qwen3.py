"""Qwen3 (ChatML with ``<think>`` blocks): a second family, written as one small module.

The generation prompt is ``<|im_start|>assistant\\n``; in thinking mode the model writes
``<think>`` itself, in instant mode the prompt carries an empty ``<think>\\n\\n</think>\\n\\n``.
Earlier assistant turns drop their reasoning. Tool results are wrapped in
``<tool_response>`` inside a user turn, as the Qwen3 template does; tools are declared in
the system turn.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from .dialect import Dialect, Message


def _text(message: Message) -> str:
    c = message.get("content")
    if isinstance(c, str):
        return c
    return "".join(str(p.get("text", "")) for p in (c or ()))


def _tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    thinking: bool,
    kwargs: Mapping[str, Any],
) -> str:
    out: list[str] = []
    rest = list(messages)
    if tools:
        system = _text(rest.pop(0)) if rest and rest[0]["role"] == "system" else ""
        out.append(f"<|im_start|>system\n{system}{_tools_block(tools)}<|im_end|>\n")
    for i, m in enumerate(rest):
        role = m["role"]
        if role == "tool":
            first = i == 0 or rest[i - 1]["role"] != "tool"
            last = i == len(rest) - 1 or rest[i + 1]["role"] != "tool"
            if first:
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{_text(m)}\n</tool_response>")
            if last:
                out.append("<|im_end|>\n")
            continue
        body = _text(m)
        if role == "assistant":
            for call in m.get("tool_calls") or ():
                fn = call["function"]
                args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"], ensure_ascii=False)
                body += f'\n<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args}}}\n</tool_call>'
        out.append(f"<|im_start|>{role}\n{body}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    if not thinking:
        out.append("<think>\n\n</think>\n\n")
    return "".join(out)


QWEN3 = Dialect(
    name="qwen3",
    render=render,
    end_token="<|im_end|>",
    think_open="<think>",
    think_close="</think>",
    eos_markers=frozenset({"<|im_end|>", "<|endoftext|>"}),
    tool_markers=None,
    template_kwargs=frozenset({"thinking", "enable_thinking"}),
)
