"""gpt-oss (OpenAI's harmony format): channels instead of think markers.

A completion starts right after the prompt's ``<|start|>assistant`` and is a run of
messages, each ``<|channel|>NAME<|message|>TEXT`` ended by ``<|end|>``, the next one
opening with ``<|start|>assistant`` again. The turn ends with the final answer's
``<|return|>`` or a tool call's ``<|call|>`` (both stop tokens, as is ``<|endoftext|>``):

* ``<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>final<|message|>C<|return|>``;
  the analysis channel is the API's ``reasoning``, the final channel its ``content``;
* a tool call: ``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``.

What SGLang 0.5.23 serves (``ReasoningParser("gpt-oss")`` over text that keeps the
special tokens, ``skip_special_tokens`` forced off for gpt-oss; the matched stop id
trimmed): the analysis text as reasoning, the final text as content; several analysis
messages joined; a commentary preamble (``commentary`` without a recipient) merged into
content; and a tool call, whose ``<|call|>`` was trimmed, dropped whole (its harmony parser
waits for an end token that never comes). A served raw tool call (the stop kept) stays
in content from its ``<|start|>`` and is rebuilt as it is. Streamed with ``tools`` sent,
its gpt-oss tool detector changes the final text once a channel word shows in it (the start
sent twice, what may begin a channel word held back at the end, text after a header in
text dropped or stripped): :func:`resent_prefixes`, :func:`tool_stream_doubt`.

The prompt: the folder's HF template, which SGLang renders (default), prints the serving
day (``strftime_now``) into the system turn; :meth:`HarmonyDialect.prompt_readings`
renders one prompt per UTC day the exchange's timing admits. vLLM and ``renderers``
render with ``openai_harmony`` instead (different developer-turn spacing);
:data:`GPT_OSS_HARMONY` (``--dialect gpt-oss-harmony``) renders as that stack does
(:mod:`.harmony_render`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, UTC
from typing import Any

from ..content import content_text
from . import harmony_render
from .dialect import Dialect, Message, PromptReading, RenderFn, ToolMarkers, message_reasoning
from .shapes import template_kwargs

__all__ = ["GPT_OSS", "GPT_OSS_HARMONY", "HarmonyDialect", "TEXT_WORDS", "resent_prefixes", "serving_days",
           "tool_stream_doubt"]

START = "<|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|channel|>final<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"

#: A message header, token by token as the model writes it after an analysis message:
#: what a length cut inside it leaves behind (the served text then shows nothing of it).
HEADER_TOKENS = (END, "<|start|>", "assistant", "<|channel|>")
#: The channel names a cut after ``<|channel|>`` may have reached.
CHANNELS = ("final", "commentary", "analysis")
#: How far into a channel name of more than one o200k token a cut may fall (``comment``+``ary``).
CHANNEL_STARTS = ("comment",)
#: What a recipient-first header writes after ``<|start|>assistant`` before the tool's
#: own name (one token each on o200k): `` to``, ``=``, then the namespace.
RECIPIENT_LEADS = (" to", " to=", *(f" to={ns}" for ns in ("functions", "browser", "python", "container")))

#: The structural tokens of a raw tool call's header: ``<|channel|>`` opens it,
#: ``<|message|>`` ends it, ``<|constrain|>`` may come between.
TOOL_MARKERS = ToolMarkers(section_begin="<|channel|>", section_end="<|message|>", unit=(), min_units=0,
                           optional=("<|constrain|>",))

#: The longest a serving engine takes from rendering the prompt to stamping ``created``
#: when the exchange carries no client-side timing (an assumption, documented).
MAX_RENDER_TO_CREATED_S = 3600
#: Clock difference allowed between the server and the client that timed the request.
CLOCK_SKEW_S = 300


def serving_days(response: Mapping[str, Any], meta: Mapping[str, Any]) -> list[str] | None:
    """The UTC days (``YYYY-MM-DD``) on which the prompt may have been rendered, oldest
    first; None when the exchange says nothing about when it ran.

    The client's own timing (``meta.started_at`` + ``meta.latency_s``, with clock skew)
    brackets the render; without it, the response's ``created`` (the server's clock,
    stamped after rendering) does, up to :data:`MAX_RENDER_TO_CREATED_S` earlier. The
    server clock is taken as UTC: a server in another time zone prints another day
    near midnight, which nothing in the response shows.

    A time that is not a finite non-negative number of seconds (``true``, a string, NaN,
    ``-5``, a millennium away) is no timing: a negative ``latency_s`` made the client's
    bracket end before it began, an empty day list a caller indexed. A client timing with
    a bad ``latency_s`` is no client timing, so ``created`` is read instead.
    """
    start = _number(meta.get("started_at"))
    latency = _number(meta.get("latency_s"))
    created = _number(response.get("created"))
    if start is not None and (latency is not None or meta.get("latency_s") is None):
        lo, hi = start - CLOCK_SKEW_S, start + (latency or 0.0) + CLOCK_SKEW_S
    elif created is not None:
        lo, hi = created - MAX_RENDER_TO_CREATED_S, created + CLOCK_SKEW_S
    else:
        return None
    try:
        first = datetime.fromtimestamp(lo, tz=UTC).date()
        last = datetime.fromtimestamp(hi, tz=UTC).date()
    except (OverflowError, OSError, ValueError):
        return None
    days: list[str] = []
    day = first
    while day <= last and len(days) < 3:
        days.append(day.isoformat())
        day += timedelta(days=1)
    return days


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0 <= value < 1e11 else None  # NaN (compares false), negative and absurd times are no timing


def _request_effort(request: Mapping[str, Any]) -> str | None:
    """The request's reasoning effort: OpenRouter's ``reasoning.effort`` (else
    ``reasoning.reasoning_effort``) over a top-level ``reasoning_effort``, as SGLang 0.5.23's
    ``normalize_reasoning_inputs`` takes it (OpenRouter hands an upstream the same)."""
    effort = request.get("reasoning_effort")
    reasoning = request.get("reasoning")
    if isinstance(reasoning, Mapping):
        inner = reasoning.get("effort")
        if inner is None:
            inner = reasoning.get("reasoning_effort")
        if inner is not None:
            effort = inner
    return effort if isinstance(effort, str) else None


def _day_clock(day: str) -> Callable[[str], str]:
    """``strftime_now`` for a template, fixed at noon UTC of ``day``."""
    when = datetime.fromisoformat(day).replace(hour=12, tzinfo=UTC)

    def strftime_now(fmt: str) -> str:
        return when.strftime(fmt)

    return strftime_now


#: SGLang 0.5.23's gpt-oss tool detector (streamed, ``tools`` sent) runs the final text
#: through a harmony parser of its own, which keeps all it is given until it can tell the
#: format: a structural token, or one of these words at the start or after a space (its
#: text strategy; case ignored). Until then the detector passes each delta on as it is.
_CHANNEL_WORD = re.compile(r"(?:^|\s)(?:assistant)?\s*(?:analysis|commentary|assistantfinal)", re.IGNORECASE)
#: The text strategy's own start-anchored shapes (a channel header in text): not read.
_LEADING_WORD = re.compile(r"\s*(?:assistant)?\s*(?:analysis|commentary|assistantfinal)", re.IGNORECASE)
#: A final text that starts with the stem of a channel word (``commentan`` was served for
#: ``commentaryana``): its leading-header path may have cut the word itself. The stems are
#: the shortest such starts cold testers saw; "Community" and "Analytics" pass as written.
_LEADING_STEM = re.compile(r"\s*(?:assistant)?\s*(?:analys|comment|assistantf)", re.IGNORECASE)
#: What the text strategy holds back the beginnings of at the end of its buffer (as written).
TEXT_WORDS = ("analysis", "commentary", "assistantfinal")
#: The most characters the token that completes the channel word may span before its end.
_WORD_TOKEN_REACH = 32


def resent_prefixes(content: str) -> list[int]:
    """Each ``j`` for which a served ``content`` may be SGLang's stream of ``content[j:]``
    (streamed, ``tools`` sent) with its first ``j`` characters sent twice.

    The detector passed the text through delta by delta while its own parser kept the
    same text. The delta that completed a channel word (``" Analysis"``) switched that
    parser to its text strategy, which then sent its whole buffer: the ``j`` characters
    before that delta come again (``"# Analysis"`` is served ``"## Analysis"``, the same
    count). Found from the text alone (the served text starts with a copy of its next
    ``j`` characters, the rest has the word after them): readings for ids or logprobs to
    pick from, never the count (:func:`tool_stream_doubt`).
    """
    if "<|" in content or "assistantfin" in content.lower():
        return []
    # the first channel words only: the one that switched the parser is the model's first,
    # and the resent start before it holds at most a part of it
    ends = [m.end() for m, _ in zip(_CHANNEL_WORD.finditer(content), range(3))]
    out: set[int] = set()
    for e in ends:
        # the word ends at e - j in the model's text, inside a token that starts at j
        for j in range(max(1, (e - _WORD_TOKEN_REACH + 1) // 2), (e + 1) // 2):
            if content.startswith(content[:j], j) and not _LEADING_WORD.match(content, j):
                out.add(j)
    return sorted(out)


def tool_stream_doubt(content: str) -> str | None:
    """Why a served final text SGLang's gpt-oss tool detector may have streamed (``tools``
    sent) cannot be read from the count, or None where it was sent as written.

    Its parser never switches where the model wrote no channel word, and then the detector
    sends each delta as it is. Once one shows, the text may come back with its start sent
    twice, an end held back, text dropped after a later header word or whitespace stripped
    after a leading one, in combinations that keep the model's count (cold testers found
    seven). So a served text that holds a channel word after a space, or starts with the
    stem of one (the leading-header path can cut the word itself), is proven only by ids or
    logprobs."""
    if _CHANNEL_WORD.search(content) is None and _LEADING_STEM.match(content) is None:
        return None
    return ("the final text holds a channel word (or starts with the stem of one); after one, SGLang's gpt-oss tool "
            "detector sends the text before it twice, holds back or drops text and strips whitespace, in ways that "
            "can keep the model's count")


def _text(message: Message) -> tuple[str, str | None]:
    return content_text(message.get("content")), message_reasoning(message)


@dataclass(frozen=True)
class HarmonyDialect(Dialect):
    """A dialect whose completion is a run of harmony messages (see the module doc)."""

    #: The template prints the serving day: prompts are rendered once per possible day.
    dated_prompt: bool = True
    #: Streamed with ``tools`` sent, SGLang's tool detector may send the start of the final
    #: text twice (:func:`resent_prefixes`): readings of their own.
    tool_stream_resends: bool = False
    #: Another engine's rendering of the same request (vLLM's own harmony conversion, which
    #: differs from ``renderers``' where a system message is not first, and in a history's
    #: tool calls): a reading of its own, ``harmony=vllm``, where it differs.
    vllm_render: RenderFn | None = None

    def thinking(self, request: Mapping[str, Any]) -> bool:
        """Always: gpt-oss writes its analysis channel whatever the request says (SGLang
        forces reasoning for ``gpt-oss`` and refuses ``reasoning_effort: none``)."""
        return True

    def render_request(self, request: Mapping[str, Any]) -> str:
        return self.prompt_readings(request)[0].text

    def template_kwargs_of(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The kwargs SGLang passes the template: ``reasoning_effort``, which OpenRouter's
        ``reasoning.effort`` (else ``reasoning.reasoning_effort``) overrides where given, as
        SGLang 0.5.23's ``normalize_reasoning_inputs`` does; then the request's
        ``chat_template_kwargs``."""
        kwargs: dict[str, Any] = {}
        effort = _request_effort(request)
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        kwargs.update(template_kwargs(request))
        return kwargs

    def prompt_readings(self, request: Mapping[str, Any], response: Mapping[str, Any] | None = None,
                        meta: Mapping[str, Any] | None = None) -> list[PromptReading]:
        """Every prompt the serving side may have built: one per serving day when the
        renderer prints the date; the first is today's when the exchange has no timing.
        With the folder's template (SGLang's path), a content sent as a list of parts is
        handed over as SGLang does (:func:`.parts.sglang_reading`: ``parts=space``)."""
        render = self._renderer()
        kwargs = self.template_kwargs_of(request)
        messages: Any = request.get("messages")  # in shape or not: the renderer checks (a TemplateError)
        tools = request.get("tools")
        messages, parts = self._sglang_served(messages)
        if not self.dated_prompt:
            return [PromptReading(render(messages, tools, True, kwargs), parts)]
        days = serving_days(response or {}, meta or {}) if response is not None else None
        if days is None:
            days = [datetime.now(UTC).date().isoformat()]
            names: list[str] = ["date=unknown"]
        else:
            names = [f"date={d}" for d in days]
        out = []
        for day, name in zip(days, names):
            text = render(messages, tools, True, {**kwargs, "strftime_now": _day_clock(day)})
            out.append(PromptReading(text, "+".join(sorted([name, parts])) if parts else name))
        if self.vllm_render is not None:
            out += self._vllm_readings(request, kwargs, [(day, PromptReading(r.text, name))
                                                         for day, name, r in zip(days, names, out)])
        return out

    def _vllm_readings(self, request: Mapping[str, Any], kwargs: Mapping[str, Any],
                       dated: list[tuple[str, PromptReading]]) -> list[PromptReading]:
        """vLLM's prompt for each serving day, where it differs from the reading of that day;
        none where vLLM would have refused the request (it was not served there)."""
        from .template import TemplateError

        messages: Any = request.get("messages")
        tools = request.get("tools")
        assert self.vllm_render is not None
        # vLLM's harmony path reads the request's own effort, never chat_template_kwargs'
        kwargs = {**kwargs, "reasoning_effort": _request_effort(request) or "medium"}
        out = []
        for day, reading in dated:
            try:
                text = self.vllm_render(messages, tools, True, {**kwargs, "strftime_now": _day_clock(day)})
            except TemplateError:
                return []
            if text != reading.text:
                out.append(PromptReading(text, f"{reading.name}+harmony=vllm"))
        return out

    def completion_parts(
        self,
        message: Message,
        finish_reason: str | None,
        thinking: bool,
        prompt_opens_think: bool = True,
    ) -> list[tuple[str, str]]:
        """The harmony messages of a served answer, as ``(kind, text)`` parts.

        ``reasoning`` (when present) is one analysis message; ``content`` is the final
        message, or, when it holds a raw tool call (from ``<|start|>assistant``, or from
        ``<|channel|>`` with no analysis before it), that call ended by ``<|call|>``. A
        length cut appends no end token, and a cut inside the analysis (no content) no
        ``<|end|>``: the other places a cut may fall are readings (:mod:`..hypotheses`).
        A leaked ``<|return|>`` / ``<|call|>`` at the end of content is the end token. A cut
        content that is a message header (:func:`_cut_header`: vLLM's harmony parser, cut
        inside one, serves its raw text) is that header's tokens.
        """
        content, reasoning = _text(message)
        cut = finish_reason == "length"
        parts: list[tuple[str, str]] = []
        first = True
        if reasoning:
            parts += [("format", ANALYSIS), ("reasoning", reasoning)]
            if cut and not content:
                return parts
            parts.append(("think_end", END))
            first = False
        if cut and _cut_header(content, first):
            return [*parts, ("format", content)]
        ended = next((e for e in self.end_tokens if content.endswith(e)), None)
        if ended:
            content = content[: -len(ended)]
        call = _raw_call(content, first)
        if call is not None:
            lead, body = call
            if lead:
                parts.append(("format", lead))
            parts.append(("tool_calls", body))
            if ended or not cut:
                parts.append(("end", ended or CALL))
            return parts
        parts.append(("format", FINAL if first else START + FINAL))
        if content:
            parts.append(("content", content))
        if ended or not cut:
            parts.append(("end", ended or RETURN))
        return parts

    def cut_readings(self, message: Message, finish_reason: str | None) -> list[tuple[list[tuple[str, str]], str]]:
        """A length cut with reasoning and no content: the served text is the same
        wherever in the next message's header the cut fell (SGLang holds back an
        unfinished header). One reading per place, named ``cut_header=K`` (K header
        tokens written), ``cut_header=K:CHANNEL`` (``comment``: a cut inside ``commentary``),
        ``cut_header=CHANNEL:LEAD`` (in a channel-first call's recipient, up to its namespace)
        or ``cut_header=recipient:LEAD``. A cut further into a tool's name is not read (the
        count rejects it)."""
        content, reasoning = _text(message)
        if finish_reason != "length" or content or not reasoning:
            return []
        base: list[tuple[str, str]] = [("format", ANALYSIS), ("reasoning", reasoning)]
        out = []
        for k in range(1, len(HEADER_TOKENS) + 1):
            out.append(([*base, ("format", "".join(HEADER_TOKENS[:k]))], f"cut_header={k}"))
        head = "".join(HEADER_TOKENS)
        for channel in CHANNEL_STARTS:
            out.append(([*base, ("format", head + channel)], f"cut_header=5:{channel}"))
        for channel in CHANNELS:
            out.append(([*base, ("format", head + channel)], f"cut_header=5:{channel}"))
            out.append(([*base, ("format", head + channel + "<|message|>")], f"cut_header=6:{channel}"))
            # a channel-first call's recipient (<|channel|>commentary to=functions.X ...), cut in its lead
            for lead in RECIPIENT_LEADS:
                out.append(([*base, ("format", head + channel + lead)], f"cut_header={channel}:{lead.strip()}"))
        # a recipient-first header (<|start|>assistant to=functions.X<|channel|>...): its
        # first tokens are fixed, and tie with the channel-first ones in count
        start = "".join(HEADER_TOKENS[:3])
        for lead in RECIPIENT_LEADS:
            out.append(([*base, ("format", start + lead)], f"cut_header=recipient:{lead.strip()}"))
        return out

    def end_in_analysis_reading(self, message: Message, finish_reason: str | None) -> list[tuple[str, str]] | None:
        """Reasoning and no content, the turn ended: the model may have ended its analysis
        message with the end token itself (``<|channel|>analysis<|message|>R<|return|>``),
        which the parser serves as the formula's empty final message; five ids fewer, so
        the count tells them apart. None where the message does not fit."""
        content, reasoning = _text(message)
        if finish_reason == "length" or content or not reasoning or message.get("tool_calls"):
            return None
        return [("format", ANALYSIS), ("reasoning", reasoning), ("end", RETURN)]

    def empty_analysis_reading(self, message: Message, finish_reason: str | None) -> list[tuple[str, str]] | None:
        """No reasoning served: the model may have written no analysis message, or an
        empty one (``<|channel|>analysis<|message|><|end|>``), which the parser shows the
        same. The second reading's parts; None when reasoning is present."""
        content, reasoning = _text(message)
        if reasoning:
            return None
        parts = self.completion_parts(message, finish_reason, True)
        if parts and parts[0] == ("format", FINAL):
            rest = [("format", START + FINAL), *parts[1:]]
        elif parts and parts[0][0] == "tool_calls":  # a raw tool call as the first message
            rest = [("format", START), *parts]
        else:
            return None
        return [("format", ANALYSIS), ("think_end", END), *rest]


#: The special tokens a message header may hold after its first one.
_HEADER_INNER = frozenset({"<|channel|>", "<|constrain|>"})
_SPECIAL = re.compile(r"<\|[a-z0-9_]+\|>")


def _cut_header(content: str, first: bool) -> bool:
    """Whether a length-cut ``content`` is the raw text of a message header the cut fell
    in (vLLM 0.34's harmony parser, left in a header at the end, serves the ids of the
    unfinished message decoded as they are, special tokens included): ``<|start|>``
    (after another message) or ``<|channel|>`` (the first one) and then only header text,
    no ``<|message|>``."""
    lead = "<|channel|>" if first else "<|start|>"
    if not content.startswith(lead):
        return False
    return all(m.group() in _HEADER_INNER for m in _SPECIAL.finditer(content, len(lead)))


def _raw_call(content: str, first: bool) -> tuple[str, str] | None:
    """(lead, call body) when ``content`` is a raw tool call: a message whose header (up
    to ``<|message|>``) names a recipient (``to=functions.NAME``; built-in tools too),
    opened by ``<|start|>assistant`` (the lead) after another message, or starting at its
    header (``<|channel|>`` or `` to=``) as the first one. Anything else is final text."""
    lead = START if not first else ""
    if not content.startswith(lead):
        return None
    body = content[len(lead):]
    header, sep, _ = body.partition("<|message|>")
    if not sep or " to=" not in " " + header or "<|start|>" in header:
        return None
    if not (header.startswith("<|channel|>") or header.startswith(" to=")):
        return None
    return lead, body


GPT_OSS = HarmonyDialect(
    name="gpt-oss",
    render=None,
    end_token=RETURN,
    tool_end_token=CALL,
    think_open=None,
    think_close=END,
    eos_markers=frozenset({RETURN, CALL, "<|endoftext|>"}),
    tool_markers=TOOL_MARKERS,
    parse_tool_arguments=True,
    # SGLang's harmony parser holds what may begin any structural token, tools sent or not
    stream_held_starts=("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", END, CALL, RETURN),
    stream_held_min=1,
    stream_held_needs_tools=False,
    tool_stream_resends=True,
)


#: The same completions, with prompts as the ``openai_harmony`` stack (vLLM) renders them;
#: ``--dialect gpt-oss-harmony`` picks it over the folder's template (SGLang).
GPT_OSS_HARMONY = replace(
    GPT_OSS,
    name="gpt-oss-harmony",
    render=harmony_render.render,
    vllm_render=harmony_render.render_vllm,
    own_renderer=True,
    template_kwargs=frozenset({"reasoning_effort"}),
    tools_unproven=harmony_render.unproven_tools,
    stream_held_starts=(),  # vLLM's stack: SGLang's hold and resend are not its
    tool_stream_resends=False,
)
