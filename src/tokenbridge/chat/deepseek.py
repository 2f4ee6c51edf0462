"""DeepSeek V3.1: the completion side of the family; prompts come from the folder's template.

The official V3.1 folder ships its chat template (in tokenizer_config.json), and that is
what SGLang and vLLM render, so this dialect has no built-in renderer
(:func:`..resolve_dialect` refuses a V3.1 folder without a template). Facts the template
and SGLang 0.5.23 fix:

* Thinking is **off unless asked**: the template defaults ``thinking`` to false, and
  SGLang's ``deepseek-v3`` parser enables reasoning only for an explicit
  ``chat_template_kwargs.thinking: true`` (OpenRouter: ``reasoning: {enabled: true}``).
* The generation prompt ends ``<｜Assistant｜><think>`` (thinking) or
  ``<｜Assistant｜></think>`` (not): the model writes ``reasoning </think> content`` or
  just ``content``, then ``<｜end▁of▁sentence｜>``.
* After a tool result the template adds no generation prompt at all: the prompt ends
  ``<｜tool▁output▁end｜>`` and the model writes its answer with no think block, even in
  thinking mode. SGLang, forced into reasoning by ``thinking: true``, then returns that
  whole answer as ``reasoning_content`` (no ``</think>`` ever comes); the completion is
  that text and the end token, with no think markers (``think_self_open=False``).
* Tool calls: ``<｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>name<｜tool▁sep｜>arguments
  <｜tool▁call▁end｜>)+<｜tool▁calls▁end｜>`` after the content (SGLang's ``deepseekv31``
  detector). The template declares no tools: a request's ``tools`` never reach the prompt.
  Its history concatenates ``arguments`` as strings, so they reach it as given (SGLang
  0.5.23 parses them into objects first, which this template cannot render).
"""

from __future__ import annotations

from .dialect import Dialect, ToolMarkers

END = "<｜end▁of▁sentence｜>"

TOOL_MARKERS = ToolMarkers(
    section_begin="<｜tool▁calls▁begin｜>",
    section_end="<｜tool▁calls▁end｜>",
    call_begin="<｜tool▁call▁begin｜>",
    argument_begin="<｜tool▁sep｜>",
    call_end="<｜tool▁call▁end｜>",
)

DEEPSEEK_V31 = Dialect(
    name="deepseek-v3.1",
    render=None,
    thinking_keys=("thinking",),
    serving_readings=True,
    end_token=END,
    think_open="<think>",
    think_close="</think>",
    eos_markers=frozenset({END}),
    tool_markers=TOOL_MARKERS,
    thinking_default=False,
    think_self_open=False,
    parse_tool_arguments=False,
    stream_deletes=("<｜tool▁calls▁end｜>", "<｜tool▁call▁end｜>"),
    reasoning_tool_start="<tool_call>",
)
