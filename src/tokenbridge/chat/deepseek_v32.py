"""DeepSeek V3.2: no chat template upstream, so a built-in renderer of its documented format.

DeepSeek ships a Python encoder for V3.2 (``encoding/encoding_dsv32.py``), which SGLang
0.5.23 and vLLM wrap; this module writes the same format from its description, and the
tests hold it against SGLang's copy of that encoder. The serving side first puts an empty
system message in front when the conversation has none and hangs the request's ``tools``
on it; ``content: null`` is ``""`` and a list of text parts is joined with a space.

* ``<｜begin▁of▁sentence｜>``, then the system text (``"\\n\\n## Tools ..."`` when tools are
  declared), then each user turn as ``<｜User｜>text<｜Assistant｜>`` followed by
  ``<think>`` (the last user turn, thinking mode) or ``</think>``.
* Assistant history: ``content``, then ``\\n\\n<｜DSML｜function_calls>...`` for tool
  calls, then ``<｜end▁of▁sentence｜>``; a turn after the last user message in thinking
  mode keeps ``reasoning</think>`` in front. Earlier turns lose their reasoning.
* Tool results: ``\\n\\n<function_results>`` + ``\\n<result>...</result>`` per call +
  ``\\n</function_results>`` + ``\\n\\n<think>`` / ``\\n\\n</think>``: the next answer always
  follows an opened or closed think block.
* Completions, as SGLang's ``deepseek-v3`` parser splits them: thinking ``reasoning
  </think> content``, then an optional DSML tool section, then ``<｜end▁of▁sentence｜>``.
  Thinking is off unless asked, as for V3.1.

Unproven: the ``developer`` role and ``response_format`` (rendered by the encoder, not
reproduced here: such requests raise :class:`~.template.TemplateError`), the structure
inside a DSML section (its only marker token is ``｜DSML｜``; the gate checks that no
other marker appears there), and DeepSeek's own encoder beyond SGLang's copy of it.
"""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Mapping, Sequence

from .dialect import Dialect, Message, ToolMarkers
from .shapes import call_arguments, call_function, checked, each_call, tool_function
from .template import TemplateError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DSML = "｜DSML｜"

_TOOLS_HEAD = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{DSML}function_calls>
...
</{DSML}function_calls>
<function_results>
...
</function_results>
<think>...thinking about results</think>
Here are the functions available in JSONSchema format:
<functions>
"""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(message: Message) -> str:
    c = message.get("content")
    if isinstance(c, str):
        return c
    if not c:
        return ""
    return " ".join(str(p.get("text", "")) for p in c if isinstance(p, Mapping) and p.get("type") in ("text", "input_text"))


def _tools(tools: Sequence[Mapping[str, Any]]) -> str:
    schemas = "\n".join(_json(tool_function(t, f"tools[{i}]")) for i, t in enumerate(tools))
    return f"{_TOOLS_HEAD}{schemas}\n</functions>\n"


def _calls(calls: Sequence[Mapping[str, Any]], at: str) -> str:
    invokes = []
    for j, call in enumerate(calls):
        fn = call_function(call, f"{at}.tool_calls[{j}]")
        args = call_arguments(fn, f"{at}.tool_calls[{j}]")
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
            for k, v in args.items()
        )
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}function_calls>\n" + "\n".join(invokes) + f"\n</{DSML}function_calls>"


@checked
def render(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    thinking: bool,
    kwargs: Mapping[str, Any],
) -> str:
    each_call(messages)
    msgs = list(messages)
    shift = 0  # messages[i] of the request is msgs[i + shift]
    if msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": ""})
        shift = 1
    last_user = max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)
    out = [BOS]
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            out.append(_text(m))
            if i == 0 and tools:
                out.append("\n\n" + _tools(tools))
        elif role == "user":
            out.append(f"<｜User｜>{_text(m)}<｜Assistant｜>")
            out.append("<think>" if i == last_user and thinking else "</think>")
        elif role == "tool":
            j = i - 1
            while j >= 0 and msgs[j]["role"] == "tool":
                j -= 1
            calls = msgs[j].get("tool_calls") if j >= 0 and msgs[j]["role"] == "assistant" else None
            order = i - j
            if not calls or len(calls) < order:
                raise TemplateError(f"messages[{i - shift}]: a tool result with no matching assistant tool call")
            if order == 1:
                out.append("\n\n<function_results>")
            out.append(f"\n<result>{_text(m)}</result>")
            if order == len(calls):
                out.append("\n</function_results>\n\n" + ("<think>" if i >= last_user and thinking else "</think>"))
        elif role == "assistant":
            if thinking and i > last_user:
                if not (m.get("reasoning_content") or m.get("tool_calls")):
                    raise TemplateError(f"messages[{i - shift}]: an assistant turn after the last user turn needs reasoning "
                                        "or tool calls in thinking mode")
                out.append((m.get("reasoning_content") or "") + "</think>")
            out.append(_text(m))
            if m.get("tool_calls"):
                out.append(_calls(m["tool_calls"], f"messages[{i - shift}]"))
            out.append(EOS)
        else:
            raise TemplateError(f"messages[{i - shift}]: role {role!r} is not rendered by the built-in deepseek-v3.2 dialect")
    return "".join(out)


def vllm_request(request: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, str]:
    """``request`` as vLLM 0.34's V3.2 encoder wrapper takes it, and the reading's name:
    contents as ``parse_chat_messages(content_format="string")`` hands them on (text parts
    joined with a newline, ``parts=newline``; a system message's Claude Code attribution
    line dropped, ``billing_header=dropped``), and its tools on a system message of their
    own put in front of the conversation's (SGLang hangs them on that one: the tools block
    then follows its text), ``tools_system=vllm``. None where vLLM's request model refuses a
    content part (it served nothing)."""
    from .parts import has_parts, vllm_differs, vllm_reading

    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return request, ""
    names = []
    if has_parts(messages) or vllm_differs(messages):
        try:
            messages, name = vllm_reading(messages, "string")
        except TemplateError:
            return None, ""
        names.append(name)
    tools = request.get("tools")
    first = messages[0]
    if isinstance(tools, list) and tools and isinstance(first, Mapping) and first.get("role") == "system":
        messages = [{"role": "system", "content": ""}, *messages]
        names.append("tools_system=vllm")
    return ({**request, "messages": messages}, "+".join(sorted(names))) if names else (request, "")


TOOL_MARKERS = ToolMarkers(section_begin=f"<{DSML}function_calls>", section_end=f"</{DSML}function_calls>",
                           token=DSML)

DEEPSEEK_V32 = Dialect(
    name="deepseek-v3.2",
    render=render,
    thinking_keys=("thinking",),
    serving_readings=True,
    end_token=EOS,
    think_open="<think>",
    think_close="</think>",
    eos_markers=frozenset({EOS}),
    tool_markers=TOOL_MARKERS,
    template_kwargs=frozenset({"thinking", "enable_thinking"}),
    tools_unproven=lambda tools: None,
    thinking_default=False,
    think_self_open=False,
    reasoning_tool_start="<tool_call>",
    vllm_request=vllm_request,
)
