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

The common case, a message none of these fit, has one candidate and costs nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

from .chat import Dialect, HarmonyDialect, message_reasoning
from .content import content_text

__all__ = ["Candidate", "candidates", "unjoin_marker_spaces"]

Parts = list[tuple[str, str]]


@dataclass(frozen=True)
class Candidate:
    """One native reading of a message: its parts, and the names of the readings
    applied (empty for the plain formula)."""

    parts: Parts
    names: tuple[str, ...] = ()

    @property
    def name(self) -> str | None:
        return "+".join(self.names) if self.names else None


def _text(message: Mapping[str, Any]) -> tuple[str, str]:
    reasoning = message_reasoning(message) or ""
    return reasoning, content_text(message.get("content"))


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
    space to show; it is unjoined only with ``plain`` (the provider is known to join).
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
    if not spans:  # no marker: only the leading space shows, so only a known joiner says so
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
) -> list[Candidate]:
    """The plain formula first, then every other reading this message admits.

    ``joins_markers``: the provider is known (across its run, or by probe) to serve
    vLLM's joined text, so a joined reading replaces the plain ones wherever it fits.
    """
    base = dialect.completion_parts(message, finish_reason, thinking, prompt_opens_think)
    out = [Candidate(base)]
    if isinstance(dialect, HarmonyDialect):
        return _harmony(dialect, message, finish_reason, out, end_markers)
    tm = dialect.tool_markers
    reasoning, content = _text(message)
    closed_by_formula = any(kind == "think_end" for kind, _ in base)

    opens_section = tm is not None and content.startswith(tm.section_begin)
    if thinking and closed_by_formula and opens_section:
        out.append(Candidate([p for p in base if p[0] != "think_end"], ("no_think_close",)))

    if (reasoning.startswith(" ") or content.startswith(" ")) and (markers := _markers(dialect)):
        # vLLM's parser cut the joined text at </think> (the content then starts with a
        # join space, or is empty) or, with no </think>, at the tool section.
        joined = []
        if not closed_by_formula:
            joined.append(reasoning + content)
        elif not content or content.startswith(" "):
            joined.append(reasoning + (dialect.think_close or "") + content)
        elif opens_section:
            joined.append(reasoning + content)
        for text in joined:
            native = unjoin_marker_spaces(text, markers, plain=joins_markers)
            if native is None:
                continue
            r, c, closed = _split(dialect, native, thinking)
            msg = {"reasoning": r, "content": c}
            parts = dialect.completion_parts(msg, finish_reason, thinking, prompt_opens_think)
            names: tuple[str, ...] = ("marker_spaces",)
            if not closed and thinking and any(kind == "think_end" for kind, _ in parts) and c:
                parts = [p for p in parts if p[0] != "think_end"]
                names = ("marker_spaces", "no_think_close")
            if all(parts != cand.parts for cand in out):
                out.append(Candidate(parts, names))

    if joins_markers and any("marker_spaces" in c.names for c in out):
        out = [c for c in out if "marker_spaces" in c.names]
    for marker in end_markers:
        for cand in list(out):
            # a reading that already ends with the named token (GLM's <|observation|>
            # after a tool call) is that reading, not a second one
            if cand.parts and cand.parts[-1][0] == "end" and cand.parts[-1][1] != marker:
                out.append(Candidate([*cand.parts[:-1], ("end", marker)], (*cand.names, f"end={marker}")))
    return out


def _harmony(dialect: HarmonyDialect, message: Mapping[str, Any], finish_reason: str | None,
             out: list[Candidate], end_markers: Sequence[str]) -> list[Candidate]:
    """gpt-oss's readings after the formula (``out``), and ``<|endoftext|>`` as the end
    where the evidence names it (the other ends follow from the message)."""
    empty = dialect.empty_analysis_reading(message, finish_reason)
    if empty is not None:
        out.append(Candidate(empty, ("empty_analysis",)))
    out.extend(Candidate(parts, (name,)) for parts, name in dialect.cut_readings(message, finish_reason))
    for marker in end_markers:
        if marker in dialect.end_tokens:
            continue
        for cand in list(out):
            if cand.parts and cand.parts[-1][0] == "end":
                out.append(Candidate([*cand.parts[:-1], ("end", marker)], (*cand.names, f"end={marker}")))
    return out
