"""Rebuild the exact token ids of each API response and run the gate on them.

``reconstruct_record`` turns one exchange record into one row per choice;
``reconstruct_file`` streams a JSONL file through it on all cores (:mod:`.lanes`: each
worker on a stretch of the file; one process for a pipe), in input order, with memory
bounded by the ranges in flight and the results of out-of-order ranges (about one stretch
a worker: JSONL rows wait on disk; Parquet rows in memory, so their stretches are short).
"""

from __future__ import annotations

import io
import functools
import itertools
import multiprocessing as mp
import os
import shutil
import signal
import stat
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence

import orjson

from .chat import Dialect, HarmonyDialect, PromptReading, message_reasoning, resolve_dialect
from .chat.harmony import tool_stream_doubt
from .chat.template import TemplateError, special_token_strings
from .content import content_text
from .checks import (DEFAULT_POLICY, Finding, Policy, SampleView, ends_turn, finish_reading, ids_prove, logprobs_fit, reasoning_count_ways,
                     reasoning_fits, run_checks, status_of, vllm_silent_ids, vllm_whole_extra)
from .evidence import LogprobIds, cached_tokens, is_count, logprob_ids, matched_stop, reasoning_tokens, served_by_vllm
from .exchanges import Exchange, RecordError, choice_index, keys_once, loads_line, parse_exchange, repeated_id
from .jsonl import NotJsonlError, binary_kind, text_of
from .hypotheses import Candidate, candidates, ends_in_think_fits, held_tails
from .traits import CountDelta, ProviderTrait, RecordFacts, TraitStats
from . import fsio, lanes
from .outdir import check_output_file
from .rows import COLUMNS, MARKER_SEGMENTS, JsonlRowSink, ParquetRowSink, encode_lean_row, to_arrow_record, with_derived
from .tokenizer import EncodeError, Tokenizer, load_tokenizer

__all__ = ["RECORD_ERRORS", "BadLine", "ReconstructSummary", "reconstruct_exchange", "reconstruct_file",
           "reconstruct_record"]

#: What one exchange record can cause: a bad shape (:class:`~tokenbridge.exchanges.RecordError`),
#: a chat template that refuses it (:class:`~tokenbridge.chat.template.TemplateError`), text the
#: tokenizer cannot take (:class:`~tokenbridge.tokenizer.EncodeError`). ``reconstruct_file`` reports
#: these as bad lines; anything else is a bug and surfaces with its traceback.
RECORD_ERRORS: tuple[type[Exception], ...] = (RecordError, TemplateError, EncodeError)


def reconstruct_record(
    record: Mapping[str, Any],
    tokenizer: Tokenizer,
    dialect: Dialect | None = None,
    policy: Policy | None = None,
    traits: Mapping[str, ProviderTrait] | None = None,
) -> list[dict[str, Any]]:
    """One reconstructed row per choice of an exchange record (raises RecordError)."""
    return reconstruct_exchange(parse_exchange(record), tokenizer, dialect, policy, traits)


@dataclass
class _Choice:
    """One choice on its way to a row: its evidence and every reading of it."""

    index: int
    choice: Mapping[str, Any]
    native: Sequence[int] | None
    logged: LogprobIds | None
    stop: int | str | None
    cands: list[Candidate]
    cand_ids: list[list[list[int]]]
    #: per candidate, per part: its text holds no marker's text (so its ids hold no marker id)
    cand_free: list[list[bool]]
    chosen: int = 0
    #: names of every candidate the evidence could not rule out, when more than one
    ambiguous: list[str] = field(default_factory=list)
    #: usage leaves out the end token (a provider trait)
    end_uncounted: bool = False
    #: held-tail readings of the same count as the served one, left out (no ids or logprobs
    #: tell them apart): the row says they were possible (``held_tail_unproven``)
    held_ties: list[str] = field(default_factory=list)
    #: (code, why) a content that may have streamed with tools, with no ids or logprobs,
    #: cannot be read from the count: SGLang's tool detector changed it at the same count
    stream_doubt: tuple[str, str] | None = None
    #: a reading the count alone never picks was built (``Candidate.veto``): one that ended
    #: inside its think block, so its count teaches the run traits nothing, as ``end_in_think``'s
    vetoed: bool = False
    #: a reading of the tool section opened without ``</think>`` exactly one id short of
    #: another was built (see :func:`_plans`)
    reads_short: bool = False
    #: candidate -> its completion ids, built once (a reasoning completion is thousands of ids)
    _flat: dict[int, list[int]] = field(default_factory=dict)
    #: with n > 1, every choice of the record vLLM's: its summed ``reasoning_tokens`` may be
    #: vLLM's count served whole (``vllm_whole``), or streamed (``vllm_stream``: the
    #: tokenizer's id -> bytes, to find the ids that complete no character), ways of their own
    vllm_whole: bool = False
    vllm_stream: Callable[[int], bytes] | None = None

    def ids(self, k: int) -> list[int]:
        """Candidate ``k``'s completion ids (one list per candidate: never mutate it)."""
        flat = self._flat.get(k)
        if flat is None:
            flat = self._flat[k] = []
            for part in self.cand_ids[k]:
                flat += part  # a list's own extend: a copy of pointers, no iterator
        return flat

    def ways(self, k: int) -> tuple[int, ...]:
        """Candidate ``k``'s ``reasoning_tokens`` as each kind of engine counts it; with
        ``vllm_whole`` / ``vllm_stream``, vLLM's counts served whole and streamed too
        (:func:`~tokenbridge.checks.vllm_whole_extra`, :func:`~tokenbridge.checks.vllm_silent_ids`)."""
        parts, ids = self.cands[k].parts, self.cand_ids[k]
        ways: tuple[int, ...] = reasoning_count_ways(parts, ids)
        if self.vllm_whole:
            ways = (*ways, ways[2] + vllm_whole_extra(parts, ids))
        if self.vllm_stream is not None:
            ways = (*ways, ways[2] - vllm_silent_ids(parts, ids, self.vllm_stream))
        return ways

    def counted(self, k: int) -> int:
        """How many of candidate ``k``'s ids the provider's usage counts."""
        uncounted = self.end_uncounted and ends_turn(self.cands[k].parts)
        return sum(map(len, self.cand_ids[k])) - uncounted


def reconstruct_exchange(
    ex: Exchange,
    tokenizer: Tokenizer,
    dialect: Dialect | None = None,
    policy: Policy | None = None,
    traits: Mapping[str, ProviderTrait] | None = None,
) -> list[dict[str, Any]]:
    """One row per choice. ``traits`` holds what a whole run showed about each provider
    (count offsets, text edits): see :mod:`tokenbridge.traits`."""
    return [with_derived(row) for row in _reconstruct(ex, tokenizer, dialect, policy, traits)[0]]


def _reconstruct(
    ex: Exchange,
    tokenizer: Tokenizer,
    dialect: Dialect | None,
    policy: Policy | None,
    traits: Mapping[str, ProviderTrait] | None,
) -> tuple[list[dict[str, Any]], RecordFacts]:
    """The rows (without their derived columns, :func:`~tokenbridge.rows.with_derived`), and
    what the record tells run-level detection (:mod:`.traits`)."""
    dialect = dialect or resolve_dialect(tokenizer)
    policy = policy or DEFAULT_POLICY
    request = ex.request
    thinking = dialect.thinking(request)
    response = ex.response
    choices = response.get("choices") or []
    provider = response.get("provider") or ex.meta.get("provider")
    model = response.get("model") or request.get("model")
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else None
    trait = traits.get(str(provider)) if traits else None
    meta = _RowMeta(ex, provider, model, thinking, usage)
    prompt_text, prompt_ids, prompt_name, prompt_doubt, sglang = _prompt(dialect, tokenizer, ex, usage, trait)
    opens = bool(dialect.think_open and prompt_text.endswith(dialect.think_open))
    record_findings: list[Finding] = []  # every row of the record carries these
    if prompt_doubt and policy.severity(prompt_doubt[0]) != "off":
        record_findings.append(Finding(prompt_doubt[0], policy.severity(prompt_doubt[0]), prompt_doubt[1]))

    if not choices:  # an error body: one rejected row that says why
        finding = Finding("finish_error", policy.severity("finish_error"),
                          f"response has no choices: {_error_detail(response.get('error'))}")
        findings = [finding] if finding.severity != "off" else []
        row = _row(meta, choice=0, prompt_ids=prompt_ids, completion_ids=[], segments=[],
                   findings=[*findings, *record_findings], finish_reason=None, reasoning="", content="",
                   reconstruction=prompt_name)
        return [row], RecordFacts(edges=(False,))  # no text served
    if response.get("error") is not None and policy.severity("finish_error") != "off":
        # choices beside an error: what the upstream sent before it failed (cut mid-word under
        # finish_reason "stop"), so every choice is as doubtful as the body says
        record_findings.append(Finding("finish_error", policy.severity("finish_error"),
                                       f"the body is an error beside its choices: {_error_detail(response['error'])}"))

    joins = trait is not None and trait.joins_markers
    prefixed = trait.prefix_in_reasoning if trait is not None else None
    if prefixed is None:  # a prompt only one engine renders: its completion is that engine's too
        prefixed = sglang
    streamed = _streamed(ex)
    plan = functools.partial(_plan, ex=ex, tok=tokenizer, dialect=dialect, thinking=thinking, opens=opens, joins=joins,
                   stream=streamed, prefixed=prefixed, end_counted=trait is not None and trait.end_counted)
    plans = _plans(plan, choices, usage, policy, trait)
    _count_ways(plans, trait, streamed, tokenizer)
    usage_prompt, usage_completion = _usage_pairs(usage, len(prompt_ids), trait)
    single = len(plans) == 1
    reasoning = reasoning_tokens(usage)  # with n > 1, summed over the choices
    if any(len(p.cands) > 1 for p in plans):
        _choose(plans, usage_completion, policy, reasoning, tokenizer, streamed)
    total_completion = sum(p.counted(p.chosen) for p in plans)
    summed_reasoning = None if single else _reasoning_sums([p.ways(p.chosen) for p in plans])
    rows = []
    for p in plans:
        parts, part_ids = p.cands[p.chosen].parts, p.cand_ids[p.chosen]
        completion_ids = p.ids(p.chosen)
        pair = None
        if usage_completion is not None:
            pair = (p.counted(p.chosen) if single else total_completion, usage_completion)
        view = SampleView(
            tokenizer=tokenizer,
            dialect=dialect,
            request=request,
            choice=p.choice,
            thinking=thinking,
            prompt_text=prompt_text,
            prompt_ids=prompt_ids,
            parts=parts,
            part_ids=part_ids,
            part_marker_free=p.cand_free[p.chosen],
            completion_ids=completion_ids,
            usage_prompt=usage_prompt,
            usage_completion=pair,
            native_prompt=ex.native_prompt,
            native_completion=p.native,
            logged=p.logged,
            matched_stop=p.stop,
            reasoning_tokens=reasoning,
            reasoning_allowed=summed_reasoning,
            provider_edits=tuple(zip(trait.edits, trait.edit_sources)) if trait is not None else (),
            calibration=trait.describe() if trait is not None else None,
            streamed=streamed,
            usage=usage,
        )
        findings = [*run_checks(view, policy), *record_findings, *_reading_findings(p, policy)]
        segments = _segments(len(prompt_ids), parts, part_ids)
        index = choice_index(p.choice, p.index)
        reasoning_text, content_text_ = written_text(parts)
        rows.append(_row(meta, choice=index, prompt_ids=prompt_ids, completion_ids=completion_ids, segments=segments,
                         findings=findings, finish_reason=finish_reading(p.choice),
                         reasoning=reasoning_text, content=content_text_,
                         reconstruction=_joined(prompt_name, p.cands[p.chosen].name)))
    if len(rows) > 1 and usage_completion is not None:
        _mark_cancelling(plans, rows, policy, thinking=thinking, opens=opens)
        _mark_siblings(rows, policy)
    markered = [p for p in plans if _has_marker(p.cands[0].parts)]
    reasoned = ([r for p in plans if (r := message_reasoning(p.choice["message"]))]
                if thinking and not opens and dialect.think_open_prefix else [])
    # a choice that may have ended inside its think block: its count is what is in question,
    # so it teaches the count traits nothing; it says the run needs to know whether the end is counted
    unsure = [ends_in_think_fits(p.cands[0].parts, finish_reading(p.choice), thinking, opens) or p.vetoed
              for p in plans]
    unclosed = sum(u and not any("end_in_think" in c.names for c in p.cands) for u, p in zip(unsure, plans))
    facts = RecordFacts(None if any(unsure) else _delta(plans, rows, usage, len(prompt_ids)), len(markered),
                        sum(any("marker_spaces" in c.names for c in p.cands) for p in markered),
                        len(reasoned), sum(r.startswith(dialect.think_open_prefix) for r in reasoned), unclosed,
                        tuple(_served_edge(p.choice["message"]) for p in plans))
    return rows, facts


def _plans(plan: Callable[..., _Choice], choices: Sequence[Mapping[str, Any]], usage: Mapping[str, Any] | None,
           policy: Policy, trait: ProviderTrait | None) -> list[_Choice]:
    """Every choice's readings (``plan(idx, choice, short_ties=...)``). ``short_ties``:
    whether an exact count could take a reading one token short of the formula (a tool
    section opened without ``</think>``) for the formula with its end token uncounted. Only
    while the run has not shown how this provider counts the end, and, with n > 1, while
    every choice that ended has such a reading: an uncounted end takes one off each."""
    short_ties = (usage is not None and is_count(usage.get("completion_tokens")) and policy.usage_tolerance == 0
                  and not (trait is not None and (trait.end_counted or trait.end_uncounted)))
    plans = [plan(idx, choice, short_ties=short_ties) for idx, choice in enumerate(choices)]
    if short_ties and len(plans) > 1 and not all(p.reads_short for p in plans if ends_turn(p.cands[0].parts)):
        # only a choice with such a reading plans otherwise (elsewhere the veto is lifted already)
        plans = [plan(p.index, p.choice, short_ties=False) if p.reads_short else p for p in plans]
    return plans


def _reading_findings(p: _Choice, policy: Policy) -> list[Finding]:
    """What the readings left open: held tails of the served count (a warning: possible,
    never read from the count), and readings the evidence could not tell apart."""
    out = []
    if p.held_ties and policy.severity("held_tail_unproven") != "off":
        held = list(dict.fromkeys(n for name in p.held_ties for n in name.split("+") if n.startswith("tool_start_held=")))
        out.append(Finding("held_tail_unproven", policy.severity("held_tail_unproven"),
                           f"streamed: the parser may have held back text at the end of the content and never sent "
                           f"it; {len(held)} such text(s) ({', '.join(held[:4])}) keep the served count, and no ids "
                           "or logprobs tell them apart"))
    if p.stream_doubt and policy.severity(code := p.stream_doubt[0]) != "off":
        out.append(Finding(code, policy.severity(code), f"tools sent, may have streamed: {p.stream_doubt[1]}; no ids or "
                           "logprobs show what the model wrote"))
    if p.ambiguous and policy.severity("reconstruction_ambiguous") != "off":
        out.append(Finding("reconstruction_ambiguous", policy.severity("reconstruction_ambiguous"),
                           f"the response fits {len(p.ambiguous)} native sequences ({', '.join(p.ambiguous)}) "
                           "and no evidence (usage, logprobs, token ids, stop id) tells them apart"))
    return out


def written_text(parts: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """(reasoning, content) as the model wrote them, from a reading's parts: what a row
    carries beside its ids, so that a conversation re-rendered from it spells those ids.
    The served text may differ (vLLM's join spaces, a leaked end marker, GLM's
    ``"\n<think>"`` in the reasoning): the exchange keeps that. A tool-call section keeps
    the header written just before it (gpt-oss's ``<|start|>assistant...<|message|>``)."""
    reasoning = "".join(text for kind, text in parts if kind == "reasoning")
    content = []
    for k, (kind, text) in enumerate(parts):
        if kind in ("content", "tool_calls") or (kind == "format" and k + 1 < len(parts) and parts[k + 1][0] == "tool_calls"):
            content.append(text)
    return reasoning, "".join(content)


def _served_edge(message: Mapping[str, Any]) -> bool:
    """Whether the served text keeps leading or trailing whitespace (a provider that strips never does)."""
    texts = (message_reasoning(message) or "", content_text(message.get("content")))
    return any(t[:1].isspace() or t[-1:].isspace() for t in texts)


def _error_detail(err: Any) -> str:
    """An error body's words for a finding: its message, else the error as the API gave it."""
    detail = err.get("message", err) if isinstance(err, dict) else err
    return text_of(_shown(detail))


def _shown(value: Any) -> str:
    """``str(value)``, or its type where it nests too deep for ``str`` (which recurses)."""
    try:
        return str(value)
    except RecursionError:
        return f"<{type(value).__name__} nested too deep to show>"


def _prompt(dialect: Dialect, tok: Tokenizer, ex: Exchange, usage: Mapping[str, Any] | None,
            trait: ProviderTrait | None) -> tuple[str, list[int], str | None, tuple[str, str] | None, bool | None]:
    """(prompt text, its ids, the reading's name, (finding code, why) when it is unproven,
    True where the evidence proved the prompt SGLang's, else None).

    One reading when the request fixes the prompt. gpt-oss's prompt also prints the
    serving day: each day the exchange's timing admits is a reading; a request that
    engines render differently (SGLang's tool dump and last-assistant handling) has one
    per engine. A reading is kept when the ground-truth prompt ids or
    ``usage.prompt_tokens`` agree with it."""
    readings = dialect.prompt_readings(ex.request, ex.response, ex.meta)
    if not readings:  # a dialect's contract is one reading at least; a bad line, not an IndexError, if one breaks it
        raise TemplateError(f"{dialect.name}: no prompt reading for this exchange (its timing or request gave none)")
    if len(readings) == 1 and readings[0].name is None:
        text = readings[0].text
        return text, tok.encode_prompt(text), None, None, None
    encoded = [(r, tok.encode_prompt(r.text)) for r in readings]
    keep = encoded
    if ex.native_prompt is not None:
        keep = [(r, ids) for r, ids in keep if ids == list(ex.native_prompt)]
    else:
        pair, _ = _usage_pairs(usage, 0, trait)
        if pair is not None:
            keep = [(r, ids) for r, ids in keep if len(ids) == pair[1]]
    engine = _engine(encoded, keep) if keep else None
    if not keep:  # no reading fits: the first is kept and the mismatch findings say why
        keep = encoded[:1]
    reading, ids = keep[0]
    doubt = None
    # the serving days the kept readings name (gpt-oss: an engine's reading of a day is "date=D+harmony=vllm")
    days = {n for r, _ in keep for n in (r.name or "").split("+") if n.startswith("date=")}
    dated = len(days) > 1
    differ = len({tuple(i) for _, i in keep}) > 1  # the kept readings give different prompt ids
    if "date=unknown" in (reading.name or "").split("+"):
        doubt = ("prompt_date_unproven", "the template prints the serving day and the exchange has no timing (no "
                 "usable response.created or meta.started_at + latency_s): today's date was assumed")
    elif differ and dated:
        doubt = ("prompt_date_unproven", f"the template prints the serving day and the exchange's timing admits "
                 f"{len(keep)} ({', '.join(str(r.name) for r, _ in keep)}) with different prompt ids; no "
                 "ground-truth prompt ids or count tells them apart")
    elif differ:
        doubt = ("prompt_reading_unproven", f"serving engines render this request {len(keep)} ways "
                 f"({', '.join(r.name or 'as sent' for r, _ in keep)}) with different prompt ids; no ground-truth "
                 "prompt ids or count tells them apart")
    return reading.text, ids, reading.name, doubt, engine


#: Prompt readings only SGLang renders (:mod:`.chat.serving`): one proven names the engine.
#: (Parsed arguments alone do not: vLLM 0.34 parses them too.)
_SGLANG_READINGS = frozenset({"tools=sglang", "last_assistant=user", "user_name=dropped", "tool_parts=space",
                              "parts=space"})


def _engine(encoded: Sequence[tuple[PromptReading, list[int]]], keep: Sequence[tuple[PromptReading, list[int]]],
            ) -> bool | None:
    """True where the evidence that kept ``keep`` proved the prompt SGLang's (only its
    readings fit), else None: the completion then comes from SGLang too (GLM's forms)."""
    def sglang(r: PromptReading) -> bool:
        return bool(set((r.name or "").split("+")) & _SGLANG_READINGS)

    kept, dropped = {sglang(r) for r, _ in keep}, {sglang(r) for r, _ in encoded if all(r is not k for k, _ in keep)}
    # only SGLang is proven so: a prompt rendered as sent may be another SGLang version's, whose
    # completion forms are still SGLang's (a cold review)
    return True if kept == {True} and False in dropped else None


def _joined(*names: str | None) -> str | None:
    kept = [n for n in names if n]
    return "+".join(kept) if kept else None


def _has_marker(parts: Sequence[tuple[str, str]]) -> bool:
    """Whether the served text of these parts holds marker text (so vLLM's joins show)."""
    return any(kind in ("think_end", "tool_calls") for kind, _ in parts)


#: The only errors a calibrating sample may carry: the count mismatches themselves.
_COUNT_CODES = frozenset({"usage_prompt_mismatch", "usage_completion_mismatch", "usage_reasoning_mismatch"})


def _delta(plans: list[_Choice], rows: list[dict[str, Any]], usage: Mapping[str, Any] | None,
           n_prompt: int) -> CountDelta | None:
    if len(plans) != 1 or usage is None or not _count_reading(plans[0]):
        return None
    if any(f["severity"] == "error" and f["code"] not in _COUNT_CODES for f in rows[0]["findings"]):
        return None
    p = plans[0]
    parts = p.cands[0].parts
    completion = usage.get("completion_tokens")
    prompt = usage.get("prompt_tokens")
    return CountDelta(
        ended=ends_turn(parts),
        completion=len(p.ids(0)) - completion if is_count(completion) else None,
        prompt=n_prompt - prompt if is_count(prompt) else None,
        cached=cached_tokens(usage),
    )


def _count_reading(p: _Choice) -> bool:
    """Whether a run's count traits may learn this choice's offset from its formula (reading
    0): its only reading, readings all as long as it (and ending alike), or one the evidence
    picked whose other readings are all a cut right after ``</think>`` or a held tail
    (``tool_start_held``; ids or logprobs keep every one of them). Cut samples are what tells an uncounted
    end token from an offset with no known cause (the end token is in no cut), so leaving
    every thinking cut out once that reading existed let a +1 offset on every sample pass
    as the end token (a suite test caught it)."""
    if len(p.cands) == 1:
        return True
    n, ended = len(p.ids(0)), ends_turn(p.cands[0].parts)
    if all(len(p.ids(k)) == n and ends_turn(p.cands[k].parts) == ended for k in range(1, len(p.cands))):
        return True  # readings of one length (GLM's newline streamed by either engine): the offset is theirs alike
    return p.chosen == 0 and not p.ambiguous and all(c.names == ("cut_after_think_close",) or c.held
                                                      for c in p.cands[1:])


def _streamed(ex: Exchange) -> bool | None:
    """Whether the response came as a stream (the request's flag, or generate's
    ``meta.stream``); None when the record does not say. Engines split some text
    differently streamed (GLM's newline before ``<think>``)."""
    for flag in (ex.request.get("stream"), ex.meta.get("stream")):
        if isinstance(flag, bool):
            return flag
    return None


def _spelled(tok: Tokenizer, dialect: Dialect, native: Sequence[int] | None, logged: LogprobIds | None) -> str | None:
    """The completion text the ground-truth ids (else the logprobs) spell, for a family whose
    vLLM parser strips the reasoning's end (so the whitespace it stripped can be read); None
    where no other family's reading needs it or an id is not known."""
    if not (dialect.vllm_joins or dialect.reasoning_end_stripped):
        return None
    ids = native if native is not None else logged.ids if logged is not None else None
    if not ids or min(ids) < 0 or tok.unknown_id(ids) is not None:
        return None
    return tok.decode_bytes(list(ids)).decode("utf-8", "replace")


def _plan(idx: int, choice: Mapping[str, Any], ex: Exchange, tok: Tokenizer, dialect: Dialect, *,
          thinking: bool, opens: bool, joins: bool, stream: bool | None = None,
          prefixed: bool | None = None, end_counted: bool = False, short_ties: bool = True) -> _Choice:
    """``end_counted``: the run proved the provider's usage counts the end token; ``short_ties``:
    a reading one token short of the formula may tie it by the count (see :func:`_plans`)."""
    message = choice["message"]
    finish = finish_reading(choice)
    native = ex.native_choices[idx] if idx < len(ex.native_choices) else None
    logged = logprob_ids(tok, choice)
    stop = matched_stop(choice)
    ends = _named_ends(tok, dialect, finish, stop, logged, native)
    ends += [m for m in _unnamed_eos(tok, dialect, choice, finish, stop) if m not in ends]
    # readings one token from the formula that a count alone cannot prove: a turn ended inside
    # its think block (one short, as an uncounted end token is; or the run proved the end is
    # counted) and a cut right after </think> (one more, as vLLM's held-back partial character is)
    # (logprobs whose markers are all known tell these apart: the readings differ by a marker only)
    # (logprobs of the end token alone, or none, tell nothing apart: logprobs_cover's "none")
    by_ids = native is not None or (logged is not None and logged.markers_known and len(logged.ids or ()) > 1)
    tools_streamed = stream is not False and _sends_tools(ex.request)
    holds = tools_streamed or (stream is not False and not dialect.stream_held_needs_tools)
    # without ids or logprobs, only a record that says it streamed keeps (to report) a held
    # tail: elsewhere those readings would be built, a copy of the content each, and dropped
    kept_held = holds and (by_ids or stream is True)
    held = held_tails(dialect.stream_held_starts, dialect.stream_held_min) if kept_held else ()
    # gpt-oss: what SGLang's tool detector did to a final text only ids or logprobs can say
    cands = candidates(dialect, message, finish, thinking, opens, ends, joins_markers=joins, stream=stream,
                       prefix_in_reasoning=prefixed, end_in_think=by_ids or end_counted, cut_after_close=by_ids,
                       prefix_absent=by_ids, held=held, tools_streamed=tools_streamed and by_ids,
                       stripped_by_ids=by_ids, spelled=_spelled(tok, dialect, native, logged) if by_ids else None,
                       short_ties=short_ties and native is None)
    if not by_ids and stream is not True:  # nothing could keep or report a held tail (none built above: a guard)
        cands = [c for c in cands if not c.held]
    if by_ids and tools_streamed and len(cands) > 1:
        cands = _spelled_resent(tok, cands, native if native is not None else (logged.ids if logged else None))
    doubt = (_stream_doubt(dialect, content_text(message.get("content")), stream is True)
             if tools_streamed and not by_ids else None)
    if len(cands) == 1:  # the common case: one reading, each part encoded as it is
        ids_1, free_1 = _encode_parts(tok, cands[0].parts, None)
        cands, cand_ids, cand_free = _lossy_from_truth(tok, cands, [ids_1], [free_1], native, logged)
        return _Choice(idx, choice, native, logged, stop, cands, cand_ids, cand_free, stream_doubt=doubt)
    done: dict[str, tuple[list[int], bool]] = {}  # each text encoded once across the readings
    plain = [c for c in cands if not c.held]
    held_cands = _encode_held(tok, [c for c in cands if c.held], plain, done, same_count=not by_ids)
    ties: list[str] = []
    if not by_ids:  # the count alone never picks a held tail; one that ties it is said where the record streamed
        ties = [c.name or "" for c in held_cands] if stream is True else []
        held_cands = []
    kept = {id(c) for c in held_cands}
    cands = [c for c in cands if not c.held or id(c) in kept]  # in their order: the formula first
    encoded = [_encode_parts(tok, c.parts, done) for c in cands]
    size = [sum(map(len, e[0])) for e in encoded]
    cands, reads_short = _short_readings(logged, cands, encoded, size)
    vetoed = any(c.veto for c in cands)
    if vetoed:  # kept only where it ties the count of a reading kept on its own: ambiguous then
        counts = {size[k] for k, c in enumerate(cands) if not c.veto}
        keep = [k for k, c in enumerate(cands) if not c.veto or size[k] in counts]
        cands, encoded = [cands[k] for k in keep], [encoded[k] for k in keep]
    cands, cand_ids, cand_free = _lossy_from_truth(tok, cands, [e[0] for e in encoded], [e[1] for e in encoded],
                                                   native, logged)
    return _Choice(idx, choice, native, logged, stop, cands, cand_ids, cand_free,
                   held_ties=ties, stream_doubt=doubt, vetoed=vetoed, reads_short=reads_short)


def _short_readings(logged: LogprobIds | None, cands: list[Candidate], encoded: list[tuple[list[list[int]], list[bool]]],
                    sizes: list[int]) -> tuple[list[Candidate], bool]:
    """``cands`` with the veto lifted from each reading of a section opened without
    ``</think>`` that no uncounted end token can stand in for: it is not exactly one id
    short of another reading (DeepSeek's joined text can be two), or logprobs cover it whole
    (every id, or all but the end: they saw whether ``</think>`` was written; those of the
    content alone did not). And whether one such reading is exactly one id short of another
    (:func:`_plans`, :func:`_mark_cancelling`). ``sizes``: each reading's id count."""
    longer = {n for n, c in zip(sizes, cands) if "no_think_close" not in c.names}
    out, short = [], False
    for c, e, n in zip(cands, encoded, sizes):
        if "no_think_close" in c.names:
            one_short = n + 1 in longer
            short = short or one_short
            # a second <think>'s reading keeps a veto of its own that no count lifts; ids do
            if c.veto and ((not one_short and "think_open_twice" not in c.names) or _logged_whole(logged, c, e, [
                    (r, f) for r, f, m in zip(cands, encoded, sizes) if m == n + 1 and "no_think_close" not in r.names])):
                c = replace(c, veto=False)
        out.append(c)
    return out, short


def _logged_whole(logged: LogprobIds | None, c: Candidate, e: tuple[list[list[int]], list[bool]],
                  longer: list[tuple[Candidate, tuple[list[list[int]], list[bool]]]]) -> bool:
    """Whether logprob ids cover reading ``c`` whole (every id, or all but the end) and fit
    none of the ``longer`` readings at all. With nothing before the section (no reasoning
    served), ``c``'s ids are also the formula's content from after its ``</think>``: a
    provider that logs the content only would have logged the same ids."""
    if logged is None or logged.ids is None:
        return False
    if logprobs_fit(logged, c.parts, e[0], [i for ids in e[0] for i in ids]) not in ("all", "all_but_end"):
        return False
    return all(logprobs_fit(logged, r.parts, f[0], [i for ids in f[0] for i in ids]) is None for r, f in longer)


#: The reading whose ids for a text holding U+FFFD are the ground truth's (:func:`_lossy_from_truth`).
LOSSY_TEXT = "bytes=ids"


def _lossy_from_truth(tok: Tokenizer, cands: list[Candidate], cand_ids: list[list[list[int]]],
                      cand_free: list[list[bool]], native: Sequence[int] | None, logged: LogprobIds | None,
                      ) -> tuple[list[Candidate], list[list[list[int]]], list[list[bool]]]:
    """Each reading whose one text part holds U+FFFD, with that part's ids taken from the
    ground truth (native ids, else logprobs naming every id) where the bytes they spell are
    not UTF-8 and decode, as the engines' detokenizers do (each broken sequence one
    U+FFFD), to exactly that text: a length cut inside a character (SGLang serves the cut
    bytes as U+FFFD, its logprobs carry them) or bytes the model wrote that are no
    character. The text cannot spell those ids; the ids that made it can. The other parts
    keep their own ids, so the whole still has to agree with the truth (:func:`_fits`)."""
    truth = native if native is not None else (
        logged.ids if logged is not None and logged.ids is not None and not logged.unknown else None)
    if truth is None:  # the common case, no ground truth: no text is scanned
        return cands, cand_ids, cand_free
    lossy = [[k for k, (kind, text) in enumerate(c.parts) if "\ufffd" in text and kind not in MARKER_SEGMENTS]
             for c in cands]
    if not any(lossy) or tok.unknown_id(truth) is not None:
        return cands, cand_ids, cand_free
    out_c: list[Candidate] = []
    out_ids: list[list[list[int]]] = []
    out_free: list[list[bool]] = []
    for c, part_ids, free, where in zip(cands, cand_ids, cand_free, lossy):
        found = _truth_pieces(tok, c, part_ids, where, truth, native is None)
        for k, piece in found:  # logprobs that may leave out the end token: each place a reading, the evidence picks
            out_c.append(replace(c, names=(*c.names, LOSSY_TEXT)))
            out_ids.append([*part_ids[:k], piece, *part_ids[k + 1:]])
            out_free.append([*free[:k], not any(i in tok.marker_ids for i in piece), *free[k + 1:]])
        if not found:
            out_c.append(c)
            out_ids.append(part_ids)
            out_free.append(free)
    return out_c, out_ids, out_free


def _truth_pieces(tok: Tokenizer, c: Candidate, part_ids: list[list[int]], where: list[int], truth: Sequence[int],
                  logged: bool) -> list[tuple[int, list[int]]]:
    """(the part, its ids) for each slice of ``truth`` that may stand for reading ``c``'s one
    text part holding U+FFFD: the other parts' ids before and after it, and logprobs
    (``logged``) that may leave out the end token, place it; its bytes must not be UTF-8 and
    must decode to exactly that text."""
    if len(where) != 1:  # two such parts: where one's ids end and the next's begin is not known
        return []
    k = where[0]
    text = c.parts[k][1]
    start = sum(map(len, part_ids[:k]))
    after = sum(map(len, part_ids[k + 1:]))
    out = []
    for end in dict.fromkeys((len(truth) - after, len(truth) - after + (logged and ends_turn(c.parts)))):
        piece = list(truth[start:end]) if end >= start else None
        if piece is None:
            continue
        spelled = tok.decode_bytes(piece)
        if spelled != text.encode("utf-8", "surrogatepass") and spelled.decode("utf-8", "replace") == text:
            out.append((k, piece))
    return out


def _spelled_resent(tok: Tokenizer, cands: list[Candidate], ids: Sequence[int] | None) -> list[Candidate]:
    """``cands`` less the ``prefix_resent`` readings whose content the ids do not spell: a
    text that opens with a run (``"===="``) admits dozens, each a whole content to encode."""
    resent = [c for c in cands if any(n.startswith("prefix_resent=") for n in c.names)]
    if not resent or ids is None or any(i < 0 for i in ids):  # an id logged by what it decoded: bytes unknown
        return cands
    spelled = tok.decode_bytes(ids)
    drop = {id(c) for c in resent if _held_content(c).encode("utf-8", "surrogatepass") not in spelled}
    return [c for c in cands if id(c) not in drop]


def _stream_doubt(dialect: Dialect, content: str, streamed: bool) -> tuple[str, str] | None:
    """(code, why) where SGLang's streaming tool detector may have changed this content at
    the model's count: gpt-oss's once a channel word shows (:func:`~.chat.harmony.tool_stream_doubt`);
    the others' (``Dialect.stream_deletes``) where a call's begin marker is left in the text,
    a call it could not parse whose end it then deleted (an error), and anywhere else as a
    warning where the record says it ``streamed`` (one that does not say is read as served,
    as for held tails): a stray or malformed call's markers vanish unseen, and the words they
    parted can join into one token more (``"Hello<|tool_call_end|>world"`` served
    ``"Helloworld"``, the same count: a cold tester's)."""
    if isinstance(dialect, HarmonyDialect):
        why = tool_stream_doubt(content) if dialect.tool_stream_resends else None
        return None if why is None else ("harmony_message_lost", why)
    deleted = dialect.stream_deletes
    if not deleted or any(d in content for d in deleted):  # a deleted marker's text there: no detector ran
        return None
    named = " and ".join(map(repr, deleted))
    begin = dialect.tool_markers.section_begin if dialect.tool_markers is not None else None
    if begin and begin in content:
        return ("tool_markers_dropped", f"the content holds {begin!r}, a call SGLang's tool detector did not parse; it "
                f"deletes {named} from the text it passes on, so where those stood is unknown")
    if not streamed:
        return None
    return ("tool_text_unproven", f"SGLang's streaming tool detector deletes {named} from the text it passes on: a "
            "stray or malformed call's markers would leave no trace, and the words they parted can make up the count")


def _encode_parts(tok: Tokenizer, parts: Sequence[tuple[str, str]], done: dict[str, tuple[list[int], bool]] | None,
                  ) -> tuple[list[list[int]], list[bool]]:
    """Each part's ids and whether its text is marker-free; ``done`` holds the texts other
    readings encoded already (None: one reading, nothing to share)."""
    ids_c, free_c = [], []
    for kind, text in parts:
        if kind in MARKER_SEGMENTS:
            ids, free = [tok.token_id(text)], False
        elif done is None:
            ids, free = tok.encode_checked(text)
        elif text in done:
            ids, free = done[text]
        else:
            ids, free = done[text] = tok.encode_checked(text)
        ids_c.append(ids)
        free_c.append(free)
    return ids_c, free_c


def _encode_held(tok: Tokenizer, held: list[Candidate], plain: list[Candidate],
                 done: dict[str, tuple[list[int], bool]], *, same_count: bool) -> list[Candidate]:
    """The held-tail readings worth keeping, their content encoded into ``done``: from each
    served content once, re-encoded from its last stable cut (``Tokenizer.encode_appended``).
    ``same_count`` (no ids or logprobs): only a tail that leaves the content's count as
    served is kept, so that the tie is reported; one the count alone would pick is as
    likely an unexplained offset."""
    if not held:
        return []
    served = {text for c in plain for kind, text in c.parts if kind == "content"}
    by_base: dict[str, list[tuple[Candidate, str]]] = {}
    for c in held:
        content = _held_content(c)
        base = content[: -len(c.held)]
        if not base or base in served:  # else a content no reading served: nothing it extends
            by_base.setdefault(base, []).append((c, content))
    kept = []
    for base, group in by_base.items():
        if base not in done:
            done[base] = tok.encode_checked(base)
        encoded = tok.encode_appended(base, done[base][0], [c.held for c, _ in group], same_count=same_count)
        for (c, content), enc in zip(group, encoded):
            if enc is not None:
                done[content] = enc
                kept.append(c)
    return kept


def _held_content(c: Candidate) -> str:
    """A held-tail reading's last content part: the served content, then the held text."""
    return next(text for kind, text in reversed(c.parts) if kind == "content")


def _sends_tools(request: Mapping[str, Any]) -> bool:
    """Whether the request gave the model tools to call (a tool parser then reads its content)."""
    tools = request.get("tools")
    return isinstance(tools, list) and bool(tools) and request.get("tool_choice") != "none"


def _named_ends(tok: Tokenizer, dialect: Dialect, finish: Any, stop: int | str | None,
                logged: LogprobIds | None, native: Sequence[int] | None) -> list[str]:
    """End markers the evidence names for this choice: each a reading's end where the
    formula's is another (:func:`~tokenbridge.hypotheses.candidates` skips a reading that
    already ends so). The dialect's own end token too: GLM's formula ends a tool call with
    ``<|observation|>``, and a call its model ended with ``<|user|>``, proven by
    ``matched_stop`` or ids, had no reading (a cold tester's)."""
    if finish == "length":
        return []
    named = []
    if isinstance(stop, int):
        named.append(stop)
    for seq in (native, logged.ids if logged is not None else None):
        if seq:
            named.append(seq[-1])
    out = []
    for i in named:
        text = tok.marker_ids.get(i)
        if text is not None and text in dialect.eos_markers and text not in out:
            out.append(text)
    return out


def _unnamed_eos(tok: Tokenizer, dialect: Dialect, choice: Mapping[str, Any], finish: Any,
                 stop: int | str | None) -> list[str]:
    """The tokenizer's ``eos_token`` where vLLM's ``stop_reason: null`` may mean it ended the
    turn: vLLM names a ``stop_token_ids`` hit (the generation config's end ids) by its id and
    leaves the tokenizer's own end unnamed, so a dialect end that is not that token is then
    unproven (Kimi K2.5: ``[EOS]``, the same count as ``<|im_end|>``). A reading beside the
    formula's, which only ids or logprobs pick. A folder whose config names no eos (GLM's
    here) leaves every end token of the dialect possible."""
    if finish == "length" or stop is not None or not served_by_vllm(choice) or choice["stop_reason"] is not None:
        return []
    eos = special_token_strings(tok.config).get("eos_token")
    if eos is None:
        return sorted(dialect.eos_markers - {dialect.end_token})
    return [eos] if eos in dialect.eos_markers and eos != dialect.end_token else []


def _usage_pairs(usage: Mapping[str, Any] | None, n_prompt: int,
                 trait: ProviderTrait | None) -> tuple[tuple[int, int] | None, int | None]:
    """(our prompt count, usage's) and usage's completion count, with the provider's
    run-level calibration applied."""
    if usage is None:
        return None, None
    prompt = completion = None
    if is_count(usage.get("prompt_tokens")):
        theirs = usage["prompt_tokens"]
        if trait is not None and trait.cached_excluded:
            theirs += cached_tokens(usage) or 0
        prompt = (n_prompt, theirs)
    if is_count(usage.get("completion_tokens")):
        completion = usage["completion_tokens"]
    return prompt, completion


#: Most combinations of candidates tried against a usage count summed over choices.
_MAX_COMBINATIONS = 512


def _count_ways(plans: list[_Choice], trait: ProviderTrait | None, streamed: bool | None, tok: Tokenizer) -> None:
    """How usage may count the choices: without the end token (a run's trait), and, every
    choice vLLM's with n > 1, their reasoning the ways vLLM counts it whole and streamed."""
    for p in plans:
        p.end_uncounted = trait is not None and trait.end_uncounted
    if len(plans) > 1 and all(served_by_vllm(p.choice) for p in plans):
        for p in plans:
            p.vllm_whole = streamed is not True
            p.vllm_stream = tok.token_bytes if streamed is not False else None


def _reasoning_sums(ways: Sequence[tuple[int, ...]]) -> frozenset[int]:
    """What an engine reports as ``reasoning_tokens`` for these choices together: each
    counted its one way (:meth:`_Choice.ways`, the same ways for every choice), then summed."""
    return frozenset(sum(w[i] for w in ways) for i in range(len(ways[0])))


def _choose(plans: list[_Choice], usage_completion: int | None, policy: Policy, reasoning: int | None, tok: Tokenizer,
            streamed: bool | None) -> None:
    """Pick, per choice, the one candidate the evidence proves; record ambiguity. With n > 1
    choices, usage's counts are sums: a combination of readings must fit them together."""
    single = len(plans) == 1
    options: list[list[int]] = []
    for p in plans:
        keep = [k for k in range(len(p.cands)) if _fits(p, k, reasoning if single else None, tok, streamed)]
        options.append(keep)
    by_count = usage_completion is not None and policy.usage_tolerance == 0
    by_reasoning = bool(reasoning) and not single
    if by_count or by_reasoning:
        groups = [_alike(p, opts) for p, opts in zip(plans, options)]
        n_combos = 1
        for g in groups:
            n_combos *= max(len(g), 1)
        if all(options) and n_combos <= _MAX_COMBINATIONS:
            seen: list[set[int]] = [set() for _ in plans]
            for combo in itertools.product(*groups):
                if by_count and sum(size for size, _, _ in combo) != usage_completion:
                    continue
                if by_reasoning and reasoning not in _reasoning_sums([way for _, way, _ in combo]):
                    continue
                for c, (_, _, ks) in enumerate(combo):
                    seen[c].update(ks)
            if not any(seen):  # usage contradicts every reading: the mismatch says so
                for p, opts in zip(plans, options):
                    p.chosen = 0 if 0 in opts else opts[0]
                return
            if single and by_count:
                seen[0].update(_open_short(plans[0], options[0], seen[0], usage_completion))
            options = [sorted(s) for s in seen]
    for p, opts in zip(plans, options):
        opts = _distinct(p, opts)
        if len(opts) == 1:
            p.chosen = opts[0]
        elif len(opts) > 1:
            p.chosen = 0 if 0 in opts else opts[0]
            if len(p.cands) > 1:
                p.ambiguous = [p.cands[k].name or "formula" for k in opts]
        _unplaced(p)


def _unplaced(p: _Choice) -> None:
    """A chosen ``token_hidden`` reading stands for a token the engine hid anywhere in the
    think block (:func:`~tokenbridge.hypotheses.candidates`); only ids or logprobs place it.
    Picked by a count (``reasoning_tokens``), the row's ids are one guess among the places:
    ambiguous, never ``ok``."""
    k = p.chosen
    name = p.cands[k].name or ""
    if "token_hidden" not in name.split("+") or ids_prove(p.native, p.logged, p.cands[k].parts, p.cand_ids[k], p.ids(k)):
        return  # ids, or logprobs that spell the think block, placed it
    if not p.ambiguous:
        p.ambiguous = [name, "the hidden token at another place in the think block"]


def _open_short(p: _Choice, opts: list[int], fitting: set[int], usage: int | None) -> list[int]:
    """The open-ended readings (``Candidate.open_end``) of ``opts`` the count left out for
    being short of it, where another reading fits: text the engine never served (whitespace
    vLLM's parser stripped, a character held back at a cut) may make up the rest, so the
    reading that fits is not proven by the count. None where nothing else fits."""
    if not fitting or usage is None:
        return []
    return [k for k in opts if k not in fitting and p.cands[k].open_end and p.counted(k) < usage]


def _alike(p: _Choice, opts: list[int]) -> list[tuple[int, tuple[int, ...], list[int]]]:
    """``opts`` grouped by all a summed usage sees of them, (count, reasoning count ways): one
    option each of the product over n > 1 choices, so many readings of few lengths (held
    tails) stay within :data:`_MAX_COMBINATIONS`."""
    alike: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for k in opts:
        alike.setdefault((p.counted(k), p.ways(k)), []).append(k)
    return [(size, way, ks) for (size, way), ks in alike.items()]


def _distinct(p: _Choice, opts: list[int]) -> list[int]:
    """``opts`` less any reading whose ids an earlier one already has: readings that
    differ only in where the text was served (GLM's newline) build the same sample."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for k in opts:
        ids = tuple(p.ids(k))
        if ids not in seen:
            seen.add(ids)
            out.append(k)
    return out


def _fits(p: _Choice, k: int, reasoning: int | None, tok: Tokenizer, streamed: bool | None) -> bool:
    """Whether candidate ``k`` agrees with this choice's own evidence."""
    ids = p.ids(k)
    if p.native is not None and list(p.native) != ids:
        return False
    parts, part_ids = p.cands[k].parts, p.cand_ids[k]
    if p.logged is not None and p.logged.ids is not None and logprobs_fit(p.logged, parts, part_ids, ids) is None:
        return False
    if isinstance(p.stop, int) and ends_turn(parts) and ids[-1] != p.stop:
        return False
    return not reasoning or _stripped(p.cands[k]) or reasoning_fits(reasoning, parts, part_ids, tok, streamed, p.choice)


def _stripped(c: Candidate) -> bool:
    """Whether ``c`` reads the message as vLLM 0.34's with text its parser stripped from the
    reasoning (put back, or open-ended: ``Candidate.open_end``): vLLM is then the engine, and
    its ``reasoning_tokens`` is no proof against it (0.34 leaves out, streamed, each id that
    completes no character, and more), so that count never rules it out; the total count
    still does, or leaves the row ambiguous."""
    return c.open_end or any(n.startswith("reasoning_tail=") for n in c.names)


def _mark_cancelling(plans: list[_Choice], rows: list[dict[str, Any]], policy: Policy, *,
                     thinking: bool, opens: bool) -> None:
    """With n > 1, two readings the count alone never picks can cancel in the sum: a turn
    that ended with no content may have ended inside its think block (one id fewer than the
    formula, ``end_in_think``), and a length cut may have held back one id the response
    never served (a partial character, or a ``</think>`` right at the cut). Each alone
    breaks the count; one of each keeps the sum. Where ids or logprobs pin neither, every
    such choice is unproven (``choices_unattributable``); what pins one is :func:`_pinned`."""
    sev = policy.severity("choices_unattributable")
    if sev == "off":
        return
    fewer, more = [], []
    for p, row in zip(plans, rows):
        if _pinned(p):
            continue
        finish = finish_reading(p.choice)
        if finish == "length":
            more.append((p, row))
        elif (ends_in_think_fits(p.cands[p.chosen].parts, finish, thinking, opens)
              or (p.reads_short and "no_think_close" not in p.cands[p.chosen].names)):
            # its ended-in-think reading (or its section opened without </think>), where one was
            # built, was weighed against the sibling's reading as served, never against the id
            # the cut may hide: the two still cancel
            fewer.append((p, row))
    if not (fewer and more):
        return
    why = (f"usage is summed over {len(rows)} choices: choice(s) {[r['choice'] for _, r in fewer]} may have ended "
           "inside the think block or opened a tool section without </think> (one id fewer than read) and "
           f"choice(s) {[r['choice'] for _, r in more]} were cut where one id may not have been served (one more): "
           "the sum fits either way, so it proves neither")
    for _, row in (*fewer, *more):
        row["findings"] = [*row["findings"], Finding("choices_unattributable", sev, why).to_dict()]
        row["status"] = status_of([Finding(f["code"], f["severity"], f["message"]) for f in row["findings"]])


def _pinned(p: _Choice) -> bool:
    """Whether the choice's own evidence fixes its count against a sibling's one id more or
    fewer (:func:`_mark_cancelling`): ground-truth ids; logprobs of every id, or of every id
    but the end (an engine's empty entry for a marker still one entry); or, for a length cut,
    logprobs of its content, where the id the cut may hide would be. An empty list, or a
    turn's content logprobs, see no ``</think>`` and fix nothing (a cold tester's: taken as
    pinning, a section opened without ``</think>`` passed as ``ok`` with one); nor do a cut's
    whose last entry, with no text, was left out as an end token: a cut has none, so that
    entry was the id it hid (a reviewer's)."""
    if p.native is not None:
        return True
    if p.logged is None or p.logged.ids is None:
        return False
    cut = finish_reading(p.choice) == "length"
    if cut and p.logged.dropped_end:
        return False
    k = p.chosen
    fit = logprobs_fit(p.logged, p.cands[k].parts, p.cand_ids[k], p.ids(k))
    return fit in ("all", "all_but_end") or (fit == "content" and cut)


def _mark_siblings(rows: list[dict[str, Any]], policy: Policy) -> None:
    """With n > 1, usage counts all choices together: a choice is proven only when no
    other choice has an error, since one choice's error can hide another's. A sibling
    with warnings only (say ``truncated``) has ids exact as far as they go; where its cut
    may hide one more, :func:`_mark_cancelling` has already said so."""
    dirty = [r["choice"] for r in rows if any(f["severity"] == "error" for f in r["findings"])]
    sev = policy.severity("choices_unattributable")
    if not dirty or sev == "off":
        return
    for row in rows:
        if row["choice"] not in dirty:
            row["findings"] = [*row["findings"], Finding(
                "choices_unattributable", sev,
                f"usage is summed over {len(rows)} choices and choice(s) {dirty} have errors; "
                "this choice's count cannot be proven alone").to_dict()]
            row["status"] = status_of([Finding(f["code"], f["severity"], f["message"]) for f in row["findings"]])


def _segments(n_prompt: int, parts: Sequence[tuple[str, str]],
              part_ids: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    segs = [{"kind": "prompt", "start": 0, "end": n_prompt}]
    pos = n_prompt
    for (kind, _), ids in zip(parts, part_ids):
        if not ids:
            continue
        segs.append({"kind": kind, "start": pos, "end": pos + len(ids)})
        pos += len(ids)
    return segs


@dataclass(frozen=True)
class _RowMeta:
    """What every row of one exchange shares."""

    ex: Exchange
    provider: Any
    model: Any
    thinking: bool
    usage: Mapping[str, Any] | None


def _row(meta: _RowMeta, *, choice: int, prompt_ids: list[int], completion_ids: list[int], segments: list[dict[str, Any]],
         findings: list[Finding], finish_reason: Any, reasoning: str, content: str,
         reconstruction: str | None) -> dict[str, Any]:
    if not segments:
        segments = [{"kind": "prompt", "start": 0, "end": len(prompt_ids)}]
    ex = meta.ex
    return {
        "id": ex.id,
        "choice": choice,
        "dataset": ex.dataset,
        "status": status_of(findings),
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,  # input_ids and loss_mask follow from these, when written
        "segments": segments,
        "findings": [f.to_dict() for f in findings],
        "provider": meta.provider,
        "model": meta.model,
        "finish_reason": finish_reason,
        "thinking": meta.thinking,
        "usage": meta.usage,
        "messages": ex.request.get("messages"),
        "tools": ex.request.get("tools"),
        "reasoning": reasoning,
        "content": content,
        "reconstruction": reconstruction,
    }


# --- files ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BadLine:
    """A line that could not be reconstructed: where, which field, why."""

    path: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.field}: {self.message}"


#: What the summary needs of a row (:func:`_brief`): status, codes, provider, edge whitespace.
Brief = tuple[str, list[str], str, bool]


def _brief(row: Mapping[str, Any], edge: bool) -> Brief:
    """What the summary needs of a row: status, codes, provider, and whether its served
    text kept any leading/trailing whitespace (``edge``: a provider that strips never does)."""
    return row["status"], [f["code"] for f in row["findings"]], str(row["provider"]), edge


#: How many bad lines a summary keeps (all are counted): the terminal shows 20, ``--summary-json``
#: lists these.
KEPT_BAD_LINES = 10_000


@dataclass
class ReconstructSummary:
    records: int = 0
    rows: int = 0
    status: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    #: the first :data:`KEPT_BAD_LINES` bad lines (:meth:`add_bad`); ``bad_line_count`` counts them all
    bad_lines: list[BadLine] = field(default_factory=list)
    bad_line_count: int = 0
    #: provider -> [rows, rows whose text keeps edge whitespace]
    edges: dict[str, list[int]] = field(default_factory=dict)
    #: count deltas and text shapes per provider, for run-level calibration
    stats: TraitStats = field(default_factory=TraitStats)
    #: the provider traits the rows were checked with (after a calibrating second pass)
    traits: dict[str, ProviderTrait] = field(default_factory=dict)

    def add(self, briefs: Iterable[Brief], facts: RecordFacts | None = None) -> None:
        self.records += 1
        briefs = list(briefs)
        if facts is not None and briefs:
            self.stats.add(briefs[0][2], facts)
        for status, codes, provider, edge in briefs:
            self.rows += 1
            self.status[status] += 1
            self.codes.update(codes)
            counts = self.edges.setdefault(provider, [0, 0])
            counts[0] += 1
            counts[1] += edge

    def add_bad(self, bad: BadLine) -> None:
        """Count a bad line; keep it among the first :data:`KEPT_BAD_LINES` (a file of millions
        of them, the wrong file given, held every one: 566 MB at 2M)."""
        self.bad_line_count += 1
        if len(self.bad_lines) < KEPT_BAD_LINES:
            self.bad_lines.append(bad)

    def _strippers(self, min_rows: int = 20, min_rate: float = 0.1) -> list[tuple[str, int, float]]:
        """(provider, samples, the others' edge-whitespace rate) for each provider whose text
        never keeps edge whitespace while the others' often does.

        A provider that ``.strip()``s reasoning/content can turn ``".\n"`` into ``"."``,
        the same number of tokens with a different id: invisible per sample without
        ground-truth ids, but plain across a run.
        """
        found = []
        for prov, (n, edge) in sorted(self.edges.items()):
            others = [(m, e) for p, (m, e) in self.edges.items() if p != prov and m >= min_rows]
            total = sum(m for m, _ in others)
            rate = sum(e for _, e in others) / total if total else 0.0
            if n >= min_rows and edge == 0 and rate >= min_rate:
                found.append((prov, n, rate))
        return found

    def stripping_suspects(self) -> list[str]:
        """One note per provider that probably strips whitespace (:meth:`_strippers`)."""
        return [
            f"{prov}: none of its {n} samples keeps leading/trailing whitespace in reasoning or content, "
            f"against {rate:.0%} of the other providers' samples: it probably strips whitespace, and a strip "
            "that keeps the token count (e.g. '.\\n' -> '.') passes the gate unseen. Use ground-truth ids "
            "or other providers."
            for prov, n, rate in self._strippers()
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "rows": self.rows,
            "status": {k: self.status.get(k, 0) for k in ("ok", "flagged", "rejected")},
            "codes": dict(sorted(self.codes.items())),
            "bad_lines": [b.__dict__ for b in self.bad_lines],
            "bad_lines_total": self.bad_line_count,
            "provider_notes": self.stripping_suspects(),
            "provider_traits": {name: t.to_dict() for name, t in sorted(self.traits.items())},
        }

    def calibration_notes(self) -> list[str]:
        """One line per provider whose counts or text form were calibrated across the run."""
        return [f"{name}: calibrated across the run: {t.describe()}" for name, t in sorted(self.traits.items())
                if t.describe()]

    def stripping_providers(self) -> list[str]:
        return [prov for prov, _, _ in self._strippers()]


# Per-process state for pool workers (set by the initializer).
_WORKER: dict[str, Any] = {}

#: A chunk of input: (number of its first line, whole lines as the file's bytes).
Chunk = tuple[int, bytes]


@dataclass(frozen=True)
class _Done:
    """A record reconstructed: its JSONL rows are in the chunk's buffer, in input order
    (Parquet: ``rows`` holds them instead, as Arrow records)."""

    line: int
    rows: list[dict[str, Any]] | None
    briefs: list[Brief]
    facts: RecordFacts
    #: the record's id (each record once: its rows are named by it and their choice)
    id: str
    #: bytes of its rows in the chunk's buffer (JSONL)
    size: int


@dataclass(frozen=True)
class _Refused:
    """A record that is bad input (:data:`RECORD_ERRORS`): where and why."""

    line: int
    field: str
    message: str


_Entry = _Done | _Refused
#: One chunk's result: its JSONL rows (the bytes, or the spool file holding them) and one entry a record.
_ChunkResult = tuple[bytes | str, list[_Entry]]


def _init_worker(tokenizer_source: str, dialect_name: str | None, policy: Policy | None, as_json: bool,
                 traits: Mapping[str, ProviderTrait] | None = None, spool: str | None = None) -> None:
    _quiet_worker_signals()
    tok = load_tokenizer(tokenizer_source)
    _WORKER.update(tok=tok, dialect=resolve_dialect(tok, dialect_name), policy=policy, as_json=as_json,
                   traits=traits, spool=spool, spooled=0)


#: First bytes (after ASCII whitespace) of a line that may still be blank as text: the
#: separators U+001C..U+001F and any non-ASCII character (U+0085, U+00A0, U+3000, ...).
_MAYBE_BLANK = frozenset(range(0x1C, 0x20)) | frozenset(range(0x80, 0x100))


#: Bytes ``bytes.lstrip()`` strips (ASCII whitespace).
_ASCII_SPACE = frozenset(b" \t\n\r\x0b\x0c")

#: A line of a chunk: a view of its bytes (LF-only chunks) or its text.
Line = memoryview | str


def _chunk_lines(chunk: Chunk) -> Iterator[tuple[int, Line]]:
    """The records of these lines, numbered as :func:`~tokenbridge.exchanges.iter_lines`
    numbers them (UTF-8 with surrogate escapes, universal newlines, blank lines skipped).

    Where no CR is in the chunk (LF ends every line), a line is a view of the chunk's
    bytes, newline kept (orjson reads it as it is: no copy, no decode, no second UTF-8
    pass); a line that may be blank as text is decoded to decide.
    """
    first, data = chunk
    if b"\r" in data:
        for lineno, line in enumerate(io.StringIO(data.decode("utf-8", "surrogateescape"), newline=None), first):
            if line.strip():
                yield lineno, line
        return
    view = memoryview(data)
    lineno, start, size = first, 0, len(data)
    while start < size:
        end = data.find(b"\n", start) + 1 or size
        lead = data[start]
        if lead in _ASCII_SPACE:  # rare: find the first byte that is not
            rest = data[start:end].lstrip()
            lead = rest[0] if rest else -1
        if lead in _MAYBE_BLANK:
            text = data[start:end].decode("utf-8", "surrogateescape")
            if text.strip():
                yield lineno, text
        elif lead >= 0:
            yield lineno, view[start:end]
        start, lineno = end, lineno + 1


def _load(line: bytes | Line) -> Any:
    """The JSON value of a line, exactly as :func:`~tokenbridge.exchanges.loads_line`
    reads its text (which raises RecordError)."""
    if not isinstance(line, str):
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:  # not UTF-8, lone surrogate escapes, or not JSON: the text path says
            line = str(line, "utf-8", "surrogateescape")
        else:
            return keys_once(value, line)
    return loads_line(line)


def _work(data: bytes) -> _ChunkResult:
    """Reconstruct a chunk of whole lines, numbered from 1 (the caller knows where the
    chunk starts). JSONL rows (every row serialised here, newline included, in input
    order) come back as one buffer plus one entry a record; from a worker process they
    go into a file in the spool folder, written as they are (no joined copy), and only
    its name comes back.

    Bad input (:data:`RECORD_ERRORS`) becomes a :class:`_Refused` entry; any other
    exception is a bug: it propagates, carrying the line it happened on (:func:`_note_bug`).
    """
    tok, dialect, policy, as_json = _WORKER["tok"], _WORKER["dialect"], _WORKER["policy"], _WORKER["as_json"]
    traits = _WORKER.get("traits")
    out: list[_Entry] = []
    parts: list[bytes] = []
    for lineno, line in _chunk_lines((1, data)):
        try:
            ex = parse_exchange(_load(line))
            rows, facts = _reconstruct(ex, tok, dialect, policy, traits)
            # the row's JSON (or Arrow record) here, so a value too deep to write fails its record
            encoded = [encode_lean_row(row) for row in rows] if as_json else None
            records = None if as_json else [to_arrow_record(with_derived(r), COLUMNS) for r in rows]
        except RecordError as exc:
            out.append(_Refused(lineno, exc.field, exc.detail))
            continue
        except RECORD_ERRORS as exc:  # the chat template or the tokenizer refused this record
            out.append(_Refused(lineno, "<record>", f"{type(exc).__name__}: {exc}"))
            continue
        except RecursionError:  # parsed (orjson reads 1024 levels), too deep for Python to walk
            out.append(_Refused(lineno, "<record>", _TOO_DEEP))
            continue
        except MemoryError:  # a record too large for the memory this process may take: the rest go on
            out.append(_Refused(lineno, "<record>", f"too large to reconstruct in this process's memory (a line of "
                                                    f"{len(line) / 1e6:,.1f} MB: MemoryError)"))
            continue
        except Exception as exc:
            exc.__dict__[_BUG_LINE] = lineno
            raise
        briefs = [_brief(r, e) for r, e in zip(rows, facts.edges)]
        if encoded is not None:
            for text in encoded:
                parts += (text, b"\n")
            out.append(_Done(lineno, None, briefs, facts, ex.id, sum(map(len, encoded)) + len(encoded)))
        else:
            out.append(_Done(lineno, records, briefs, facts, ex.id, 0))
    spool = _WORKER["spool"]
    if spool is None or not parts:
        return b"".join(parts), out
    _WORKER["spooled"] += 1
    path = os.path.join(spool, f"{os.getpid()}-{_WORKER['spooled']}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:  # the rows as they are, no joined copy of the chunk
        fsio.write_parts(fd, parts)
    finally:
        os.close(fd)
    return path, out


#: Why a record nested too deeply for the renderers, the gate or the row's JSON is refused.
_TOO_DEEP = "nested too deeply to reconstruct (RecursionError)"

#: Where a bug's exception carries its line within the chunk.
_BUG_LINE = "_tokenbridge_chunk_line"


def _note_bug(exc: BaseException, first: int) -> None:
    """Name the file line of a bug raised in :func:`_work` on the chunk starting at ``first``."""
    at = exc.__dict__.pop(_BUG_LINE, None)
    if at is not None:
        exc.add_note(f"while reconstructing the record on line {first + at - 1} (an internal error, not bad input)")


@contextmanager
def _chunk_rows(result: bytes | str) -> Iterator[memoryview | int]:
    """The rows of one :func:`_work` result: its bytes (from this process), or its spool
    file open for reading (removed after), which the sink copies into the output inside
    the kernel where it can (:func:`~tokenbridge.fsio.copy_range`; macOS reads and writes
    them): never through a pipe."""
    if isinstance(result, bytes):
        yield memoryview(result)
        return
    try:
        fd = os.open(result, os.O_RDONLY)
        try:
            yield fd
        finally:
            os.close(fd)
    finally:
        os.unlink(result)


def _quiet_worker_signals() -> None:
    """In a pool worker: Ctrl-C (sent to the whole process group) is the parent's to
    handle, and SIGTERM (the parent stopping the pool) ends the worker without a traceback."""
    if mp.parent_process() is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _chunks(path: str | Path, max_lines: int, max_bytes: int = 256 * 1024, *,
            snapshot: lanes.Snapshot | None = None) -> Iterator[Chunk]:
    """The file's lines in chunks of at most ``max_lines`` lines or about ``max_bytes``,
    as raw bytes read in blocks (one process: :mod:`.lanes` reads for a pool). Numbering
    follows text mode (``\r``, ``\r\n`` and ``\n`` each end a line), as
    :func:`~tokenbridge.exchanges.iter_lines` does; chunks end after a ``\n``, so never
    inside ``\r\n``. ``snapshot``: the file as a run found it (read the lines that start in
    its first ``size`` bytes, of that file only: :class:`.lanes.InputChanged` where it cannot),
    as :func:`.lanes.map_lines` reads it."""
    lineno = 1
    partial: list[bytes] = []  # a line longer than a block, until its newline arrives
    with open(path, "rb") as fh:
        if snapshot is not None:
            snapshot.check(fh.fileno())
        for block in _blocks(fh, max_bytes, snapshot):
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                partial.append(block)
                continue
            data = b"".join([*partial, block[:cut]]) if partial else block[:cut]
            partial = [block[cut:]] if cut < len(block) else []
            for piece, n_lines in _at_most_lines(data, max_lines):
                yield lineno, piece
                lineno += n_lines + lanes.lone_crs(piece)  # a lone \r ends a line in text mode too
    if partial:
        yield lineno, b"".join(partial)


def _blocks(fh: BinaryIO, max_bytes: int, snapshot: lanes.Snapshot | None) -> Iterator[bytes]:
    """``fh``'s bytes in blocks: all of them, or the snapshot's first ``size`` and then the
    rest of the line they cut (through its ``\n``), as a range of :mod:`.lanes` reads the line
    its end cuts."""
    if snapshot is None:
        while block := fh.read(max_bytes):
            yield block
        return
    left, last = snapshot.size, b"\n"
    while left > 0:
        if not (block := fh.read(min(max_bytes, left))):  # shorter than the run found it: lines would go missing
            snapshot.cut_short(snapshot.size - left)
        left -= len(block)
        last = block[-1:]
        yield block
    if last == b"\n":  # the size ended a line: done
        return
    while block := fh.read(max_bytes):
        cut = block.find(b"\n") + 1
        if cut:
            yield block[:cut]
            return
        yield block


def _at_most_lines(data: bytes, max_lines: int) -> Iterator[tuple[bytes, int]]:
    """``data`` (whole lines) cut into pieces of at most ``max_lines`` ``\n``-lines, each
    with its number of ``\n`` (counted once: a count is a pass over the bytes)."""
    total = data.count(b"\n")
    if total <= max_lines:
        yield data, total
        return
    start = pos = 0
    n = 0
    while (pos := data.find(b"\n", pos) + 1) > 0:
        n += 1
        if n == max_lines:
            yield data[start:pos], n
            start, n = pos, 0
    if start < len(data):
        yield data[start:], n


def reconstruct_file(
    src: str | Path,
    dst: str | Path,
    tokenizer: str | Path | Tokenizer,
    *,
    dialect: str | None = None,
    policy: Policy | None = None,
    workers: int | None = None,
    chunk_lines: int = 256,
    provider_profile: Mapping[str, tuple[str, ...]] | None = None,
) -> ReconstructSummary:
    """Reconstruct every record of ``src`` (JSONL) into ``dst`` (JSONL, or Parquet by suffix).

    Output order is input order. Bad lines are collected in the summary (file, line,
    field) and skipped; the others are still written. The output is written to a
    temporary file and renamed into place when complete.

    ``provider_profile`` (provider -> invisible text edits, from
    :func:`tokenbridge.traits.load_provider_profile`) flags those providers' samples.
    When the run itself shows a provider trait (the end token left uncounted, or counted
    where a turn may have ended inside its think block; cached tokens left out; whitespace
    stripping; vLLM's joined text; GLM's newline), the file is reconstructed a second time
    with it, so every row is checked against what the whole run showed; ``summary.traits``
    says what was applied. A pipe is read once, into a temp copy both passes read.
    """
    tok_source = tokenizer.source if isinstance(tokenizer, Tokenizer) else str(tokenizer)
    dst = Path(dst)
    check_output_file(dst, src)
    known = {name: ProviderTrait(name, edits=edits, edit_sources=("probe",) * len(edits))
             for name, edits in (provider_profile or {}).items() if edits}
    shown = str(src)  # bad lines name the file the user gave, a pipe's copy too
    with fsio.reading(src), fsio.staged_file(dst, point="reconstruct") as tmp, _readable_twice(src, dst) as src:
        # both passes, on any number of workers, read the file as it was now (one that grows is
        # read to here; a pass each to its own end read two files and judged one by the other)
        snapshot = lanes.Snapshot.of(str(src), shown)  # and no other file that takes its name meanwhile
        if workers is None:  # auto: all cores, unless the pool's start-up costs more than it saves
            workers = 1 if snapshot.size < 256_000 else (os.cpu_count() or 1)
        setup = (tok_source, dialect, policy, known)
        summary = _reconstruct_pass(snapshot, tmp, dst, workers, chunk_lines, setup)
        traits = summary.stats.traits(summary.stripping_providers(), provider_profile)
        if traits != known:
            setup = (tok_source, dialect, policy, traits)
            again = _reconstruct_pass(snapshot, tmp, dst, workers, chunk_lines, setup)
            again.stats = summary.stats
            summary = again
        summary.traits = traits
    return summary


@contextmanager
def _readable_twice(src: str | Path, dst: Path) -> Iterator[str | Path]:
    """``src`` when it is a regular file; a pipe (``<(...)``, ``/dev/stdin``), which reads
    once, is first copied into a hidden temp file beside the output (removed after): a
    provider trait found in the first pass needs a second, and the pipe then gave none,
    so the output came out empty with exit 0. The copy is read in ranges, by every core."""
    if stat.S_ISREG(os.stat(src).st_mode):
        yield src
        return
    copy = fsio.temp_path(fsio.output_file(dst))  # beside the file written (a symlink's target): a kill's copy is cleaned there
    try:
        with open(src, "rb") as fin, open(copy, "xb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        kind = binary_kind(copy)  # what the command's own check could not look at without eating the pipe
        if kind is not None:
            raise NotJsonlError(src, kind)
        yield copy
    finally:
        copy.unlink(missing_ok=True)


def _reconstruct_pass(snapshot: lanes.Snapshot, tmp: Path, dst: Path, workers: int, chunk_lines: int,
                      setup: tuple[str, str | None, Policy | None, Mapping[str, ProviderTrait]]) -> ReconstructSummary:
    """One pass of the snapshot's file into ``tmp`` with the given provider traits; bad lines
    name the file as the user gave it (``snapshot.shown``)."""
    tok_source, dialect, policy, traits = setup
    as_parquet = dst.suffix == ".parquet"
    summary = ReconstructSummary()
    # Pool workers hand their JSONL rows over as files in a private folder beside the
    # output (a temp name: a killed run's folder is removed by the next run).
    spool = fsio.temp_path(fsio.output_file(dst)) if workers > 1 and not as_parquet else None
    if spool is not None:
        spool.mkdir(mode=0o700)
    sink: JsonlRowSink | ParquetRowSink = _ParquetSink(tmp) if as_parquet else _JsonlSink(tmp)
    init_args = (tok_source, dialect, policy, not as_parquet, traits, None if spool is None else str(spool))
    shown = snapshot.shown
    results = _run_chunks(snapshot, chunk_lines, workers, init_args)
    seen: dict[bytes, int] = {}  # a record id's digest -> its line: a few bytes a record, never the id
    try:
        for first, (result, entries) in results:
            with _chunk_rows(result) as rows:
                skip = _repeated(entries, first, seen, shown)
                if isinstance(sink, _JsonlSink):  # the chunk's rows in input order, around any that repeat an id
                    for start, stop in _kept(entries, skip):
                        if isinstance(rows, int):
                            sink.copy_from(rows, start, stop - start)
                        else:
                            sink.write(rows[start:stop])
                for entry in entries:
                    if isinstance(entry, _Refused):
                        summary.add_bad(BadLine(shown, first + entry.line - 1, entry.field, entry.message))
                        continue
                    if entry.line in skip:
                        summary.add_bad(skip[entry.line])
                        continue
                    summary.add(entry.briefs, entry.facts)
                    if isinstance(sink, _ParquetSink):
                        sink.write_records(entry.rows or ())
                    fsio.kill_point("reconstruct:record")
        sink.close()
    except BaseException:
        sink.abort()
        raise
    finally:
        results.close()  # stops the worker pool now, not when garbage collected
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)
    return summary


def _repeated(entries: list[_Entry], first: int, seen: dict[bytes, int], src: str) -> dict[int, BadLine]:
    """The records of a chunk (by ``first``-relative line) whose id an earlier record has:
    each is a bad line naming the first one, and its rows are left out, since a row is
    named by its id and choice and export takes each once (the earlier record's rows stand)."""
    skip: dict[int, BadLine] = {}
    for entry in entries:
        if isinstance(entry, _Done):
            line = first + entry.line - 1
            if (why := repeated_id(seen, entry.id, line)) is not None:
                skip[entry.line] = BadLine(src, line, "id", why)
    return skip


def _kept(entries: list[_Entry], skip: Mapping[int, BadLine]) -> Iterator[tuple[int, int]]:
    """The byte ranges of a chunk's rows without those of the records in ``skip`` (none empty)."""
    start = pos = 0
    for entry in entries:
        if isinstance(entry, _Done):
            if entry.line in skip:
                if pos > start:
                    yield start, pos
                start = pos + entry.size
            pos += entry.size
    if pos > start:
        yield start, pos


def _run_chunks(snapshot: lanes.Snapshot, chunk_lines: int, workers: int,
                init_args: tuple[Any, ...]) -> Generator[tuple[int, _ChunkResult], None, None]:
    """(first line, :func:`_work` result) of every chunk, in input order: in this process,
    or on ``workers`` processes (:mod:`.lanes`: each on a stretch of the file)."""
    if workers <= 1:
        _init_worker(*init_args[:5])  # in this process: rows stay in memory
        for first, data in _chunks(snapshot.path, chunk_lines, snapshot=snapshot):
            try:
                yield first, _work(data)
            except Exception as exc:
                _note_bug(exc, first)
                raise
        return
    _init_worker(*init_args)  # before a fork: the workers start with the tokenizer loaded
    # Parquet rows come back whole (not spooled): short stretches hold few of them waiting.
    stretch = lanes.STRETCH_BYTES if init_args[3] else lanes.RANGE_BYTES
    yield from lanes.map_lines(snapshot.path, workers, _init_worker, init_args, _work, on_error=_note_bug,
                               stretch=stretch, snapshot=snapshot)


#: The row files' writers: rows.py holds the one schema and the one reader/writer pair.
_JsonlSink, _ParquetSink = JsonlRowSink, ParquetRowSink
