"""The validation gate: every way API text can fail to be the model's own tokens.

Each check returns findings with a stable ``code``; a :class:`Policy` maps codes to
``error`` / ``warning`` (or ``off``). A sample is ``ok`` only with no findings, and
``rejected`` when any finding is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set

from .chat import Dialect, HarmonyDialect, message_reasoning
from .chat.dialect import reasoning_details
from .content import content_text, request_parts
from .evidence import (ENDED, NATIVE_FAILED, LogprobIds, finish_reading, logprobs_cover, malformed, native_finish, no_finish,
                       served_by_vllm, shown_value)
from .jsonl import text_of
from .tokenizer import Tokenizer

__all__ = ["CODES", "DEFAULT_POLICY", "DEFAULT_SEVERITY", "GATE_REVISION", "Finding", "Policy", "SampleView", "ends_turn", "finish_reading",
           "ids_prove", "logprobs_fit",
           "reasoning_count_ways", "reasoning_counts", "reasoning_fits", "run_checks", "status_of",
           "vllm_silent_ids", "vllm_whole_extra"]

#: Changed whenever what reconstruct reads or the gate says of the same input changes. Every
#: stage's fingerprint holds it, so a finished run reconstructs again after an upgrade that
#: would judge its samples differently (the package version moves only with releases).
GATE_REVISION = "2026-12-07.17"

#: Every finding code with its default severity and what it means.
CODES: dict[str, tuple[str, str]] = {
    "eos_in_text": ("error", "end-of-turn marker text inside content/reasoning"),
    "think_marker_in_content": ("error", "<think>/</think> text inside content"),
    "think_marker_in_reasoning": ("error", "<think>/</think> text inside reasoning"),
    "reasoning_missing": ("error", "thinking mode but no reasoning returned: its tokens are lost"),
    "reasoning_unexpected": ("error", "instant mode but reasoning returned"),
    "structured_tool_calls": ("error", "provider parsed tool calls into message.tool_calls: not the raw tokens"),
    "tool_section_in_reasoning": ("error", "tool-call marker text inside reasoning"),
    "tool_markers_malformed": ("error", "unbalanced or out-of-order tool-call markers"),
    "special_token_text": ("error", "other special-token text inside model text"),
    "replacement_char": ("error", "U+FFFD in text: bytes were lost before they reached us"),
    "text_lossy": ("warning", "U+FFFD in text where ground-truth ids hold bytes that are no character: ids exact, text not"),
    "truncated": ("warning", "finish_reason is length (or native_finish_reason admits a cut): no end token; the ids are exact up to the cut"),
    "empty_completion": ("error", "no reasoning, no content, no tool calls"),
    "finish_error": ("error", "the choice ended in an error (finish_reason or native_finish_reason), or the body is an error (choices beside it or not)"),
    "finish_unknown": ("warning", "finish_reason not one of stop/length/tool_calls"),
    "stop_sequence": ("error", "request set `stop`: whether the end token was emitted is unknown"),
    "tool_calls_missing": ("error", "finish_reason is tool_calls but the text holds no tool-call section"),
    "reasoning_conflict": ("error", "message.reasoning and message.reasoning_content disagree"),
    "boundary_unproven": ("error", "no content after the reasoning and no exact usage: whether </think> was emitted is unknown"),
    "tools_declared": ("warning", "request sent `tools` whose declaration the dialect does not reproduce provably (says what)"),
    "template_kwarg_unknown": ("error", "a chat_template_kwargs key the prompt renderer does not apply: the prompt may differ"),
    "media_in_prompt": ("error", "image/audio/video parts in the prompt: their token count is unproven from text"),
    "media_counted": ("warning", "media parts in the prompt; usage.prompt_tokens equals our count, the media are not in the data"),
    "choices_unattributable": ("error", "usage counts all choices together and another choice has findings"),
    "usage_missing": ("warning", "response has no usage to check the counts against"),
    "usage_prompt_mismatch": ("error", "our prompt token count differs from usage.prompt_tokens"),
    "usage_completion_mismatch": ("error", "our completion token count differs from usage.completion_tokens"),
    "roundtrip_mismatch": ("error", "decode(ids) differs from the text"),
    "native_mismatch": ("error", "ids differ from the ground-truth ids"),
    "end_token_mismatch": ("error", "matched_stop names another end token than the one the ids end with"),
    "reasoning_redacted": ("error", "reasoning_details holds a summary or encrypted reasoning: not the model's own text"),
    "logprobs_mismatch": ("error", "ids differ from the ids the response's logprobs name"),
    "logprobs_unreadable": ("warning", "logprobs present but not mappable to token ids; not used as evidence"),
    "evidence_malformed": ("warning", "an optional evidence field (reasoning_tokens, cached_tokens, matched_stop, stop_reason, native_finish_reason) holds a value no engine writes; not used as evidence"),
    "usage_reasoning_mismatch": ("error", "usage's reasoning_tokens fits no way engines count our reasoning segment"),
    "reconstruction_ambiguous": ("error", "the response fits several native sequences and no evidence picks one"),
    "held_tail_unproven": ("warning", "streamed: text a parser holds back at the end may be missing, at the same count"),
    "tool_text_unproven": ("warning", "tools sent, maybe streamed, no ids or logprobs: the tool parser deletes tool-marker text from the content it passes on, which the count can miss"),
    "provider_strips_whitespace": ("warning", "across the run this provider's text never keeps edge whitespace: it strips, which can keep the count"),
    "provider_edits_text": ("warning", "tokenbridge probe found this provider edits text in a way that can keep the token count"),
    "completion_unproven": ("error", "unknown family (chat template only): the completion's end and think markers are guessed"),
    "tool_markers_dropped": ("error", "tool-call markup whose special tokens the provider dropped: the section cannot be rebuilt"),
    "harmony_message_lost": ("error", "gpt-oss: a harmony message the serving parser dropped or merged (tool call at a trimmed <|call|>, preamble, joined analysis): cannot be rebuilt"),
    "prompt_date_unproven": ("error", "gpt-oss: the prompt prints the serving day and the exchange's timing admits several (or none) that no evidence tells apart"),
    "prompt_reading_unproven": ("error", "engines render this request differently (SGLang's tool dump, its last-assistant handling) and no evidence tells which prompt was served"),
}

DEFAULT_SEVERITY: dict[str, str] = {code: sev for code, (sev, _) in CODES.items()}
_SEVERITIES = ("error", "warning", "off")
_KNOWN_FINISH = {"stop", "length", "tool_calls", "eos", "end_turn"}


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str
    message: str

    def to_dict(self) -> dict[str, str]:
        # a message may quote the record's text: a lone surrogate there (valid JSON, not
        # text) is written as its escape, so every output (Parquet too) can hold the row
        return {"code": self.code, "severity": self.severity, "message": text_of(self.message)}


@dataclass(frozen=True)
class Policy:
    """Severity per code (on top of :data:`DEFAULT_SEVERITY`) and the usage tolerance."""

    severities: Mapping[str, str] = field(default_factory=dict)
    usage_tolerance: int = 0

    def __post_init__(self) -> None:
        for code, sev in self.severities.items():
            if code not in CODES:
                raise ValueError(f"unknown finding code {code!r}")
            if sev not in _SEVERITIES:
                raise ValueError(f"severity for {code} must be one of {_SEVERITIES}, not {sev!r}")
        if self.usage_tolerance < 0:
            raise ValueError("usage_tolerance must be >= 0")

    def severity(self, code: str) -> str:
        return self.severities.get(code, DEFAULT_SEVERITY[code])


#: The policy of a run that sets none (one instance: a record's checks need not build one).
DEFAULT_POLICY = Policy()


def status_of(findings: Iterable[Finding]) -> str:
    findings = list(findings)
    if any(f.severity == "error" for f in findings):
        return "rejected"
    return "flagged" if findings else "ok"


@dataclass
class SampleView:
    """What the gate looks at for one choice (built by ``reconstruct``)."""

    tokenizer: Tokenizer
    dialect: Dialect
    request: Mapping[str, Any]
    choice: Mapping[str, Any]
    thinking: bool
    prompt_text: str
    prompt_ids: Sequence[int]
    parts: Sequence[tuple[str, str]]
    part_ids: Sequence[Sequence[int]]
    completion_ids: Sequence[int]
    #: (our count, usage count) pairs, already summed over choices where usage is per response
    usage_prompt: tuple[int, int] | None
    usage_completion: tuple[int, int] | None
    native_prompt: Sequence[int] | None = None
    native_completion: Sequence[int] | None = None
    #: ids named by ``logprobs.content`` (None: the choice has no logprobs)
    logged: LogprobIds | None = None
    #: SGLang's ``matched_stop``: stop id or stop string
    matched_stop: int | str | None = None
    #: ``usage...reasoning_tokens`` (with n > 1 choices, their sum)
    reasoning_tokens: int | None = None
    #: With n > 1 choices, the sums ``reasoning_tokens`` may take over all the chosen readings
    #: (:func:`reasoning_count_ways`, each engine's way); None for one choice (its own parts say)
    reasoning_allowed: frozenset[int] | None = None
    #: (edit, where it was found: "run" or "probe") for this sample's provider
    provider_edits: Sequence[tuple[str, str]] = ()
    #: the provider's count calibration, in words, when one applies
    calibration: str | None = None
    #: per part, whether :meth:`Tokenizer.encode_checked` found its text free of marker
    #: text (its ids then hold no marker id); empty: unknown, the gate tests each text
    part_marker_free: Sequence[bool] = ()
    #: whether the response came as a stream (None: the record does not say)
    streamed: bool | None = None
    #: the response's ``usage`` object (None: it has none), for its optional fields
    usage: Mapping[str, Any] | None = None

    @property
    def proven_by_ids(self) -> bool:
        """Ground-truth ids (native or logprobs) cover the whole completion and agree."""
        return ids_prove(self.native_completion, self.logged, self.parts, self.part_ids, self.completion_ids)

    @cached_property
    def message(self) -> Mapping[str, Any]:
        return self.choice.get("message") or self.choice.get("delta") or {}


def run_checks(view: SampleView, policy: Policy | None = None) -> list[Finding]:
    policy = policy or DEFAULT_POLICY
    raw: list[tuple[str, str]] = []
    for check in _CHECKS:
        raw.extend(check(view, policy))
    out = []
    for code, message in raw:
        sev = policy.severity(code)
        if sev != "off":
            out.append(Finding(code, sev, message))
    return out


# --- individual checks: each yields (code, message) -------------------------------------

#: What a check yields: (finding code, message); the policy gives it its severity.
_Hit = tuple[str, str]


def _text_fields(view: SampleView) -> list[tuple[str, str]]:
    msg = view.message
    out = []
    reasoning = message_reasoning(msg)
    if reasoning:
        out.append(("reasoning", reasoning))
    content = content_text(msg.get("content"))  # a list of text parts too: what was encoded
    if content:
        out.append(("content", content))
    return out


def _finish(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    said = view.choice.get("finish_reason")
    reason = finish_reading(view.choice)
    native = view.choice.get("native_finish_reason")  # quoted only where it is one of the short names below
    if view.choice.get("error") or reason == "error":
        err = view.choice.get("error")
        detail = f": {err.get('message', err)}" if isinstance(err, Mapping) else ""
        yield "finish_error", f"finish_reason={reason!r}{detail}"
    elif no_finish(reason) or reason == "content_filter":  # "" too: no finish, as null
        yield "finish_error", f"finish_reason={reason!r}: the choice did not finish normally"
    elif reason in ENDED and native_finish(view.choice) in NATIVE_FAILED:
        yield "finish_error", f"finish_reason={reason!r} but native_finish_reason={native!r}: the provider says the choice failed"
    elif reason == "length" and said != "length":
        yield "truncated", f"finish_reason={said!r} but native_finish_reason={native!r}: the provider says it cut the answer, so no end token appended"
    elif reason == "length":
        yield "truncated", "finish_reason='length': no end token appended"
    elif reason not in _KNOWN_FINISH:
        yield "finish_unknown", f"finish_reason={reason!r}"
    stop = view.request.get("stop") or (view.request.get("extra_body") or {}).get("stop")
    if stop and reason in ("stop", "eos", "end_turn"):
        yield "stop_sequence", f"request stop={stop!r}; the end token was assumed"
    elif isinstance(view.matched_stop, str) and reason != "length":
        yield "stop_sequence", f"matched_stop={view.matched_stop[:40]!r}: a stop string ended the choice, not the model's end token"
    if isinstance(view.matched_stop, int) and ends_turn(view.parts) and view.completion_ids and view.completion_ids[-1] != view.matched_stop:
        tok = view.tokenizer
        name = tok.marker_ids.get(view.matched_stop)
        yield "end_token_mismatch", (
            f"matched_stop is id {view.matched_stop}{f' ({name})' if name else ''}, a stop id the dialect does not end "
            f"turns with; the ids end with {view.completion_ids[-1]}"
        )
    if reason == "tool_calls" and not view.message.get("tool_calls") and not any(k == "tool_calls" for k, _ in view.parts):
        yield "tool_calls_missing", "finish_reason='tool_calls' but no tool-call section in content and no message.tool_calls"


def _reasoning_presence(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    msg = view.message
    has_reasoning = any(k == "reasoning" for k, _ in view.parts)
    content = any(k in ("content", "tool_calls") for k, _ in view.parts)
    if not has_reasoning and not content and not msg.get("tool_calls"):
        yield "empty_completion", "no reasoning, no content and no tool calls"
        return
    if (view.thinking and view.dialect.think_close and not has_reasoning and not _empty_block_proven(view, policy)
            and not _no_analysis_proven(view, policy)):
        yield "reasoning_missing", "thinking mode but the response has no reasoning: its tokens would be lost"
    if not view.thinking and has_reasoning:
        yield "reasoning_unexpected", "instant mode (thinking disabled) but the response carries reasoning"
    a, b = msg.get("reasoning"), msg.get("reasoning_content")
    if isinstance(a, str) and isinstance(b, str) and a and b and a != b:
        yield "reasoning_conflict", f"reasoning ({len(a)} chars) and reasoning_content ({len(b)} chars) differ"
    details, redacted = reasoning_details(msg)
    plain = a if isinstance(a, str) and a else b if isinstance(b, str) and b else None
    if details is not None and plain is not None and details != plain:
        n = next((i for i, (x, y) in enumerate(zip(details, plain)) if x != y), min(len(details), len(plain)))
        yield "reasoning_conflict", (
            f"reasoning ({len(plain)} chars) and the joined reasoning_details text ({len(details)} chars) "
            f"differ from char {n}"
        )
    if redacted:
        kinds = ", ".join(sorted(set(redacted)))
        yield "reasoning_redacted", (
            f"reasoning_details holds {len(redacted)} {kinds} entr{'y' if len(redacted) == 1 else 'ies'}: "
            "a summary or an encrypted blob is not the text the model emitted, so its tokens are unknown"
        )
    if view.thinking and has_reasoning and not content and not msg.get("tool_calls"):
        # ids that cover the completion prove where the reasoning ended as well as a count does
        exact = view.proven_by_ids or (view.usage_completion is not None and policy.usage_tolerance == 0)
        if not exact:
            closed = any(k == "think_end" for k, _ in view.parts)
            yield "boundary_unproven", (
                f"content is empty: {'assumed' if closed else 'assumed no'} </think> after the reasoning, "
                "and no exact usage count proves it"
            )


def _empty_block_proven(view: SampleView, policy: Policy) -> bool:
    """The reasoning is empty, not lost: the ids close an empty think block and ground-truth
    ids or an exact usage count agree with them (reasoning a provider withheld would be
    counted, and a turn without the block counts fewer). A tool section the model opened
    right away, never closing the block (``no_think_close``: SGLang's and vLLM's Kimi parsers
    end the reasoning at the section, and serve none), is proven the same way: the formula's
    ``</think>`` would count one more."""
    if not any(kind in ("think_end", "tool_calls") for kind, _ in view.parts):
        return False
    return view.proven_by_ids or _count_exact(view, policy)


def _count_exact(view: SampleView, policy: Policy) -> bool:
    """Usage's completion count is ours exactly, with no tolerance."""
    pair = view.usage_completion
    return pair is not None and policy.usage_tolerance == 0 and pair[0] == pair[1]


def _no_analysis_proven(view: SampleView, policy: Policy) -> bool:
    """gpt-oss wrote no analysis message at all (harmony makes it optional): the completion's
    own ids say so, or logprobs spell every id and an exact usage count agrees (an analysis a
    provider withheld would be counted; logprobs of the final text alone would fit too)."""
    if not isinstance(view.dialect, HarmonyDialect) or not view.proven_by_ids:
        return False
    return view.native_completion is not None or _count_exact(view, policy)


def _structured_tools(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    calls = view.message.get("tool_calls")
    if calls:
        n = len(calls) if isinstance(calls, list) else 1
        yield "structured_tool_calls", (
            f"{n} tool call(s) in message.tool_calls: the provider parsed the markers; "
            "send no `tools` to get them as raw text"
        )


def _marker_text(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    """Marker ids inside text parts, found from the encoded ids (text → id is exact)."""
    tok, d = view.tokenizer, view.dialect
    if not d.completion_proven:
        yield "completion_unproven", (
            f"{d.name}: a chat template without a known family; the end token {d.end_token!r} and the think "
            "markers are taken from the tokenizer, not from the engines' parsers"
        )
    tm = d.tool_markers
    text = content_text(view.message.get("content"))
    if tm is not None and tm.token is not None and tm.section_begin.replace(tm.token, "") in text:
        yield "tool_markers_dropped", (
            f"content holds {tm.section_begin.replace(tm.token, '')!r}: the tool-call markup without its {tm.token!r} "
            "special tokens (skip_special_tokens dropped them); the section cannot be rebuilt"
        )
    names = tok.marker_ids
    if not names:
        return
    markers = names.keys()
    if text and text.endswith(d.end_tokens):
        leaked = next(e for e in d.end_tokens if text.endswith(e))
        yield "eos_in_text", f"content ends with {leaked!r} text (leaked); taken as the end token, not doubled"
    free = view.part_marker_free or [tok.marker_free(t) for _, t in view.parts]
    for (kind, part_text), ids, clear in zip(view.parts, view.part_ids, free):
        if kind not in ("reasoning", "content", "tool_calls") or clear or markers.isdisjoint(ids):
            continue
        think = {d.think_open, d.think_close} - {None}
        tool = set(d.tool_markers.all) if d.tool_markers else set()
        found = [(pos, names[i]) for pos, i in enumerate(ids) if i in markers]
        where = "reasoning" if kind == "reasoning" else "content"
        for code, hits in _classify(found, kind, d.eos_markers, think, tool).items():
            shown = ", ".join(f"{t!r}@{p}" for p, t in hits[:5])
            more = f" (+{len(hits) - 5} more)" if len(hits) > 5 else ""
            yield code, f"{len(hits)} marker(s) in {where}: {shown}{more}"
        if kind == "tool_calls":
            cut = finish_reading(view.choice) == "length" and (kind, part_text) == tuple(view.parts[-1])
            problem = _tool_grammar([t for _, t in found if t in tool], d, part_text, cut=cut)
            if problem:
                yield "tool_markers_malformed", problem


def _classify(found: Iterable[tuple[int, str]], kind: str, eos: Set[str], think: Set[str | None], tool: Set[str],
              ) -> dict[str, list[tuple[int, str]]]:
    out: dict[str, list[tuple[int, str]]] = {}
    for pos, text in found:
        if text in eos:
            code = "eos_in_text"
        elif text in think:
            code = "think_marker_in_reasoning" if kind == "reasoning" else "think_marker_in_content"
        elif text in tool:
            if kind == "tool_calls":
                continue  # checked by the grammar
            code = "tool_section_in_reasoning" if kind == "reasoning" else "tool_markers_malformed"
        else:
            code = "special_token_text"
        out.setdefault(code, []).append((pos, text))
    return out


def _tool_grammar(seq: list[str], d: Dialect, text: str = "", cut: bool = False) -> str | None:
    """``section_begin unit* section_end`` with at least ``min_units`` units, as the
    dialect's :class:`ToolMarkers` describe it (Kimi: ``section_begin (call_begin
    argument_begin call_end)+ section_end``); a text-delimited section (``tm.token``)
    must be closed by its end text (the markers inside are checked by ``_classify``).
    With ``cut`` (a length cut inside the section) any prefix of that is well formed:
    the model was stopped."""
    tm = d.tool_markers
    assert tm is not None
    if tm.token is not None:
        if not text.endswith(tm.section_end) and not cut:
            return f"tool section not closed by {tm.section_end!r}"
        return None if seq or cut else "tool section holds no tool-call marker"
    unit = tm.repeated
    seq = [m for m in seq if m not in tm.optional]
    if not seq or seq[0] != tm.section_begin:
        return "tool section does not start with the section marker"
    closed = len(seq) >= 2 and seq[-1] == tm.section_end
    if not closed and not cut:
        return f"tool section not closed by {tm.section_end!r}"
    body = seq[1:-1] if closed else seq[1:]
    if closed and not body and tm.min_units:
        return "tool section holds no tool call"
    bad = bool(body) if not unit else any(body[i] != unit[i % len(unit)] for i in range(len(body)))
    if closed and unit:
        bad = bad or bool(len(body) % len(unit)) or len(body) < tm.min_units * len(unit)
    if bad:
        return "tool-call markers out of order: " + " ".join(s.strip("<|>") for s in seq)
    return None


def _tools(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    tools = view.request.get("tools")
    if not tools:
        return
    unproven = view.dialect.tools_unproven
    why = unproven(tools) if unproven is not None else (
        f"the built-in {view.dialect.name} dialect's tool declaration is not verified against its template"
    )
    if why:
        yield "tools_declared", f"{len(tools)} tool(s): {why}; prompt ids may differ even when the count matches"


#: Keys :func:`thinking_enabled` reads from ``extra_body.chat_template_kwargs``.
_THINKING_KEYS = frozenset({"thinking", "enable_thinking"})


def _template_kwargs(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    known = view.dialect.template_kwargs
    top = view.request.get("chat_template_kwargs")
    if isinstance(top, Mapping) and known is not None:
        for key in sorted(set(top) - known):
            yield "template_kwarg_unknown", (
                f"chat_template_kwargs.{text_of(str(key))} is not rendered by the built-in {view.dialect.name} dialect "
                f"(it renders {', '.join(sorted(known))})"
            )
        if "preserve_thinking" in known and "preserve_thinking" in top and not isinstance(top["preserve_thinking"], bool):
            yield "template_kwarg_unknown", f"chat_template_kwargs.preserve_thinking={top['preserve_thinking']!r} is not a boolean"
    extra = view.request.get("extra_body")
    nested = extra.get("chat_template_kwargs") if isinstance(extra, Mapping) else None
    if isinstance(nested, Mapping):
        for key in sorted(set(nested) - _THINKING_KEYS):
            yield "template_kwarg_unknown", (
                f"extra_body.chat_template_kwargs.{text_of(str(key))} never reaches the prompt renderer "
                "(only the thinking switch is read there)"
            )


#: Content-part keys that carry media rather than text.
_MEDIA_KEYS = ("image", "image_url", "input_image", "video", "video_url", "audio", "input_audio", "audio_url", "file")


def media_parts(request: Mapping[str, Any]) -> dict[str, int]:
    """Media content parts in a request's messages, counted by kind (type or key)."""
    counts: dict[str, int] = {}
    for part in request_parts(request):
        kind = part.get("type")
        if kind in (None, "text"):
            kind = next((k for k in _MEDIA_KEYS if part.get(k)), None)
        if kind is not None:
            counts[str(kind)] = counts.get(str(kind), 0) + 1
    return counts


def _media(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    counts = media_parts(view.request)
    if not counts:
        return
    what = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
    usage = view.usage_prompt
    if usage is not None and usage[0] == usage[1]:
        yield "media_counted", (
            f"prompt carries {what} part(s); usage.prompt_tokens ({usage[1]}) equals our count, "
            "but the media bytes are not in the data"
        )
    else:
        shown = "no usage" if usage is None else f"ours {usage[0]}, usage {usage[1]}"
        yield "media_in_prompt", (
            f"prompt carries {what} part(s): the serving side expands each to a media-dependent number of "
            f"tokens that text cannot prove ({shown})"
        )


def _replacement(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    """U+FFFD in the served text: bytes lost on the way, unless ground-truth ids prove the
    completion. Their bytes then either hold the character itself (the model wrote U+FFFD:
    nothing lost) or the bytes the text lost (a cut inside a character): the ids are exact
    and only the text is not (``text_lossy``)."""
    for name, text in _text_fields(view):
        n = text.count("\ufffd")
        if not n:
            continue
        where = f"{n} U+FFFD in {name} (first at char {text.index(chr(0xFFFD))})"
        if not view.proven_by_ids:
            yield "replacement_char", where
        elif _spells_other_bytes(view):
            yield "text_lossy", (f"{where}: the ground-truth ids hold bytes that are no UTF-8 character there; the ids "
                                 "are exact, the text cannot spell them (formats trained from text leave the row out)")


def _spells_other_bytes(view: SampleView) -> bool:
    """Whether the completion ids spell other bytes than its parts' text (the ids' bytes
    are then the text's with broken sequences where the text has U+FFFD)."""
    text = "".join(t for _, t in view.parts).encode("utf-8", errors="surrogatepass")
    return view.tokenizer.decode_bytes(view.completion_ids) != text


def _roundtrip(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    """decode(ids) must give the text back byte for byte.

    A byte-level BPE with no normaliser (``tokenizer.lossless``, the tiktoken layout)
    round-trips every UTF-8-encodable string by construction, so there the check is
    whether the text is valid UTF-8 (lone surrogates are not, and get replaced when
    encoded); other tokenizers are decoded and compared.
    """
    tok = view.tokenizer
    for what, texts, ids in (
        ("completion", [t for _, t in view.parts], view.completion_ids),
        ("prompt", [view.prompt_text], view.prompt_ids),
    ):
        if tok.lossless and _all_utf8(texts):
            continue
        expected = "".join(texts).encode("utf-8", errors="surrogatepass")
        got = tok.decode_bytes(ids)
        if got != expected and not (what == "completion" and view.proven_by_ids
                                    and got.decode("utf-8", "replace") == "".join(texts)):  # text_lossy's case
            yield "roundtrip_mismatch", f"{what}: {_first_diff(got, expected)}"


def _all_utf8(texts: Iterable[str]) -> bool:
    """Whether every text is valid UTF-8 (no lone surrogate). Each is tested alone, not
    joined: a string tiktoken has encoded keeps its UTF-8 form, so the test is a copy."""
    try:
        for text in texts:
            if not text.isascii():  # an ASCII string (a flag CPython keeps) is valid UTF-8 as it is
                text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_diff(got: bytes, expected: bytes) -> str:
    n = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    return f"decoded {len(got)} bytes vs text {len(expected)} bytes, first difference at byte {n}: {got[n:n + 12]!r} vs {expected[n:n + 12]!r}"


def _usage(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    missing = [what for what, pair in (("prompt_tokens", view.usage_prompt), ("completion_tokens", view.usage_completion))
               if pair is None]
    if missing:  # absent, or a value no engine writes (a string, -1, past 64 bits), said as it is
        usage = view.usage if isinstance(view.usage, Mapping) else {}
        absent = [key for key in missing if usage.get(key) is None]
        said = [f"usage has no integer {' / '.join(absent)}"] if absent else []
        said += [f"usage.{key} is {shown_value(usage[key])}, not a count" for key in missing if key not in absent]
        yield "usage_missing", f"{'; '.join(said)}: that count is not checked"
    tol = policy.usage_tolerance
    for code, pair, what in (
        ("usage_prompt_mismatch", view.usage_prompt, "prompt"),
        ("usage_completion_mismatch", view.usage_completion, "completion"),
    ):
        if pair is None:
            continue
        ours, theirs = pair
        if abs(ours - theirs) > tol:
            cal = f"; calibrated for this provider: {view.calibration}" if view.calibration else ""
            yield code, f"{what}: ours {ours}, usage {theirs} (delta {ours - theirs:+d}, tolerance {tol}{cal})"


def _evidence_fields(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    for fault in malformed(view.choice, view.usage):
        yield "evidence_malformed", f"{fault}: read as absent"


def _native(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    tok = view.tokenizer
    for what, ours, native in (
        ("prompt", view.prompt_ids, view.native_prompt),
        ("completion", view.completion_ids, view.native_completion),
    ):
        if native is None or list(ours) == list(native):
            continue
        unknown = tok.unknown_id(native)
        if unknown is not None:  # the ground truth names an id this tokenizer lacks: not this model's tokenizer
            yield "native_mismatch", (
                f"{what}: native id {unknown[1]} at {unknown[0]} is no token of this tokenizer "
                f"({tok.name}, ids 0 to {tok.vocab_size - 1}): the ground truth contradicts the tokenizer"
            )
            continue
        n = next((i for i, (a, b) in enumerate(zip(ours, native)) if a != b), min(len(ours), len(native)))
        same_text = tok.decode_bytes(native) == tok.decode_bytes(ours)
        a = ours[n] if n < len(ours) else None
        b = native[n] if n < len(native) else None
        kind = "same text, non-canonical tokenization by the model" if same_text else "text differs"
        yield "native_mismatch", (
            f"{what}: first divergence at {n} (ours {a}, native {b}); {len(ours)} vs {len(native)} ids; {kind}"
        )


def ends_turn(parts: Sequence[tuple[str, str]]) -> bool:
    """Whether a completion ends with its end token (a length cut has none)."""
    return bool(parts) and parts[-1][0] == "end"


def ids_prove(native: Sequence[int] | None, logged: LogprobIds | None, parts: Sequence[tuple[str, str]],
              part_ids: Sequence[Sequence[int]], completion_ids: Sequence[int]) -> bool:
    """Whether ground-truth ids (``native``, else logprobs) cover this whole completion and
    agree with it: every id, or every id but the end token."""
    if native is not None:
        return list(native) == list(completion_ids)
    if logged is not None and logged.ids is not None and not logged.unknown:
        return logprobs_fit(logged, parts, part_ids, completion_ids) in ("all", "all_but_end")
    return False  # an unknown logged id proves its place no better than a count


def logprobs_fit(logged: LogprobIds, parts: Sequence[tuple[str, str]], part_ids: Sequence[Sequence[int]],
                 completion_ids: Sequence[int]) -> str | None:
    """How ``logged`` ids (read: ``logged.ids`` is not None) account for this completion
    (:func:`.evidence.logprobs_cover`), its content starting after the think block (after
    the reasoning, where a tool section opened without ``</think>``); None when they
    contradict it."""
    assert logged.ids is not None
    start = pos = opened = 0
    for k, ((kind, _), ids) in enumerate(zip(parts, part_ids)):
        pos += len(ids)
        if kind == "think_end":
            start = pos
            break
        # the think block so far, from the first part on (GLM's newline before <think> with it)
        block = kind in ("think_start", "reasoning") or (k == 0 and kind == "format" and len(parts) > 1
                                                         and parts[1][0] == "think_start")
        if block and opened == pos - len(ids):
            opened = pos
    else:
        start = opened
    return logprobs_cover(logged.ids, completion_ids, start, ends_turn(parts), logged.may_be,
                          runs=logged.runs, spell=logged.spell)


def reasoning_counts(parts: Sequence[tuple[str, str]], part_ids: Sequence[Sequence[int]]) -> set[int]:
    """Every value of ``usage.completion_tokens_details.reasoning_tokens`` an engine
    reports for this completion (:func:`reasoning_count_ways`)."""
    return set(reasoning_count_ways(parts, part_ids))


def reasoning_fits(got: int, parts: Sequence[tuple[str, str]], part_ids: Sequence[Sequence[int]], tok: Tokenizer,
                   streamed: bool | None, choice: Mapping[str, Any]) -> bool:
    """Whether one choice's ``reasoning_tokens`` is what an engine reports for this reading:
    one of :func:`reasoning_count_ways`, or, for a choice vLLM served (:func:`.evidence.
    served_by_vllm`), its count served whole (:func:`vllm_whole_extra`: a turn ended in its
    think block counts its end token) and, where it may have streamed, its streamed count,
    which leaves out each id that completed no character (:func:`vllm_silent_ids`): the
    count of a reasoning with a split CJK character or emoji is otherwise one short per
    split, and the provable sample was rejected. Only there: for any engine, a count one
    short per split fits a reading whose boundary is off by as many ids."""
    ways = reasoning_count_ways(parts, part_ids)
    if got in ways:
        return True
    if not served_by_vllm(choice):
        return False
    if streamed is not True and got == ways[2] + vllm_whole_extra(parts, part_ids):
        return True
    return streamed is not False and got < ways[2] and got == ways[2] - vllm_silent_ids(parts, part_ids, tok.token_bytes)


def vllm_whole_extra(parts: Sequence[tuple[str, str]], part_ids: Sequence[Sequence[int]]) -> int:
    """What vLLM (0.34) counts in ``reasoning_tokens`` of a completion it served whole beyond
    :func:`reasoning_count_ways`' vLLM count: its parser engine reads every output id, the
    end token too, and counts what it reads while the state is still reasoning, so a turn
    that ended inside its think block counts its end token as well (GLM's
    ``\n<think>R<|user|>``: lead, R and the end; streamed, the count stops before the end)."""
    opened = ends_turn(parts) and not any(kind == "think_end" for kind, _ in parts)
    return len(part_ids[-1]) if opened else 0


def vllm_silent_ids(parts: Sequence[tuple[str, str]], part_ids: Sequence[Sequence[int]],
                    token_bytes: Callable[[int], bytes]) -> int:
    """How many of the ids vLLM (0.34) counts as reasoning complete no character of their
    own when served one id a step: its detokenizer holds back text that ends in an
    unfinished UTF-8 sequence, that step's delta is empty, and its streaming parser counts
    the tokens of the text it reads, so such an id is never counted. The ids before
    ``</think>`` are walked in order (the lead a template's frame puts before ``<think>``
    and the reasoning are what vLLM counts); text of ASCII alone is skipped whole."""
    silent, pending, lead = 0, b"", True
    for (kind, text), ids in zip(parts, part_ids):
        if kind == "think_end":
            break
        counted = kind == "reasoning" or (lead and kind == "format")
        lead = lead and kind == "format"
        if not pending and text.isascii():  # each id of ASCII text completes its characters
            continue
        for token in ids:
            # the last character is all the test reads, and it lies in the last 4 bytes
            pending = (pending + token_bytes(token))[-8:]
            if pending.decode("utf-8", "replace").endswith("\ufffd"):
                silent += counted
            else:
                pending = b""
    return silent


def reasoning_count_ways(parts: Sequence[tuple[str, str]], part_ids: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """``reasoning_tokens`` as each kind of engine counts this completion: (the reasoning
    text alone, as OpenRouter-normalised providers count it; SGLang's count; vLLM's).

    SGLang (0.5.23, ``Req.update_reasoning_tokens``) counts every output token up to and
    including ``</think>``, and every token (the end token too) when ``</think>`` never
    came. vLLM's parser engine (0.34) counts the tokens it reads as reasoning: the text
    the model wrote before ``<think>`` too (GLM's newline), the markers not; older vLLM
    counted nothing (0), which is no evidence and is not checked.
    With n > 1 choices an engine reports the sum over them, each counted its one way.
    """
    reasoning = sum(len(ids) for (kind, _), ids in zip(parts, part_ids) if kind == "reasoning")
    lead = 0
    for (kind, _), ids in zip(parts, part_ids):
        if kind != "format":
            break
        lead += len(ids)
    before = 0
    for (kind, _), ids in zip(parts, part_ids):
        before += len(ids)
        if kind == "think_end":
            return reasoning, before, lead + reasoning
    return reasoning, sum(len(ids) for ids in part_ids), lead + reasoning


def _reasoning_count(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    got = view.reasoning_tokens
    if not got or not view.thinking:
        return
    if view.reasoning_allowed is None and reasoning_fits(got, view.parts, view.part_ids, view.tokenizer, view.streamed,
                                                         view.choice):
        return
    allowed = view.reasoning_allowed if view.reasoning_allowed is not None else reasoning_counts(view.parts, view.part_ids)
    if got not in allowed:
        summed = " summed over the choices" if view.reasoning_allowed is not None else ""
        yield "usage_reasoning_mismatch", (
            f"usage reasoning_tokens {got}, ours{summed} {' or '.join(str(n) for n in sorted(allowed))} "
            "(reasoning alone, up to and including </think> as SGLang counts, or with the text before <think> "
            "as vLLM counts): the reasoning/content "
            "boundary or the reasoning text differs from what the model emitted"
        )


def _logprobs(view: SampleView, policy: Policy) -> Iterator[_Hit]:
    logged = view.logged
    if logged is None:
        return
    if logged.ids is None:
        yield "logprobs_unreadable", f"{logged.problem}; logprobs not used as evidence"
        return
    parts, ids = view.parts, view.completion_ids
    ends = ends_turn(parts)
    if logprobs_fit(logged, parts, view.part_ids, ids) is not None:
        return
    # an unknown logged id (UNKNOWN_MARKER / UNKNOWN_PARTIAL) is read as ours to compare the texts
    got = [b if b >= 0 or i >= len(ids) else ids[i] for i, b in enumerate(logged.ids)]
    got = [b for b in got if b >= 0]
    n = next((i for i, (a, b) in enumerate(zip(ids, got)) if a != b), min(len(ids), len(got)))
    tok = view.tokenizer
    same_text = tok.decode_bytes(got) == tok.decode_bytes(ids) or (
        ends and tok.decode_bytes(got) == tok.decode_bytes(ids[:-1]))
    kind = "same text, another tokenization" if same_text else "text differs"
    a = ids[n] if n < len(ids) else None
    b = got[n] if n < len(got) else None
    yield "logprobs_mismatch", (
        f"completion: first divergence at {n} (ours {a}, logprobs {b}); {len(ids)} vs {len(got)} ids; {kind}"
    )


#: Tokens a harmony message costs beyond its text: ``<|end|><|start|>assistant<|channel|>NAME<|message|>``.
_HARMONY_HEADER = 6


def _harmony(view: SampleView, policy: Policy) -> Iterator[tuple[str, str]]:
    """What SGLang's gpt-oss parser loses, and the evidence that shows it: the stop id
    ``<|call|>`` with no tool call in the text (the call was dropped with its trimmed
    stop), or a completion count at least one message header above ours (a preamble
    merged into content, analysis messages joined, a dropped call)."""
    d = view.dialect
    if not isinstance(d, HarmonyDialect):
        return
    has_call = any(kind == "tool_calls" for kind, _ in view.parts)
    call_id = view.tokenizer.markers.get(d.tool_end_token or "")
    if view.matched_stop is not None and view.matched_stop == call_id and not has_call:
        yield "harmony_message_lost", (
            f"matched_stop is {d.tool_end_token} but the text holds no tool call: the serving parser dropped the "
            "commentary tool call whose end it trimmed; its tokens are unknown"
        )
        return
    pair = view.usage_completion
    if pair is not None and pair[1] - pair[0] >= _HARMONY_HEADER and view.calibration is None:
        yield "harmony_message_lost", (
            f"usage counts {pair[1] - pair[0]} more completion tokens than the messages rebuilt from the text: at "
            "least one harmony message is missing (a commentary preamble merged into content, analysis messages "
            "joined, or a tool call dropped at its trimmed <|call|>), and where it stood is unknown"
        )


def _provider_edits(view: SampleView, policy: Policy) -> Iterator[tuple[str, str]]:
    if not view.provider_edits or view.proven_by_ids:
        return
    probed = sorted(edit for edit, source in view.provider_edits if source == "probe")
    if probed:
        yield "provider_edits_text", (
            f"tokenbridge probe found this provider applies {', '.join(probed)} to text: an edit that keeps the "
            "token count passes every other check; only ground-truth ids can prove its samples"
        )
    if ("strip", "run") in view.provider_edits:
        yield "provider_strips_whitespace", (
            "none of this provider's samples in the run keeps leading/trailing whitespace while other providers' "
            "often do: it strips text, and a strip that keeps the token count ('.\\n' -> '.') passes every other check"
        )


_CHECKS = (
    _finish,
    _reasoning_presence,
    _structured_tools,
    _tools,
    _template_kwargs,
    _media,
    _marker_text,
    _replacement,
    _roundtrip,
    _usage,
    _evidence_fields,
    _native,
    _logprobs,
    _reasoning_count,
    _harmony,
    _provider_edits,
)
