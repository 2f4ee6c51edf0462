"""A chat dialect: how a model family renders prompts and what its completions look like.

A dialect is data (marker strings) plus one render function. Assembling the completion
from an API message is the same for every family that writes ``reasoning`` between
think markers, so it lives here once; a family module only supplies its markers and its
prompt renderer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping, Sequence

from ..content import content_text
from ..jsonl import is_int

if TYPE_CHECKING:
    from .parts import ContentFormat

Message = Mapping[str, Any]
#: render(messages, tools, thinking, extra template kwargs) -> prompt text
RenderFn = Callable[[Sequence[Message], Sequence[Mapping[str, Any]] | None, bool, Mapping[str, Any]], str]

#: Completion part kinds, in the order they appear.
#: ``format`` is text the chat format writes that no API field carries (GLM's newline
#: before ``<think>``); it is encoded like any text.
PART_KINDS = ("format", "think_start", "reasoning", "think_end", "content", "tool_calls", "end")


@dataclass(frozen=True)
class ToolMarkers:
    """The marker strings of a raw tool-call section, and the order they come in.

    A well-formed section is ``section_begin unit* section_end`` with at least
    ``min_units`` repetitions of ``unit``. The default unit is Kimi's and DeepSeek's
    ``call_begin argument_begin call_end`` (a section of one or more calls); a family
    whose section is a single call (Qwen3's ``<tool_call>...</tool_call>``) has an
    empty unit, and GLM's unit is one argument (``<arg_key></arg_key><arg_value></arg_value>``).
    The grammar is data, so the gate checks every family with one function.
    """

    section_begin: str
    section_end: str
    call_begin: str | None = None
    argument_begin: str | None = None
    call_end: str | None = None
    #: The markers repeated inside a section, in order (None: call_begin argument_begin call_end).
    unit: tuple[str, ...] | None = None
    #: Fewest repetitions of ``unit`` a section holds.
    min_units: int = 1
    #: For sections delimited by text around one marker token (DeepSeek V3.2's
    #: ``<｜DSML｜function_calls>``): that token. ``section_begin`` / ``section_end`` are
    #: then texts, and every marker inside a section must be this token.
    token: str | None = None
    #: Markers a section may hold anywhere, outside the grammar (harmony's ``<|constrain|>``).
    optional: tuple[str, ...] = ()

    @cached_property
    def repeated(self) -> tuple[str, ...]:
        if self.unit is not None:
            return self.unit
        return tuple(m for m in (self.call_begin, self.argument_begin, self.call_end) if m)

    @cached_property
    def all(self) -> tuple[str, ...]:
        """The marker tokens that belong to tool sections (built once: the gate asks per sample)."""
        if self.token is not None:
            return (self.token,)
        return tuple(dict.fromkeys((self.section_begin, self.section_end, *self.repeated, *self.optional)))

    @property
    def grammar(self) -> str:
        """The grammar in words, for findings and docs."""
        if self.token is not None:
            return f"{self.section_begin} ... {self.section_end}, no marker but {self.token} inside"
        unit = " ".join(self.repeated)
        rep = "+" if self.min_units else "*"
        return f"{self.section_begin} ({unit}){rep} {self.section_end}" if unit else f"{self.section_begin} ... {self.section_end}"


@dataclass(frozen=True)
class PromptReading:
    """One prompt the serving side may have rendered: its text and what was assumed."""

    text: str
    #: What the text depends on beyond the request (``date=YYYY-MM-DD``), else None.
    name: str | None = None


@dataclass(frozen=True)
class Dialect:
    """Everything tokenbridge needs to know about one chat format."""

    name: str
    #: The built-in prompt renderer; None for a family that renders only with its
    #: folder's own chat template (:func:`resolve_dialect` refuses a folder without one).
    render: RenderFn | None
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
    #: Thinking mode when the request does not say (DeepSeek V3.x: off unless asked,
    #: as its template and SGLang's ``explicit_thinking`` default have it).
    thinking_default: bool = True
    #: The ``chat_template_kwargs`` switch(es) the family's template reads (DeepSeek:
    #: ``thinking``; Qwen3, GLM: ``enable_thinking``); SGLang sets both from
    #: ``reasoning_effort`` and each template ignores the other.
    thinking_keys: tuple[str, ...] = ("thinking", "enable_thinking")
    #: False for a family recognised only by its chat template: the end token and
    #: think markers are a guess, and the gate says so (``completion_unproven``).
    completion_proven: bool = True
    #: Whether the model opens the think block itself when the prompt does not
    #: (Qwen3). DeepSeek does not: after a tool result its prompt opens no block and
    #: the answer carries no think markers, whatever the engine labels it.
    think_self_open: bool = True
    #: Text the model writes before ``think_open`` when it opens the block itself (GLM:
    #: ``"\n"``, as its template's history shows). SGLang returns it inside the reasoning
    #: (``"\n<think>..."`` whole, ``"\n..."`` streamed); it is taken back out of there.
    think_open_prefix: str = ""
    #: The end token of a turn whose content ends with a tool-call section, when it
    #: differs from ``end_token`` (GLM: ``<|observation|>``).
    tool_end_token: str | None = None
    #: Whether the serving engine's JSON-string tool-call arguments reach the template
    #: as objects (SGLang parses them; DeepSeek V3.1's template concatenates strings, so
    #: it keeps them as given, which is what renders at all).
    parse_tool_arguments: bool = True
    #: Whether SGLang's changes to a request (tool dump, last assistant message) are
    #: prompt readings of their own (:mod:`.serving`): the families it serves with a
    #: template or DeepSeek's encoder.
    serving_readings: bool = False
    #: Whether the history's tool-call arguments as a serving engine parses and re-writes
    #: them (:func:`.serving.sglang_history`, with a user's ``name`` dropped) are a prompt reading of their own: a
    #: built-in renderer that writes string arguments as sent (Kimi's, as the official
    #: template does), which SGLang parses first.
    argument_readings: bool = False
    #: The serving stack renders prompts with its own code, not the folder's chat
    #: template (gpt-oss under vLLM: ``openai_harmony``); :func:`..resolve_dialect`
    #: then keeps the built-in renderer.
    own_renderer: bool = False
    #: Markers whose beginnings SGLang 0.5.23's streaming parser for this family holds back
    #: at the end of the content and never sends, its ``finish`` being the base class's
    #: (kimi_k2's tool detector: the section and call markers; qwen25's: ``</tool_call>``;
    #: gpt-oss's harmony parser: every structural token): see :mod:`..hypotheses`.
    stream_held_starts: tuple[str, ...] = ()
    #: The shortest beginning held (kimi_k2: ``<|``, two characters; qwen25, harmony: ``<``).
    stream_held_min: int = 2
    #: Whether the parser that holds is the tool detector, which runs only where the request
    #: sent tools (kimi_k2, qwen25), or the reasoning parser, which always runs (harmony).
    stream_held_needs_tools: bool = True
    #: Marker texts SGLang 0.5.23's streaming tool detector (``tools`` sent) deletes from the
    #: content it passes on (qwen25, glm4_moe: ``</tool_call>``; deepseekv31, kimi_k2: their
    #: two ends; kimi_k2 a section's begin too): where the content still shows a call's begin
    #: marker, the call did not parse and where its end stood is unknown
    #: (``tool_markers_dropped``); elsewhere a stray marker may have gone unseen, and joined
    #: words can make up its token (``tool_text_unproven``).
    stream_deletes: tuple[str, ...] = ()
    #: Text SGLang 0.5.23's reasoning parser for this family takes for a tool call's start
    #: where the tool markers do not begin with it (DeepSeek V3.x's ``deepseek-v3`` parser,
    #: Qwen3's subclass: ``<tool_call>``, plain text to DeepSeek's tokenizer): it ends a
    #: reasoning the model never closed there, and the rest is served as content.
    reasoning_tool_start: str | None = None
    #: Whether vLLM 0.34's reasoning parser for this family strips the whitespace at the end
    #: of the reasoning it serves in ``reasoning`` (its parser engine's
    #: ``strip_trailing_reasoning_whitespace``: GLM's ``glm45``; Qwen3's turns it off, and
    #: Kimi's joined text has readings of its own): what the model wrote there is unknown.
    reasoning_end_stripped: bool = False
    #: Whether vLLM's detokenizer joins this family's added tokens to their neighbours with a
    #: space (``spaces_between_special_tokens``: only a slow tokenizer's path does, Kimi's
    #: tiktoken class), the first text after the prompt included (``marker_spaces``).
    vllm_joins: bool = False
    #: How SGLang and vLLM (in that order) hand the folder's chat template a content that
    #: is a list of parts (:mod:`.parts`), detected from its source; None for a built-in
    #: renderer, which takes the parts as sent.
    content_formats: tuple[ContentFormat, ContentFormat] | None = None
    #: A built-in renderer's request as vLLM 0.34's own encoder for the family takes it, and
    #: the reading's name (``""``: as sent; None: vLLM refuses it): DeepSeek V3.2's (:mod:`.deepseek_v32`).
    vllm_request: Callable[[Mapping[str, Any]], tuple[Mapping[str, Any] | None, str]] | None = None

    @property
    def end_tokens(self) -> tuple[str, ...]:
        """Every token that ends a turn of this family's completion."""
        return (self.end_token,) if self.tool_end_token is None else (self.end_token, self.tool_end_token)

    def thinking(self, request: Mapping[str, Any]) -> bool:
        """Whether ``request`` runs in thinking mode for this family."""
        return thinking_enabled(request, default=self.thinking_default, keys=self.thinking_keys)

    def render_prompt(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text the serving side builds, generation prompt included."""
        return self._renderer()(messages, tools, thinking, template_kwargs)

    def _renderer(self) -> RenderFn:
        if self.render is None:
            from .template import TemplateError

            raise TemplateError(f"the {self.name} dialect renders only with its folder's chat template")
        return self.render

    def render_request(self, request: Mapping[str, Any]) -> str:
        """The prompt the serving side builds for an API request body: its messages (a list
        of parts as SGLang hands it to a folder's template) and tools, thinking mode from its
        settings, and its ``chat_template_kwargs``."""
        return self._render_parts_done({**request, "messages": self._sglang_served(request.get("messages"))[0]})

    def _render_parts_done(self, request: Mapping[str, Any]) -> str:
        """:meth:`render_request` for messages whose parts an engine has already handled."""
        from .shapes import template_kwargs

        kwargs = template_kwargs(request)
        kwargs.pop("thinking", None)
        kwargs.pop("enable_thinking", None)
        messages: Any = request.get("messages")  # in shape or not: the renderer checks (a TemplateError)
        return self._renderer()(messages, request.get("tools"), self.thinking(request), kwargs)

    def _sglang_served(self, messages: Any) -> tuple[Any, str | None]:
        """``messages`` as SGLang hands the folder's template their lists of parts, and the
        reading's name for that (:func:`.parts.sglang_reading`); as they are, and None,
        where no content is a list or the renderer is built in."""
        if self.content_formats is None:
            return messages, None
        from .parts import has_parts, sglang_reading

        return sglang_reading(messages, self.content_formats[0]) if has_parts(messages) else (messages, None)

    def prompt_readings(self, request: Mapping[str, Any], response: Mapping[str, Any] | None = None,
                        meta: Mapping[str, Any] | None = None) -> list[PromptReading]:
        """Every prompt the serving side may have built for ``request``: the request as
        sent, and, for a family served by SGLang too (``serving_readings``), as SGLang
        0.5.23 changes it (:mod:`.serving`) where that changes the text. A content sent as
        a list of parts reaches a folder's template as SGLang hands it over (the first
        reading: ``parts=space``, ``tool_parts=space`` or as sent) and as vLLM does
        (``parts=newline``, ``tool_parts=newline``, ``parts=vllm``; :mod:`.parts`), each with
        that engine's other changes. gpt-oss's also depends on the day."""
        from .template import TemplateError

        parts = self._served_parts(request)
        first: PromptReading | None = None
        refused: TemplateError | None = None
        if parts is None:
            try:
                first = PromptReading(self.render_request(request))
            except TemplateError as exc:  # as sent; an engine's own handling may still render it
                if not self.serving_readings:
                    raise
                refused = exc
        from .serving import vllm_tools

        # vLLM's tool dump where it changes the JSON; a tool its model refuses: no vLLM reading
        dumped, vllm_refuses = vllm_tools(request) if self.serving_readings or self.argument_readings else (None, False)
        if parts is None and first is not None and not (
                self.serving_readings or dumped is not None or (self.argument_readings and _history_differs(request))):
            return [first]
        render = _RenderedOnce(self.render_request if parts is None else self._render_parts_done)
        variants: list[tuple[Mapping[str, Any], str | None]]
        if parts is None:
            if first is not None:
                render.known(request, first.text)
            variants = self._variants_as_sent(request, render, dumped, vllm=not vllm_refuses)
        else:
            variants = self._variants_of_parts(parts, render, dumped, vllm=not vllm_refuses)
        out, seen = ([first], {first.text}) if first is not None else ([], set())
        for variant, name in variants:
            try:
                text = render(variant)
            except TemplateError as exc:
                refused = refused or exc
                continue  # a stack that cannot render it did not serve it
            if text not in seen:
                seen.add(text)
                out.append(PromptReading(text, name))
        if not out:  # no engine renders it (SGLang's refusal first)
            assert refused is not None
            raise refused
        return out

    def _variants_as_sent(self, request: Mapping[str, Any], render: _RenderedOnce,
                          dumped: list[dict[str, Any]] | None, *, vllm: bool,
                          ) -> list[tuple[Mapping[str, Any], str | None]]:
        """The engines' requests other than as sent (no content a list of parts), each named
        (vLLM's only where its request model takes the request: ``vllm``)."""
        from .serving import serving_variants, sglang_history, vllm_history, vllm_reasoning, with_change

        by_vllm: list[tuple[Mapping[str, Any], str]] = []
        if self.serving_readings and vllm:
            base, base_name = self.vllm_request(request) if self.vllm_request is not None else (request, "")
            form, change = _vllm_form(base, render) if base is not None else (None, "")
            if form is not None:
                form, change = _vllm_tools(dumped, form, with_change(change, base_name))
                by_vllm = [*([(form, change)] if change else []),
                           *((v, with_change(n, change)) for v, n in vllm_reasoning(form))]
        elif self.argument_readings and vllm and dumped is not None:
            by_vllm = [_vllm_tools(dumped, request, "")]
        return [*(serving_variants(request) if self.serving_readings else ()), *by_vllm,
                *(sglang_history(request) if self.argument_readings else ()),
                *(_vllm_tools(dumped, v, n) for v, n in (vllm_history(request) if self.argument_readings and vllm
                                                         else ()))]

    def _variants_of_parts(self, parts: tuple[tuple[Mapping[str, Any], str | None], tuple[Mapping[str, Any], str] | None],
                           render: _RenderedOnce, dumped: list[dict[str, Any]] | None, *, vllm: bool,
                           ) -> list[tuple[Mapping[str, Any], str | None]]:
        """Each engine's changes on its own handling of the parts (a folder's template); vLLM's
        only where its request model takes the request (``vllm``)."""
        from .serving import serving_variants, vllm_reasoning, with_change

        (sglang, s_name), by_vllm = parts
        more = self.serving_readings
        variants: list[tuple[Mapping[str, Any], str | None]] = [
            (sglang, s_name), *((v, with_change(n, s_name or "")) for v, n in (serving_variants(sglang) if more else ()))]
        served, v_name = (by_vllm if vllm else None) or (None, "")
        form, change = _vllm_form(served, render) if served is not None else (None, "")
        if form is not None:
            form, v_name = _vllm_tools(dumped, form, with_change(v_name, change))
            variants += [(form, v_name), *((v, with_change(n, v_name)) for v, n in (vllm_reasoning(form) if more else ()))]
        return variants

    def _served_parts(self, request: Mapping[str, Any]) -> tuple[tuple[Mapping[str, Any], str | None],
                                                                 tuple[Mapping[str, Any], str] | None] | None:
        """``request`` as SGLang and as vLLM hand the folder's template its list contents,
        each with its reading's name (:func:`.parts.sglang_reading`, :func:`.parts.vllm_reading`;
        vLLM's None where it cannot join a part's text: it served no prompt); None where neither
        changes the messages (no content is a list, no system message opens with what vLLM
        drops) or the renderer is built in."""
        messages = request.get("messages")
        if self.content_formats is None or not isinstance(messages, list):
            return None
        from .parts import has_parts, vllm_differs, vllm_reading

        if not (has_parts(messages) or vllm_differs(messages)):
            return None
        from .template import TemplateError

        sglang, s_name = self._sglang_served(messages)
        try:
            vllm, v_name = vllm_reading(messages, self.content_formats[1])
        except TemplateError:  # a text vLLM cannot join (not a string): no vLLM reading
            return ({**request, "messages": sglang}, s_name), None
        return ({**request, "messages": sglang}, s_name), ({**request, "messages": vllm}, v_name)

    def with_render(self, render: RenderFn, name: str | None = None,
                    content_formats: tuple[ContentFormat, ContentFormat] | None = None) -> Dialect:
        """The family with another prompt renderer (a real template: it takes every
        template kwarg and declares tools itself), behind the messages check every
        renderer a dialect holds runs (the built-in ones are :func:`~.shapes.checked`)."""
        from .shapes import checked_messages

        def render_checked(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None, thinking: bool,
                           kwargs: Mapping[str, Any]) -> str:
            return render(checked_messages(messages), tools, thinking, kwargs)

        return replace(self, render=render_checked, name=name or self.name, template_kwargs=None,
                       tools_unproven=lambda tools: None, content_formats=content_formats)

    def completion_parts(
        self,
        message: Message,
        finish_reason: str | None,
        thinking: bool,
        prompt_opens_think: bool = True,
    ) -> list[tuple[str, str]]:
        """The completion as ``(kind, text)`` parts, in the order the model wrote them.

        Thinking mode: ``reasoning + think_close + content + end_token``. A family that
        does not open the think block itself (``think_self_open`` false) and a prompt
        that opened none: the model wrote no block, and an engine forced into reasoning
        returns its whole answer as reasoning, so there is no ``think_close`` unless
        content follows (the engine split at a ``think_close`` the model wrote). The end token
        is ``end_token``, or ``tool_end_token`` after a tool-call section. A length cut
        appends none, and a cut inside the reasoning (no content yet) has no
        ``think_close``. When the prompt does not already end with ``think_open`` the
        model writes it first. Raw tool-call sections inside ``content`` stay exactly as
        they are, as their own ``tool_calls`` parts. A leaked end marker at the very end
        of ``content`` is taken as the end token itself, never doubled.
        """
        reasoning = message_reasoning(message) or ""
        content = content_text(message.get("content"))
        cut = finish_reason == "length"
        parts: list[tuple[str, str]] = []
        if thinking and self.think_close:
            if self.think_open and not prompt_opens_think and self.think_self_open:
                if self.think_open_prefix:
                    parts.append(("format", self.think_open_prefix))
                    for lead in (self.think_open_prefix + self.think_open, self.think_open_prefix):
                        if reasoning.startswith(lead):
                            reasoning = reasoning[len(lead):]
                            break
                parts.append(("think_start", self.think_open))
            if reasoning:
                parts.append(("reasoning", reasoning))
            if cut and not content:
                return parts
            if prompt_opens_think or self.think_self_open or content:
                parts.append(("think_end", self.think_close))
        elif reasoning:
            # Instant mode should carry no reasoning; keep its text so the gate sees it.
            parts.append(("reasoning", reasoning))
        ended = None
        for end in self.end_tokens:
            if content.endswith(end):
                content, ended = content[: -len(end)], end
                break
        parts.extend(self._split_tool_sections(content))
        if ended or not cut:
            if ended is None:
                after_call = bool(parts) and parts[-1][0] == "tool_calls"
                ended = self.tool_end_token if after_call and self.tool_end_token is not None else self.end_token
            parts.append(("end", ended))
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
            if tm.token is not None:  # cut at the marker token, where the encoder cuts too
                start += tm.section_begin.index(tm.token)
            if start > pos:
                parts.append(("content", content[pos:start]))
            stop = content.find(tm.section_end, start)
            stop = n if stop < 0 else stop + len(tm.section_end)
            parts.append(("tool_calls", content[start:stop]))
            pos = stop
        return parts


class _RenderedOnce:
    """A render function that renders each request object once in one
    :meth:`Dialect.prompt_readings` call: the vLLM form (:func:`_vllm_form`) is rendered to
    compare with the request's own text, then read again as a reading. Each object is kept
    with its text (a freed one's id could name another)."""

    def __init__(self, render: Callable[[Mapping[str, Any]], str]) -> None:
        self._render = render
        self._texts: dict[int, tuple[Mapping[str, Any], str]] = {}

    def known(self, request: Mapping[str, Any], text: str) -> None:
        self._texts[id(request)] = (request, text)

    def __call__(self, request: Mapping[str, Any]) -> str:
        kept = self._texts.get(id(request))
        if kept is None:
            kept = self._texts[id(request)] = (request, self._render(request))
        return kept[1]


def _vllm_form(request: Mapping[str, Any],
               render: Callable[[Mapping[str, Any]], str]) -> tuple[Mapping[str, Any] | None, str]:
    """``request`` as vLLM 0.34 hands it to the template ``render`` holds, after its
    tool-call post-processing (:func:`.serving.vllm_postprocessed`), and the change's name:
    ``(request, "")`` where that changes nothing the template prints; the post-processed
    request and ``tool_calls=vllm`` where it does
    (``{}`` for arguments ``"[]"``, an empty ``tool_calls`` gone); ``(None, "")`` where the
    template cannot render it (DeepSeek V3.1's adds arguments to text): vLLM answers an
    error and served no prompt. Its readings of such a request had been offered, and where
    their count tied SGLang's every sample SGLang served was ``prompt_reading_unproven``."""
    from .serving import vllm_postprocessed
    from .template import TemplateError

    post = vllm_postprocessed(request)
    if post is None:
        return request, ""
    try:
        served = render(post)
    except TemplateError:
        return None, ""
    try:
        same = served == render(request)
    except TemplateError:  # as sent it does not render; as vLLM hands it over it does
        same = False
    return (request, "") if same else (post, "tool_calls=vllm")


def _vllm_tools(dumped: list[dict[str, Any]] | None, variant: Mapping[str, Any], name: str,
                ) -> tuple[Mapping[str, Any], str]:
    """A vLLM reading with the tools as vLLM dumps them (``tools=vllm``), where that changes
    their JSON (``dumped``: :func:`.serving.vllm_tools`)."""
    from .serving import with_change

    return (variant, name) if dumped is None else ({**variant, "tools": dumped}, with_change(name, "tools=vllm"))


def _history_differs(request: Mapping[str, Any]) -> bool:
    """Whether any message of ``request`` carries tool calls, is a user's with a ``name``,
    holds a list of two or more content parts or is an assistant's with a ``reasoning``, is
    a system message opening with Claude Code's attribution line, or the last is an
    assistant's: what SGLang or vLLM hands the template otherwise
    (:func:`.serving.sglang_history`, :func:`.serving.vllm_history`; the one-turn case of
    plain text has none)."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        return False
    if messages and isinstance(messages[-1], Mapping) and messages[-1].get("role") == "assistant":
        return True  # SGLang makes it a user's
    from .parts import vllm_differs

    if vllm_differs(messages):
        return True  # vLLM drops a system message's Claude Code attribution line
    return any(
        isinstance(m, Mapping) and (m.get("tool_calls") or (m.get("role") == "user" and m.get("name") is not None)
                                    or (isinstance(m.get("content"), list) and len(m["content"]) > 1)
                                    or (m.get("role") == "assistant" and isinstance(m.get("reasoning"), str)))
        for m in messages)


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
        value = message.get(key)
        if isinstance(value, str):
            return value
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
            order = index if is_int(index) else pos
            texts.append((order, pos, entry["text"]))
        elif kind in REDACTED_DETAIL_TYPES:
            other.append(str(kind))
    if not texts:
        return None, other
    return "".join(t for _, _, t in sorted(texts)), other


def thinking_enabled(request: Mapping[str, Any], default: bool = True,
                     keys: Sequence[str] = ("thinking", "enable_thinking")) -> bool:
    """Whether a request runs in thinking mode (``default`` when it does not say), for a
    template that reads the switch ``keys``.

    In order: OpenRouter's ``reasoning: {"enabled": false}`` or ``reasoning.effort:
    "none"`` is instant mode (its documented meaning); then the template's own switch in
    ``chat_template_kwargs`` (top level or in ``extra_body``; an explicit off wins over an
    explicit on); then a top-level ``reasoning_effort``, which SGLang 0.5.23
    (``normalize_reasoning_inputs``) turns into that switch, off only for ``"none"``; then
    any other non-empty ``reasoning`` object is thinking mode. A switch the template does
    not read (``enable_thinking`` for DeepSeek's ``thinking``) changes nothing.
    """
    if not any(k in request for k in ("reasoning", "chat_template_kwargs", "extra_body", "reasoning_effort")):
        return default  # the common request says nothing: no need to look further
    reasoning = request.get("reasoning")
    if isinstance(reasoning, Mapping) and (reasoning.get("enabled") is False or reasoning.get("effort") == "none"):
        return False
    holders = [request, request.get("extra_body") or {}]
    switches = [kwargs.get(key) for holder in holders if isinstance(holder, Mapping)
                for kwargs in [holder.get("chat_template_kwargs")] if isinstance(kwargs, Mapping) for key in keys]
    if False in switches:
        return False
    if True in switches:
        return True
    for holder in holders:
        effort = holder.get("reasoning_effort") if isinstance(holder, Mapping) else None
        if isinstance(effort, str | int | float) and not isinstance(effort, bool):
            return effort != "none"
    return bool(reasoning) or default
