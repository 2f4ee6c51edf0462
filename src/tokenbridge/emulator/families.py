"""What the emulator needs to know about each model family beyond its dialect.

A dialect (:mod:`tokenbridge.chat`) says how prompts render and which markers frame a
completion; it does not say what text the model writes between them, nor what the
serving engines make of the ids. A :class:`FamilyProfile` holds exactly that, as data:

* the native frame of the model's text (Qwen3 writes ``<think>\\n R \\n</think>\\n\\n C``,
  GLM puts ``\\n`` before its content; Kimi and DeepSeek write nothing extra);
* whether it calls tools in thinking mode (DeepSeek V3.1: its model card supports tool
  calls in non-thinking mode only);
* the SGLang 0.5.23 reasoning parser (``--reasoning-parser``) and the text at which it
  ends the reasoning when ``</think>`` never came (its detector's ``tool_start_token``);
* the vLLM reasoning parser's shape and whether vLLM's detokenizer joins added tokens with
  spaces (only for slow tokenizers: Kimi's tiktoken class; the ``tokenizer.json``
  families use ``tokenizers``' own decode, which adds none).

gpt-oss (harmony) has no think block at all: its ``writer`` is ``harmony`` (analysis and
final channels, one commentary tool call ended by ``<|call|>``), its SGLang parser keeps
the special tokens, and no vLLM profile is modelled for it.

The tool-call *grammar* is not here: the synthetic model takes it from the dialect's own
prompt renderer, which writes a tool-calling assistant turn exactly as the model was
trained to emit it (:func:`tool_section_text`). Adding a family is one entry in
:data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

from ..chat import Dialect
from ..jsonl import loads_document
from ..tokenizer import Tokenizer

__all__ = ["FAMILIES", "FamilyProfile", "VllmReasoning", "Writer", "family_profile", "skipped_ids", "tool_section_text"]

#: How vLLM's reasoning parser for the family splits a whole response:
#: ``kimi_k2`` (``KimiK2ReasoningParser``: like SGLang's, ends at the tool section),
#: ``both_markers`` (``Qwen3ReasoningParser`` / ``Glm4MoeModelReasoningParser``: no split
#: unless ``<think>`` and ``</think>`` are both in the text; the text before ``<think>`` is
#: dropped), ``deepseek_v3`` (``DeepSeekV3ReasoningParser``: thinking requests go to
#: ``DeepSeekR1ReasoningParser``, all reasoning until ``</think>``; others to
#: ``IdentityReasoningParser``, all content).
#: ``unmodelled``: no vLLM profile (gpt-oss: vLLM serves harmony through ``openai_harmony``,
#: which this emulator does not invert); a vLLM provider for it is a config error.
VllmReasoning = Literal["kimi_k2", "both_markers", "deepseek_v3", "unmodelled"]
#: How the synthetic model lays out a completion: ``think`` (a think block, then content and
#: the family's tool section) or ``harmony`` (gpt-oss's channels; see :mod:`.synthetic`).
Writer = Literal["think", "harmony"]


@dataclass(frozen=True)
class FamilyProfile:
    """One family's native text frame and its engines' parsers (see the module doc)."""

    name: str
    #: Text the model writes right after opening and right before closing its think block.
    reasoning_frame: tuple[str, str] = ("", "")
    #: Text before the content: after ``</think>`` in thinking mode, first in instant mode.
    content_lead_thinking: str = ""
    content_lead_instant: str = ""
    tools_when_thinking: bool = True
    sglang_parser: str = ""
    #: SGLang's detector ``tool_start_token``: where forced reasoning ends without ``</think>``.
    sglang_tool_start: str | None = None
    vllm_reasoning: VllmReasoning = "both_markers"
    vllm_joins_added_tokens: bool = False
    writer: Writer = "think"


FAMILIES: dict[str, FamilyProfile] = {p.name: p for p in (
    # Kimi's own writer (synthetic.py) also opens tool sections without </think>
    # (``EmulatorConfig.tool_call_without_think_close``); the other families never do.
    FamilyProfile("kimi-k2.5", sglang_parser="kimi_k2",
                  sglang_tool_start="<|tool_calls_section_begin|>", vllm_reasoning="kimi_k2",
                  vllm_joins_added_tokens=True),
    FamilyProfile("qwen3", reasoning_frame=("\n", "\n"), content_lead_thinking="\n\n", sglang_parser="qwen3",
                  sglang_tool_start="<tool_call>", vllm_reasoning="both_markers"),
    # SGLang's deepseek-v3 detector is its Qwen3 one (tool_start "<tool_call>", which a
    # DeepSeek completion never holds as a token), enabled only by an explicit thinking switch.
    FamilyProfile("deepseek-v3.1", tools_when_thinking=False, sglang_parser="deepseek-v3",
                  sglang_tool_start="<tool_call>", vllm_reasoning="deepseek_v3"),
    FamilyProfile("deepseek-v3.2", sglang_parser="deepseek-v3", sglang_tool_start="<tool_call>",
                  vllm_reasoning="deepseek_v3"),
    FamilyProfile("glm-4.5", content_lead_thinking="\n", content_lead_instant="\n", sglang_parser="glm45",
                  sglang_tool_start="<tool_call>", vllm_reasoning="both_markers"),
    # Harmony: SGLang's gpt-oss detector runs its HarmonyParser over text with the special
    # tokens kept (engines.py); it has no tool start of the think-block kind.
    FamilyProfile("gpt-oss", sglang_parser="gpt-oss", vllm_reasoning="unmodelled", writer="harmony"),
)}


def family_profile(dialect: Dialect) -> FamilyProfile:
    """The profile of ``dialect``'s family (``qwen3+template`` is ``qwen3``); a family
    without an entry (the generic dialect) gets the plain frame and no engine quirks."""
    base = dialect.name.split("+", 1)[0]
    base = _SAME_COMPLETIONS.get(base, base)
    return FAMILIES.get(base, FamilyProfile(base))


#: Dialects that render prompts their own way but share a family's completions.
_SAME_COMPLETIONS = {"gpt-oss-harmony": "gpt-oss"}


_SENTINEL = "\u2063TB-CONTENT\u2063"


def tool_section_text(dialect: Dialect, calls: Sequence[tuple[str, str]]) -> str:
    """The text a model of ``dialect``'s family writes after its content to call
    ``calls`` (``(name, JSON arguments)``), tool markers included, as its own prompt
    renderer writes that assistant turn in history: the template's form is the form the
    model was trained to emit. Raises ``ValueError`` when the renderer writes no section."""
    tm = dialect.tool_markers
    if tm is None:
        raise ValueError(f"the {dialect.name} dialect has no tool-call markers")
    turn = {"role": "assistant", "content": _SENTINEL, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls)]}
    text = dialect.render_prompt([{"role": "user", "content": "x"}, turn], None, False)
    at = text.find(_SENTINEL)
    stop = text.rfind(tm.section_end)
    if at < 0 or stop < at or tm.section_begin not in text[at:stop]:
        raise ValueError(f"the {dialect.name} renderer wrote no tool section for an assistant tool call")
    return text[at + len(_SENTINEL) : stop + len(tm.section_end)]


def skipped_ids(tok: Tokenizer, dialect: Dialect) -> frozenset[int]:
    """Ids a ``skip_special_tokens=True`` decode drops: the folder's added tokens marked
    ``special`` (``tokenizer.json``), or, for a folder without that file (Kimi's tiktoken
    folder), every marker but the think and tool ones (``special: false`` in its config)."""
    flags = _special_flags(tok.source)
    if flags is not None:
        return frozenset(i for i in tok.marker_ids if flags.get(i, True))
    keep = {m for m in (dialect.think_open, dialect.think_close) if m}
    if dialect.tool_markers is not None:
        tm = dialect.tool_markers
        keep |= {m for m in (tm.section_begin, tm.section_end, tm.call_begin, tm.argument_begin, tm.call_end) if m}
    return frozenset(i for i, text in tok.marker_ids.items() if text not in keep)


@lru_cache(maxsize=8)
def _special_flags(source: str) -> dict[int, bool] | None:
    path = Path(source) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = loads_document(path.read_text(encoding="utf-8"))
        return {int(t["id"]): bool(t.get("special", True)) for t in data.get("added_tokens") or ()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # ValueError: JsonLineError too
        return None
