"""A chat dialect: how a model family renders prompts and what its completions look like.

A dialect is data (marker strings) plus one render function. Assembling the completion
from an API message is the same for every family that writes ``reasoning`` between
think markers, so it lives here once; a family module only supplies its markers and its
prompt renderer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

Message = Mapping[str, Any]
#: render(messages, tools, thinking, extra template kwargs) -> prompt text
RenderFn = Callable[[Sequence[Message], Sequence[Mapping[str, Any]] | None, bool, Mapping[str, Any]], str]

#: Completion part kinds, in the order they appear.
PART_KINDS = ("think_start", "reasoning", "think_end", "content", "tool_calls", "end")


@dataclass(frozen=True)
class ToolMarkers:
    """The five marker strings of a raw tool-call section."""

    section_begin: str
    section_end: str
    call_begin: str
    argument_begin: str
    call_end: str

    @property
    def all(self) -> tuple[str, ...]:
        return (self.section_begin, self.section_end, self.call_begin, self.argument_begin, self.call_end)


@dataclass(frozen=True)
class Dialect:
    """Everything tokenbridge needs to know about one chat format."""

    name: str
    render: RenderFn
    end_token: str
    think_open: str | None = None
    think_close: str | None = None
    #: Marker texts that end a turn; any of them inside model text is ``eos_in_text``.
    eos_markers: frozenset[str] = frozenset()
    tool_markers: ToolMarkers | None = None
    #: ``chat_template_kwargs`` keys the built-in renderer understands; None when a
    #: real chat template receives them all.
    template_kwargs: frozenset[str] | None = None
    #: tools -> why their declaration is not proven (None: proven). Absent: unproven.
    tools_unproven: Callable[[Sequence[Any]], str | None] | None = None

    def render_prompt(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text the serving side builds, generation prompt included."""
        return self.render(messages, tools, thinking, template_kwargs)

    def render_request(self, request: Mapping[str, Any]) -> str:
        """The prompt the serving side builds for an API request body: its messages and
        tools, thinking mode from its settings, and its ``chat_template_kwargs``."""
        kwargs = dict(request.get("chat_template_kwargs") or {})
        kwargs.pop("thinking", None)
        kwargs.pop("enable_thinking", None)
        return self.render(request["messages"], request.get("tools"), thinking_enabled(request), kwargs)

    def with_render(self, render: RenderFn, name: str | None = None) -> "Dialect":
        """The family with another prompt renderer (a real template: it takes every
        template kwarg and declares tools itself)."""
        return replace(self, render=render, name=name or self.name, template_kwargs=None,
                       tools_unproven=lambda tools: None)

    def completion_parts(
        self,
        message: Message,
        finish_reason: str | None,
        thinking: bool,
        prompt_opens_think: bool = True,
    ) -> list[tuple[str, str]]:
        """The completion as ``(kind, text)`` parts, in the order the model wrote them.

        Thinking mode: ``reasoning + think_close + content + end_token``. A length cut
        appends no end token, and a cut inside the reasoning (no content yet) has no
        ``think_close``. When the prompt does not already end with ``think_open`` the
        model writes it first. Raw tool-call sections inside ``content`` stay exactly as
        they are, as their own ``tool_calls`` parts. A leaked end marker at the very end
        of ``content`` is taken as the end token itself, never doubled.
        """
        reasoning = message_reasoning(message) or ""
        content = message.get("content") or ""
        if not isinstance(content, str):
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        cut = finish_reason == "length"
        parts: list[tuple[str, str]] = []
        if thinking and self.think_close:
            if self.think_open and not prompt_opens_think:
                parts.append(("think_start", self.think_open))
            if reasoning:
                parts.append(("reasoning", reasoning))
            if cut and not content:
                return parts
            parts.append(("think_end", self.think_close))
        elif reasoning:
            # Instant mode should carry no reasoning; keep its text so the gate sees it.
            parts.append(("reasoning", reasoning))
        ended = False
        if content.endswith(self.end_token):
            content, ended = content[: -len(self.end_token)], True
        parts.extend(self._split_tool_sections(content))
        if ended or not cut:
            parts.append(("end", self.end_token))
        return parts

    def _split_tool_sections(self, content: str) -> list[tuple[str, str]]:
        tm = self.tool_markers
        if not content:
            return []
        if tm is None or tm.section_begin not in content:
            return [("content", content)]
        parts: list[tuple[str, str]] = []
        pos, n = 0, len(content)
        while pos < n:
            start = content.find(tm.section_begin, pos)
            if start < 0:
                parts.append(("content", content[pos:]))
                break
            if start > pos:
                parts.append(("content", content[pos:start]))
            stop = content.find(tm.section_end, start)
            stop = n if stop < 0 else stop + len(tm.section_end)
            parts.append(("tool_calls", content[start:stop]))
            pos = stop
        return parts


def message_reasoning(message: Message) -> str | None:
    """The reasoning text of an API message (OpenRouter ``reasoning``, vLLM/DeepSeek
    ``reasoning_content``), or, when neither holds any, the ``reasoning.text`` entries of
    OpenRouter's ``reasoning_details`` joined in ``index`` order."""
    for key in ("reasoning", "reasoning_content"):
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    text, _ = reasoning_details(message)
    if text:
        return text
    for key in ("reasoning", "reasoning_content"):
        if isinstance(message.get(key), str):
            return message[key]
    return None


#: ``reasoning_details`` entry types that carry something other than the model's own text.
REDACTED_DETAIL_TYPES = ("reasoning.summary", "reasoning.encrypted")


def reasoning_details(message: Message) -> tuple[str | None, list[str]]:
    """(``reasoning.text`` entries joined in ``index`` order or None, the types of the
    entries that are not the model's text: summaries and encrypted blobs)."""
    details = message.get("reasoning_details")
    if not isinstance(details, list) or not details:
        return None, []
    texts: list[tuple[int, int, str]] = []
    other: list[str] = []
    for pos, entry in enumerate(details):
        if not isinstance(entry, Mapping):
            continue
        kind = entry.get("type")
        if kind == "reasoning.text" and isinstance(entry.get("text"), str):
            index = entry.get("index")
            order = index if isinstance(index, int) and not isinstance(index, bool) else pos
            texts.append((order, pos, entry["text"]))
        elif kind in REDACTED_DETAIL_TYPES:
            other.append(str(kind))
    if not texts:
        return None, other
    return "".join(t for _, _, t in sorted(texts)), other


def thinking_enabled(request: Mapping[str, Any]) -> bool:
    """Whether a request asked for thinking mode (the default for thinking models).

    Instant mode: ``reasoning: {"enabled": false}`` or ``reasoning.effort: "none"``, or
    ``chat_template_kwargs.thinking`` / ``enable_thinking`` false (top level or in
    ``extra_body``).
    """
    reasoning = request.get("reasoning")
    if isinstance(reasoning, Mapping):
        if reasoning.get("enabled") is False or reasoning.get("effort") == "none":
            return False
    for holder in (request, request.get("extra_body") or {}):
        kwargs = holder.get("chat_template_kwargs") if isinstance(holder, Mapping) else None
        if isinstance(kwargs, Mapping):
            for key in ("thinking", "enable_thinking"):
                if kwargs.get(key) is False:
                    return False
    return True
