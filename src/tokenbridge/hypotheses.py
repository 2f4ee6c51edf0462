"""Every native completion one API message is consistent with.

The formula ``reasoning + think_close + content + end`` (``Dialect.completion_parts``)
is one reading of a response. Real serving stacks make others possible, and each is a
:class:`Candidate` here; ``reconstruct`` encodes them and keeps the one the response's
evidence proves (usage, logprobs, token ids, stop id), or reports them all.

* ``no_think_close``: SGLang's and vLLM's Kimi K2 reasoning parsers end the reasoning at
  ``<|tool_calls_section_begin|>`` when the model opens a tool call without ``</think>``,
  so ``content`` starts with the tool section and no ``</think>`` was emitted. Possible
  whenever thinking-mode ``content`` starts with the section marker.
* ``marker_spaces``: vLLM's detokenizer joins every added token to its neighbours with
  one space (``spaces_between_special_tokens``, default true), and the prompt's last
  token (``<think>``) puts one more in front. The text then holds each marker as
  ``" <|tool_call_begin|> "``; removing exactly the joins gives the model's text back.
  Possible only where every marker in the text has those spaces.
* ``end=<marker>``: the end token the evidence names (``matched_stop``, the last logged
  or native id) when it is not the dialect's usual one (``[EOS]`` instead of
  ``<|im_end|>``).
* gpt-oss (harmony, :class:`~.chat.HarmonyDialect`) has readings of its own instead:
  ``empty_analysis`` (no reasoning served: the model wrote no analysis message, or an
  empty one, which SGLang's parser shows the same) and, for a length cut after the
  reasoning with no content, ``cut_header=K[:CHANNEL]`` (the cut fell K tokens into the
  next message's header, which SGLang holds back). Its end token follows from the
  message (``<|return|>`` after the final channel, ``<|call|>`` after a tool call), so
  only ``<|endoftext|>`` is an ``end=`` reading.
* GLM (``Dialect.think_open_prefix``: the model writes ``"\\n<think>"``) reaches the API
  in four forms, and only SGLang's whole one (reasoning ``"\\n<think>R"``) says where
  the newline went. SGLang streamed gives reasoning ``"\\nR"`` (the formula takes the
  newline out); vLLM whole drops everything before ``<think>`` (``think_prefix_kept``:
  the reasoning is the model's as served); vLLM streamed sends that newline as the first
  content delta (``think_prefix_in_content``: content ``"\\n" + C``). A request or
  ``meta`` that says whether it streamed, and a provider trait (which form its run
  shows), rule readings out; the evidence picks among the rest. A model may also skip the
  newline (``think_prefix_absent``: every engine then serves the block as written). That
  reading is offered where no form with the newline fits, where the engine may be SGLang
  and the reasoning shows no newline (SGLang would have kept it there), and wherever token
  ids or logprobs can tell (``prefix_absent``); a run that shows vLLM's form reads a
  content newline as vLLM's stream of the prefix, the model's trained format. Where
  vLLM's whole form fits as well it is one token longer, the gap of an end token usage
  leaves out, so there the reading also needs ids, logprobs or a run that proved the end
  token counted.
* ``tool_start_held=<text>``: SGLang's ``kimi_k2`` tool parser, streaming with ``tools``
  sent, holds back text at the end of the content that may begin a tool-call marker
  (``<|`` up to ``<|tool_calls_section_begin|``) until it knows, and at the end of the
  stream releases nothing (0.5.23: its ``finish`` is the base's). The model's content is
  the served content plus that text: ``" <|"`` is one token where ``" "`` was served, the
  same count. Each such text is a reading where the request sent tools and may have
  streamed (``held_tails``); the caller keeps only those the evidence can tell. Qwen3's
  ``qwen25`` detector holds what may begin ``</tool_call>`` the same way, and gpt-oss's
  harmony parser what may begin any structural token, tools or not
  (``Dialect.stream_held_starts``).
* ``prefix_resent=J``: gpt-oss streamed with ``tools`` sent, SGLang's tool detector passes
  the final text on delta by delta while its own harmony parser keeps it; the delta that
  completes a channel word (``" Analysis"``) switches that parser to its text strategy, which
  sends all it kept again: ``"# Analysis"`` is served ``"## Analysis"``, the same count. The
  model's text is the served one less its first ``J`` characters
  (:func:`~.chat.harmony.resent_prefixes`), each with what that parser then held back at the
  end (``tool_start_held=...``, a beginning of a channel word). The detector changes such
  text in more ways than these at the model's count, so the caller offers them only where
  ids or logprobs pick (without them the row is ``harmony_message_lost``).
* ``cut_after_think_close``: a length cut with no content served may have fallen inside
  the reasoning (the formula) or right after ``</think>``: one token apart. The count alone
  cannot pick: vLLM holds back the bytes of a cut that falls inside a character (a partial
  UTF-8 token is never served), which is one token more than the formula too. So it is
  offered only where token ids or logprobs say (``cut_after_close``).
* ``end_in_think``: a turn that ended (stop) with no content served may have closed its
  think block (the formula) or ended inside it, ``R<|im_end|>``: SGLang's ``kimi_k2`` parser
  serves a block never closed as reasoning alone, as it serves a closed one with nothing after.
  One token apart, the same gap as a provider that leaves its end token uncounted, so it is
  offered only where the caller says the evidence can tell (``end_in_think``: token ids or
  logprobs, or a run that proved the provider counts its end token).

The common case, a message none of these fit, has one candidate and costs nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Mapping, Sequence

from .chat import Dialect, HarmonyDialect, message_reasoning
from .chat.harmony import TEXT_WORDS, resent_prefixes
from .content import content_text

__all__ = ["Candidate", "candidates", "ends_in_think_fits", "held_tails", "unjoin_marker_spaces"]

Parts = list[tuple[str, str]]


@dataclass(frozen=True)
class Candidate:
    """One native reading of a message: its parts, and the names of the readings
    applied (empty for the plain formula)."""

    parts: Parts
    names: tuple[str, ...] = ()
    #: Text appended to the last content part of the reading it extends, or that part
    #: itself where that reading has none (``tool_start_held``): its ids follow from the
    #: extended part's (``Tokenizer.encode_appended``).
    held: str = ""
    #: A reading the count alone never picks: without ids or logprobs it is kept only where
    #: it ties the count of a reading kept on its own, which it then makes ambiguous (the caller checks).
    veto: bool = False
    #: The model may have written more ids than this reading spells, text the engine never
    #: served: vLLM's parser stripped the reasoning's end (whitespace of any length) or its
    #: detokenizer held back a character the cut split. Without ids or logprobs, a count
    #: above this reading's is then no proof of another reading (the caller checks).
    open_end: bool = False

    @property
    def name(self) -> str | None:
        return "+".join(self.names) if self.names else None


def _text(message: Mapping[str, Any]) -> tuple[str, str]:
    reasoning = message_reasoning(message) or ""
    return reasoning, content_text(message.get("content"))


def held_tails(starts: Sequence[str], shortest: int = 2) -> tuple[str, ...]:
    """Every text a streaming parser holds back at the end of the content, waiting for one
    of ``starts``: each one's beginnings of ``shortest`` characters or more, short of the
    whole marker (SGLang's ``kimi_k2`` detector holds from ``<|``, sending a lone ``<``;
    ``qwen25`` and the harmony parser hold from ``<``)."""
    return tuple(dict.fromkeys(m[:n] for m in starts for n in range(max(shortest, 1), len(m))))


def _held_readings(c: Candidate, tails: Sequence[str], thinking: bool) -> list[Candidate]:
    """``c`` with each of ``tails`` written at the end of its content (before its end token):
    where the content is the model's last text and the tool parser saw it (after a closed
    think block, or with thinking off), and no tool section was served."""
    kinds = [kind for kind, _ in c.parts]
    if not tails or c.veto or "tool_calls" in kinds or "marker_spaces" in c.names:  # a call was made, or vLLM served it
        return []
    at = len(kinds) - (kinds[-1:] == ["end"])
    before = kinds[at - 1] if at else None
    if before == "content":
        text = c.parts[at - 1][1]
        return [Candidate([*c.parts[: at - 1], ("content", text + h), *c.parts[at:]], (*c.names, f"tool_start_held={h}"), h)
                for h in tails]
    if before == "think_end" or (before is None and not thinking):
        return [Candidate([*c.parts[:at], ("content", h), *c.parts[at:]], (*c.names, f"tool_start_held={h}"), h)
                for h in tails]
    return []


def _markers(dialect: Dialect) -> list[str]:
    found = [m for m in (dialect.think_open, dialect.think_close) if m]
    if dialect.tool_markers is not None:
        found.extend(dialect.tool_markers.all)
    return sorted(set(found), key=len, reverse=True)


def unjoin_marker_spaces(text: str, markers: Sequence[str], *, plain: bool = False) -> str | None:
    """``text`` with vLLM's join spaces removed, or None when ``text`` does not have the
    joined shape (a leading space, one space between each marker and its neighbours).

    The detokenized text is ``" " + " ".join(pieces)``, a piece being a marker or a run
    of ordinary text. So a run between two markers reads ``" "`` (empty run) or
    ``" " + run + " "``, the run before the first marker likewise, and the run after the
    last marker ``""`` or ``" " + run``. Text with no marker at all has only the leading
    space to show; it is unjoined only with ``plain``: the provider is known to join, or the
    message may be vLLM 0.34's (:func:`_vllm_034`) for a family whose text it joins
    (``Dialect.vllm_joins``), where the first text always carries it.
    """
    if not text.startswith(" "):
        return None
    spans: list[tuple[int, int]] = []
    pos = 0
    while True:
        hits = [(text.find(m, pos), m) for m in markers]
        hits = [(at, m) for at, m in hits if at >= 0]
        if not hits:
            break
        at, m = min(hits, key=lambda h: (h[0], -len(h[1])))
        spans.append((at, at + len(m)))
        pos = at + len(m)
    if not spans:  # no marker: only the leading space shows
        return text[1:] if plain else None
    out: list[str] = []
    prev = 0
    for start, end in spans:
        run = text[prev:start]
        if run == " ":
            pass
        elif len(run) >= 3 and run[0] == " " and run[-1] == " ":
            out.append(run[1:-1])
        else:
            return None
        out.append(text[start:end])
        prev = end
    tail = text[prev:]
    if tail:
        if tail[0] != " " or len(tail) < 2:
            return None
        out.append(tail[1:])
    return "".join(out)


#: Whitespace vLLM's parser engine may have taken off the end of the reasoning (0.34's
#: ``strip_trailing_reasoning_whitespace``: Kimi's and GLM's parsers; Kimi's join space before
#: ``</think>`` goes with it). Each is a reading (``reasoning_tail=``) that, without ids or
#: logprobs, only vetoes: where one ties the count of a reading kept (a newline after a full stop
#: often joins its token), the row is ambiguous.
STRIPPED_TAILS = ("\n", "\n\n", "\n\n\n", "\r\n", " ", "  ", "\t")


def _tails(dialect: Dialect, reasoning: str, spot: int, spelled: str | None, *, alone: bool) -> tuple[str, ...]:
    """The whitespace tried at ``spot`` of a stripped ``reasoning``: :data:`STRIPPED_TAILS`,
    and, where ids or logprobs spell the completion (``spelled``), the whitespace they put
    there (any run: ``" \n"``, a markdown break ``"  \n"``, ``"\u3000"``), which only those
    ids can then prove. Read before the first think close they spell, behind what of the
    reasoning follows ``spot``; where they spell none, all they spell is the reasoning when
    the message has no content (``alone``: a cut inside it), else they may be the content's
    logprobs alone: only the fixed runs then."""
    if spelled is None:
        return STRIPPED_TAILS
    close = dialect.think_close or ""
    at = spelled.find(close) if close else -1
    if at < 0 and not alone:  # the content's logprobs alone, perhaps: nothing says where the reasoning ends
        return STRIPPED_TAILS
    region = spelled[:at] if at >= 0 else spelled
    after = reasoning[spot:]
    if not region.endswith(after):
        return STRIPPED_TAILS
    before = region[: len(region) - len(after)]
    tail = before[len(before.rstrip()):]
    return (*STRIPPED_TAILS, tail) if tail and tail not in STRIPPED_TAILS else STRIPPED_TAILS


def _joined_texts(dialect: Dialect, reasoning: str, content: str, thinking: bool, *, closed: bool,
                  section: bool, held: bool) -> list[tuple[str, bool]]:
    """The texts vLLM's detokenizer may have joined before its reasoning parser cut them, each
    with whether the parser stripped the end of the reasoning. The parser cut at ``</think>``
    (the content then starts with a join space, or is empty) or, with no ``</think>``, at the
    tool section or nowhere. Before 0.34 the reasoning kept the join space in front of
    ``</think>``; 0.34 strips it with any whitespace the model wrote there, so that space is
    put back and the model's own tail is unknown (``STRIPPED_TAILS``). A reasoning ``held``
    alone (:func:`_held_alone`) lost its join space in front too."""
    stripped = thinking and not reasoning[-1:].isspace()
    lead = " " if held else ""
    if not closed:
        return [(lead + reasoning + content, stripped)]
    close = dialect.think_close or ""
    if not content or content.startswith(" "):
        out = [(reasoning + close + content, False)]
        if stripped:
            out.append(((lead + reasoning or " ") + (" " if reasoning else "") + close + content, True))
        return out
    return [(reasoning + content, False)] if section else []


def _joined_readings(dialect: Dialect, message: Mapping[str, Any], finish_reason: str | None, thinking: bool,
                     prompt_opens_think: bool, markers: Sequence[str], *, closed: bool, section: bool,
                     stream: bool | None, by_ids: bool, plain: bool, spelled: str | None = None) -> list[Candidate]:
    """The readings of a message vLLM's detokenizer joined (``marker_spaces``): each joined
    text unjoined and split as its parser split it; where the parser stripped the reasoning's
    end, that reading open-ended and one more per :data:`STRIPPED_TAILS` spot (vetoes,
    without ``by_ids``); and, for a length cut whose content ends in a join space, the tool
    section's start the parser swallowed after it (a veto: its tool parser drops the markup
    with no ``tools`` sent too, and the space it leaves is one token, as that marker is).
    The 0.34 readings are built only for a family whose text vLLM joins (``vllm_joins``)
    and a message that may be 0.34's (:func:`_vllm_034`)."""
    reasoning, content = _text(message)
    out: list[Candidate] = []
    new = dialect.vllm_joins and _vllm_034(message)
    held = new and _held_alone(reasoning, markers, stream)
    for text, stripped in _joined_texts(dialect, reasoning, content, thinking and new, closed=closed,
                                        section=section, held=held):
        native = unjoin_marker_spaces(text, markers, plain=plain or new)
        if native is None:
            continue
        r, c, was_closed = _split(dialect, native, thinking)
        tails = [(r[:at] + tail + r[at:], tail) for at in _tail_spots(dialect, r, stream)
                 for tail in _tails(dialect, r, at, spelled, alone=not content)] if stripped else []
        for r2, tail in [(r, ""), *tails]:
            parts = dialect.completion_parts({"reasoning": r2, "content": c}, finish_reason, thinking,
                                             prompt_opens_think)
            names: tuple[str, ...] = ("marker_spaces",)
            if not was_closed and thinking and any(kind == "think_end" for kind, _ in parts) and c:
                parts = [p for p in parts if p[0] != "think_end"]
                names = ("marker_spaces", "no_think_close")
            if tail:
                names = (*names, f"reasoning_tail={_escaped(tail)}")
            out.append(Candidate(parts, names, veto=bool(tail) and not by_ids,
                                 open_end=not tail and (stripped or finish_reason == "length")))
    out += _swallowed(dialect, message, finish_reason, thinking, prompt_opens_think, markers, closed=closed,
                      by_ids=by_ids, new=new)
    return out


def _swallowed(dialect: Dialect, message: Mapping[str, Any], finish_reason: str | None, thinking: bool,
               prompt_opens_think: bool, markers: Sequence[str], *, closed: bool, by_ids: bool,
               new: bool) -> list[Candidate]:
    """A length cut right after a tool section's start that vLLM 0.34's ``kimi_k2`` tool
    parser swallowed (it drops the markup with no ``tools`` sent too): the content ends in the
    join space that stood before it, one token, as the marker is. A veto reading, without
    ``by_ids``."""
    reasoning, content = _text(message)
    tm = dialect.tool_markers
    if not (new and finish_reason == "length" and (closed or not thinking) and content.endswith(" ") and tm is not None):
        return []
    text = content + tm.section_begin
    if thinking:  # after the reasoning and its close, the join space before </think> put back
        text = (reasoning or " ") + (" " if reasoning else "") + (dialect.think_close or "") + text
    native = unjoin_marker_spaces(text, markers)
    if native is None:
        return []
    r, c, _ = _split(dialect, native, thinking)
    parts = dialect.completion_parts({"reasoning": r, "content": c}, finish_reason, thinking, prompt_opens_think)
    return [Candidate(parts, ("marker_spaces", "section_swallowed"), veto=not by_ids)]


def _vllm_034(message: Mapping[str, Any]) -> bool:
    """Whether a message may be vLLM 0.34's, whose parsers strip and hold text as no other
    engine does: it names its reasoning ``reasoning``; SGLang and earlier vLLM always
    send ``reasoning_content``."""
    return "reasoning_content" not in message


def _held_alone(reasoning: str, markers: Sequence[str], stream: bool | None) -> bool:
    """Whether a streamed reasoning is only the start of a marker (``"<"``): vLLM 0.34's lexer
    held it to the end of the stream and then sent it without the whitespace before it, its
    join space too (``" <"`` is served ``"<"``)."""
    return stream is not False and bool(reasoning) and any(m.startswith(reasoning) and m != reasoning for m in markers)


def _tail_spots(dialect: Dialect, reasoning: str, stream: bool | None) -> list[int]:
    """Where in ``reasoning`` whitespace vLLM 0.34's parser dropped may have stood: its end,
    and, where the response may have streamed, before an end that could begin a marker
    (``"<"``, ``"</thi"``): its lexer holds that back and, at the end of the stream, sends it
    without the whitespace it deferred before it (``" a <"`` is served ``" a<"``)."""
    spots = [len(reasoning)]
    if stream is not False:
        for marker in _markers(dialect):
            spots += [len(reasoning) - n for n in range(1, len(marker)) if reasoning.endswith(marker[:n])]
    return sorted(set(spots), reverse=True)


def _with_stripped_tails(dialect: Dialect, message: Mapping[str, Any], out: list[Candidate],
                         finish_reason: str | None, *, stream: bool | None, by_ids: bool,
                         spelled: str | None = None) -> list[Candidate]:
    """``out``, where vLLM 0.34's parser for this family strips the reasoning's end
    (``Dialect.reasoning_end_stripped``) and the message may be its (``reasoning``, not
    SGLang's ``reasoning_content``, the model's text before ``<think>`` in front), with each
    reading's reasoning followed by each of
    :data:`STRIPPED_TAILS` at each of its :func:`_tail_spots` (vetoes, without ``by_ids``),
    the reading itself open-ended."""
    reasoning = message.get("reasoning")
    if not dialect.reasoning_end_stripped or not isinstance(reasoning, str) or not _vllm_034(message) \
            or reasoning[-1:].isspace() or not reasoning.startswith(dialect.think_open_prefix):
        return out  # 0.34 serves GLM's newline before <think> in the reasoning
    cut = finish_reason == "length"
    content = _text(message)[1]
    done: list[Candidate] = []
    for c in out:
        at = max((k for k, (kind, _) in enumerate(c.parts) if kind == "reasoning"), default=-1)
        if c.veto or at < 0:
            done.append(c)
            continue
        done.append(Candidate(c.parts, c.names, c.held, veto=c.veto, open_end=True))
        text = c.parts[at][1]
        for spot in _tail_spots(dialect, text, stream):
            for tail in _tails(dialect, text, spot, spelled, alone=not content):
                parts = [*c.parts[:at], ("reasoning", text[:spot] + tail + text[spot:]), *c.parts[at + 1:]]
                done.append(Candidate(parts, (*c.names, f"reasoning_tail={_escaped(tail)}"), veto=not by_ids,
                                      open_end=cut))
    return done


def _escaped(text: str) -> str:
    """Whitespace as a reading's name spells it (``\\n``, ``\\t``, ``\\r``)."""
    return text.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")


def _split(dialect: Dialect, text: str, thinking: bool) -> tuple[str, str, bool]:
    """(reasoning, content, whether the think block was closed) of a served text, split
    the way the engines' reasoning parsers split it."""
    close = dialect.think_close
    if not thinking or not close:
        return "", text, False
    at = text.find(close)
    if at >= 0:
        return text[:at], text[at + len(close):], True
    section = dialect.tool_markers.section_begin if dialect.tool_markers is not None else None
    if section and section in text:
        at = text.index(section)
        return text[:at], text[at:], False
    return text, "", False


def candidates(
    dialect: Dialect,
    message: Mapping[str, Any],
    finish_reason: str | None,
    thinking: bool,
    prompt_opens_think: bool,
    end_markers: Sequence[str] = (),
    *,
    joins_markers: bool = False,
    stream: bool | None = None,
    prefix_in_reasoning: bool | None = None,
    end_in_think: bool = False,
    cut_after_close: bool = False,
    prefix_absent: bool = False,
    held: Sequence[str] = (),
    tools_streamed: bool = False,
    stripped_by_ids: bool = False,
    spelled: str | None = None,
    short_ties: bool = True,
) -> list[Candidate]:
    """The plain formula first, then every other reading this message admits.

    ``joins_markers``: the provider is known (across its run, or by probe) to serve
    vLLM's joined text, so a joined reading replaces the plain ones wherever it fits.
    ``stream``: whether the response was streamed (None: unknown). ``prefix_in_reasoning``:
    the provider's run shows SGLang's GLM form (True) or vLLM's (False); None: unknown.
    ``end_in_think`` / ``cut_after_close`` / ``prefix_absent``: offer those readings where the
    message fits them (the caller knows whether the evidence can tell them from the formula);
    ``end_in_think`` also says a one-token gap is not an uncounted end token, which GLM's
    ``think_prefix_absent`` needs where vLLM's whole form fits too. ``held``: the texts a
    streaming tool parser may have held back (:func:`held_tails`), each a reading right
    after the one it extends. ``tools_streamed``: the request sent tools and may have
    streamed, and ids or logprobs can pick among gpt-oss's ``prefix_resent`` readings.
    ``stripped_by_ids``: ids or logprobs can pick the whitespace vLLM's parser stripped from
    the end of a joined reasoning (``reasoning_tail=``); without them those readings only veto.
    ``spelled``: the completion text those ids or logprobs spell, read for whitespace outside
    :data:`STRIPPED_TAILS` that the parser stripped (:func:`_tails`). ``short_ties``: the
    count may take a tool section opened without ``</think>`` (one token short of the
    formula) for the formula with its end token uncounted, so that reading only vetoes (the
    caller lifts it where logprobs cover the whole completion); else (ids, no exact count,
    the run showed how the end is counted) it stands beside the formula.
    """
    base = dialect.completion_parts(message, finish_reason, thinking, prompt_opens_think)
    out = [Candidate(base)]
    if isinstance(dialect, HarmonyDialect):
        return _harmony(dialect, message, finish_reason, out, end_markers, held, resends=tools_streamed)
    if thinking and not prompt_opens_think:
        out = _prefix_readings(dialect, message, finish_reason, stream, prefix_in_reasoning, absent=prefix_absent,
                               gaps=end_in_think) or out
        base = out[0].parts
    tm = dialect.tool_markers
    reasoning, content = _text(message)
    closed_by_formula = any(kind == "think_end" for kind, _ in base)

    opens_section = tm is not None and content.startswith(tm.section_begin)
    if thinking and closed_by_formula:
        # the formula's, and a second <think>'s read beside the whole form (the record does not
        # say it streamed): unclosed, that one ties the whole form's count (a tool call)
        twice = [c for c in out[1:] if "think_open_twice" in c.names] if opens_section else []
        for c in [out[0], *twice]:
            unclosed = _no_think_close(dialect, c.parts, reasoning, content, finish_reason, prompt_opens_think,
                                       section=opens_section, gaps=not short_ties)
            if unclosed is not None:
                out.append(replace(unclosed, names=(*c.names, *unclosed.names), veto=c.veto or unclosed.veto))

    markers = _markers(dialect)
    if markers and (reasoning.startswith(" ") or content.startswith(" ")
                    or (dialect.vllm_joins and _held_alone(reasoning, markers, stream))):
        for cand in _joined_readings(dialect, message, finish_reason, thinking, prompt_opens_think, markers,
                                     closed=closed_by_formula, section=opens_section, stream=stream,
                                     by_ids=stripped_by_ids, plain=joins_markers, spelled=spelled):
            if all(cand.parts != c.parts for c in out):
                out.append(cand)

    if joins_markers and any("marker_spaces" in c.names and not c.veto for c in out):
        out = [c for c in out if "marker_spaces" in c.names]
    if thinking:
        out = _with_stripped_tails(dialect, message, out, finish_reason, stream=stream, by_ids=stripped_by_ids,
                                   spelled=spelled)
    out = [r for c in out for r in (c, *_held_readings(c, held, thinking))]
    out += _cut_after_close(dialect, out, finish_reason, thinking, prompt_opens_think, cut_after_close)
    out += _ended_in_think(out, finish_reason, thinking, prompt_opens_think, end_in_think,
                           hidden=dialect.think_open or "", hidden_by_ids=stripped_by_ids)
    return _with_ends(out, end_markers)


def _with_ends(out: list[Candidate], markers: Sequence[str]) -> list[Candidate]:
    """``out``, then each reading that ends a turn with each of ``markers`` as its end token
    instead (``end=<marker>``)."""
    for marker in markers:
        for cand in list(out):
            # a reading that already ends with the named token (GLM's <|observation|>
            # after a tool call) is that reading, not a second one
            if cand.parts and cand.parts[-1][0] == "end" and cand.parts[-1][1] != marker:
                out.append(Candidate([*cand.parts[:-1], ("end", marker)], (*cand.names, f"end={marker}"), cand.held,
                                     veto=cand.veto, open_end=cand.open_end))
    return out


def _no_think_close(dialect: Dialect, base: Parts, reasoning: str, content: str, finish_reason: str | None,
                    prompt_opens_think: bool, *, section: bool, gaps: bool) -> Candidate | None:
    """The formula's reading without its ``</think>``: the model never closed its reasoning and
    the parser ended it where the content starts, at the tool section (``section``), or at the
    text it takes for a call's start (``Dialect.reasoning_tool_start``: plain text to DeepSeek,
    so the two halves are one reasoning text). That one is mostly a token short of the
    formula: where the turn ended, the gap an uncounted end token leaves too, so unless
    ``gaps`` says the evidence can tell, it only vetoes (``Candidate.veto``). So is a tool
    section's: Kimi's formula with ``</think>`` and its end token uncounted has the same count
    as the section opened without it. Joined text can also take a token more than its
    halves (after a tab), and then it ties the formula."""
    veto = finish_reason != "length" and not gaps
    if section:
        return Candidate([p for p in base if p[0] != "think_end"], ("no_think_close",), veto=veto)
    start = dialect.reasoning_tool_start
    if not start or not content.startswith(start):
        return None
    parts = dialect.completion_parts({"reasoning": reasoning + content, "content": ""}, finish_reason, True,
                                     prompt_opens_think)
    return Candidate([p for p in parts if p[0] != "think_end"], ("no_think_close",), veto=veto)


def _cut_after_close(dialect: Dialect, out: list[Candidate], finish_reason: str | None, thinking: bool,
                     prompt_opens_think: bool, offered: bool) -> list[Candidate]:
    """Each length-cut thinking reading open at the cut, closed by ``</think>`` (see
    :func:`_open_at_cut`), where the reading is ``offered``."""
    close = dialect.think_close
    if not (offered and thinking and close and finish_reason == "length"):
        return []
    return [Candidate([*c.parts, ("think_end", close)], (*c.names, "cut_after_think_close"), veto=c.veto)
            for c in out if _open_at_cut(c.parts, prompt_opens_think)]


def _open_at_cut(parts: Parts, prompt_opens_think: bool) -> bool:
    """Whether a cut reading ends inside an open think block with no content served: the
    cut may as well have fallen right after ``</think>`` (every parser then serves the
    same empty content), one token more, so the count tells them apart."""
    kinds = {kind for kind, _ in parts}
    if kinds & {"think_end", "content", "tool_calls", "end"}:
        return False
    return prompt_opens_think or "think_start" in kinds


def _ended_in_think(out: list[Candidate], finish_reason: str | None, thinking: bool,
                    prompt_opens_think: bool, offered: bool, *, hidden: str = "",
                    hidden_by_ids: bool = False) -> list[Candidate]:
    """Each reading that closes an empty think block and ends, without the close (see
    :func:`ends_in_think_fits`), where the reading is ``offered``. Elsewhere each still
    vetoes: one token short of the reading it comes from, it can tie another (vLLM's join
    space before the first word can take a token off a count).

    And each with a token the engine hid in place of the close (``token_hidden``, the
    marker ``hidden`` standing for it): a turn that ended in its block after writing a
    ``<think>`` (SGLang's reasoning parsers delete one: streamed, the first anywhere; whole,
    any leading one) or any special token (skipped in detokenizing) is served exactly as
    the formula's ``R</think><end>``, at the formula's count. Only ids, logprobs or a
    ``reasoning_tokens`` that fits one of them pick (``hidden_by_ids``); else the tie is said."""
    if not ends_in_think_fits(out[0].parts, finish_reason, thinking, prompt_opens_think):
        return []
    closed = [c for c in out if _closes_empty(c.parts)]
    ended = [Candidate([p for p in c.parts if p[0] != "think_end"], (*c.names, "end_in_think"), veto=c.veto or not offered)
             for c in closed]
    if not hidden:
        return ended
    return ended + [Candidate([*[p for p in c.parts[:-1] if p[0] != "think_end"], ("think_start", hidden), c.parts[-1]],
                              (*c.names, "token_hidden"), veto=c.veto or not hidden_by_ids) for c in closed]


def ends_in_think_fits(parts: Parts, finish_reason: str | None, thinking: bool, prompt_opens_think: bool) -> bool:
    """Whether a message read as ``parts`` (the formula) may as well have ended inside its
    think block (the ``end_in_think`` reading): thinking, the prompt or the model (GLM's
    ``"\n<think>"``) opened the block, the turn ended (no length cut) and nothing but
    reasoning came before the close."""
    opened = prompt_opens_think or any(kind == "think_start" for kind, _ in parts)
    return thinking and opened and finish_reason != "length" and _closes_empty(parts)


def _closes_empty(parts: Parts) -> bool:
    """``[[format,] think_start,] [reasoning,] think_end, end``: a think block closed with no
    content or call after it."""
    kinds = [kind for kind, _ in parts]
    return kinds[-2:] == ["think_end", "end"] and set(kinds[:-2]) <= {"format", "think_start", "reasoning"}


#: The reading of a GLM turn whose model wrote ``<think>`` without the newline before it.
_PREFIX_ABSENT = "think_prefix_absent"


def _prefix_forms(prefix: str, think_open: str, reasoning: str, content: str, stream: bool | None,
                  prefix_in_reasoning: bool | None, *, absent: bool, gaps: bool) -> list[tuple[str, str, str | None]]:
    """(reasoning, content, name) the model wrote after ``prefix + think_open`` (after
    ``think_open`` alone for :data:`_PREFIX_ABSENT`), for each engine form the served
    message fits, the formula's first.

    SGLang keeps the prefix in the reasoning (whole: ``prefix + think_open + R``;
    streamed: ``prefix + R``); vLLM before its parser engine dropped it whole and streamed
    it as content, and 0.34 serves ``prefix + R`` whole and streamed, as SGLang streams,
    less its trailing whitespace: of an empty block nothing, no reasoning served at all. A block
    written without the prefix reaches the API as written under every engine: that
    reading is offered where ``absent`` says the evidence can tell, where no form with
    the prefix fits, and where the engine may be SGLang and the reasoning shows no prefix,
    unless vLLM's whole form fits too and the evidence cannot tell a one-token gap from an
    uncounted end token (``gaps``: ids, or a run that proved its end token counted).
    """
    if reasoning.startswith(prefix + think_open):  # SGLang whole: no other engine writes <think> there
        whole = (reasoning[len(prefix + think_open):], content, None)
        # ... unless it streamed: the streaming parser strips the first <think> only, so this
        # is a second one the model wrote (a cold tester's: read whole, the count made up the
        # </think> added for the <think> lost). A record that does not say is read both ways
        # (the caller lets the second one only veto where a one-token gap proves nothing)
        twice = (reasoning[len(prefix):], content, "think_open_twice")
        return [twice] if stream is True else [whole] if stream is False else [whole, twice]
    forms: list[tuple[str, str, str | None]] = []
    sglang, vllm = prefix_in_reasoning is not False, prefix_in_reasoning is not True
    if reasoning.startswith(prefix):  # SGLang streamed, vLLM 0.34 whole or streamed
        forms.append((reasoning[len(prefix):], content, None))
    elif sglang and not reasoning:
        # vLLM 0.34 strips the reasoning's trailing whitespace: prefix + an empty block is served
        # with no reasoning at all, the prefix gone (a content newline is then the model's own)
        forms.append(("", content, None))
    if vllm and stream is not True:
        forms.append((reasoning, content, "think_prefix_kept" if reasoning.startswith(prefix) else None))
    if vllm and stream is not False and content.startswith(prefix):
        forms.append((reasoning, content[len(prefix):], "think_prefix_in_content"))
    # vLLM's whole form of the same text keeps the newline the absent reading lacks: one
    # token apart, the gap of an end token usage leaves out, so it needs evidence of its own
    one_apart = vllm and stream is not True
    if absent or not forms or (sglang and not reasoning.startswith(prefix) and (gaps or not one_apart)):
        forms.append((reasoning, content, _PREFIX_ABSENT))
    return forms


def _prefix_readings(dialect: Dialect, message: Mapping[str, Any], finish_reason: str | None,
                     stream: bool | None, prefix_in_reasoning: bool | None, *, absent: bool,
                     gaps: bool) -> list[Candidate]:
    """GLM's readings of where the newline before ``<think>`` went (see the module
    docstring) in thinking mode when the model opens the block; empty when the family
    writes no prefix or no engine form fits (the formula then stands)."""
    prefix, think_open = dialect.think_open_prefix, dialect.think_open or ""
    if not (prefix and think_open and dialect.think_self_open):
        return []
    reasoning, content = _text(message)
    out: list[Candidate] = []
    for r, c, name in _prefix_forms(prefix, think_open, reasoning, content, stream, prefix_in_reasoning,
                                    absent=absent, gaps=gaps):
        # the formula strips a leading prefix + think_open exactly, so hand it one
        msg = {"reasoning": prefix + think_open + r, "content": c}
        parts = dialect.completion_parts(msg, finish_reason, True, False)
        if name == _PREFIX_ABSENT:
            parts = [p for p in parts if p != ("format", prefix)]
        if all(parts != cand.parts for cand in out):
            # a second <think> where the record does not say it streamed is one token more than
            # the whole form: without ids or a run that proved its end token counted, the count
            # alone never picks it (it ties only where another reading is its size: a tool call
            # whose section closed the block). Under a provider that leaves its end token
            # uncounted and a run that has not shown it, the whole form's count is the second's:
            # that case is read as the whole form (the run's traits exist to tell it)
            veto = name == "think_open_twice" and stream is None and not gaps
            out.append(Candidate(parts, (name,) if name else (), veto=veto))
    return out


def _harmony(dialect: HarmonyDialect, message: Mapping[str, Any], finish_reason: str | None,
             out: list[Candidate], end_markers: Sequence[str], held: Sequence[str] = (), *,
             resends: bool = False) -> list[Candidate]:
    """gpt-oss's readings after the formula (``out``), the final text's resent start where
    the tool detector may have streamed it (``resends``), the final message's held tails, and
    ``<|endoftext|>`` as the end where the evidence names it (the other ends follow from
    the message)."""
    empty = dialect.empty_analysis_reading(message, finish_reason)
    if empty is not None:
        out.append(Candidate(empty, ("empty_analysis",)))
    ended = dialect.end_in_analysis_reading(message, finish_reason)
    if ended is not None:
        out.append(Candidate(ended, ("end_in_analysis",)))
    out.extend(Candidate(parts, (name,)) for parts, name in dialect.cut_readings(message, finish_reason))
    if resends and dialect.tool_stream_resends:
        out += [r for c in list(out) for r in _resent_readings(c)]
    out = [r for c in out for r in (c, *(() if c.held else _held_readings(c, held, thinking=True)))]
    return _with_ends(out, [m for m in end_markers if m not in dialect.end_tokens])


#: What SGLang's harmony text strategy may hold back at the end of the stream and never send.
_TEXT_TAILS = held_tails(TEXT_WORDS, 1)


def _resent_readings(c: Candidate) -> list[Candidate]:
    """``c`` with its final text read as SGLang's tool detector may have resent its start
    (``prefix_resent=J``, :func:`~.chat.harmony.resent_prefixes`), each also with what the
    detector's parser may then have held back at the end (``tool_start_held=...``)."""
    at = next((i for i, (kind, _) in enumerate(c.parts) if kind == "content"), None)
    if at is None:
        return []
    served = c.parts[at][1]
    out = []
    for j in resent_prefixes(served):
        base = Candidate([*c.parts[:at], ("content", served[j:]), *c.parts[at + 1:]], (*c.names, f"prefix_resent={j}"))
        out += [base, *_held_readings(base, _TEXT_TAILS, thinking=True)]
    return out
