"""GLM-4.5 / GLM-4.6: the completion side of the family; prompts come from the folder's template.

The folder ships the official chat template (SGLang and vLLM render it), so this dialect
has no built-in renderer. Facts the template and SGLang 0.5.23 fix:

* Thinking is on by default (``enable_thinking: false`` turns it off: ``/nothink`` on
  user turns, and the generation prompt ``<|assistant|>\\n<think></think>``).
* In thinking mode the prompt ends ``<|assistant|>`` and the model writes
  ``\\n<think>reasoning</think>\\ncontent``: the newline before ``<think>`` is the
  template's history form, and engines show it (vLLM issue 23479: a streamed ``"\\n"``
  before the reasoning). SGLang's ``glm45`` parser returns ``"\\n<think>" + reasoning``
  whole and ``"\\n" + reasoning`` streamed; both come back as the same native ids
  (``think_open_prefix``). vLLM drops that newline whole, and streams it as content.
* A tool call is ``<tool_call>name\\n(<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n)*</tool_call>``
  inside the content (SGLang's ``glm45`` detector), one section per call.
* The turn ends by emitting the next turn's role token: ``<|observation|>`` after a tool
  call, ``<|user|>`` otherwise (``<|endoftext|>`` is the third stop token; the API text
  cannot tell it from ``<|user|>``: same count, different id, so only ground-truth ids
  prove that choice).
"""

from __future__ import annotations

from .dialect import Dialect, ToolMarkers

TOOL_MARKERS = ToolMarkers(
    section_begin="<tool_call>",
    section_end="</tool_call>",
    unit=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    min_units=0,
)

GLM45 = Dialect(
    name="glm-4.5",
    render=None,
    thinking_keys=("enable_thinking",),
    serving_readings=True,
    end_token="<|user|>",
    tool_end_token="<|observation|>",
    think_open="<think>",
    think_close="</think>",
    think_open_prefix="\n",
    eos_markers=frozenset({"<|user|>", "<|observation|>", "<|endoftext|>"}),
    tool_markers=TOOL_MARKERS,
    stream_deletes=("</tool_call>",),
    reasoning_end_stripped=True,
)
