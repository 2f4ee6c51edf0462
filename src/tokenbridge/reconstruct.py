"""Rebuild the exact token ids of each API response and run the gate on them.

``reconstruct_record`` turns one exchange record into one row per choice;
``reconstruct_file`` streams a JSONL file through it on all cores, in input order, with
memory bounded by a fixed number of chunks in flight.
"""

from __future__ import annotations

import io
import itertools
import mmap
import multiprocessing as mp
import os
import shutil
import signal
import threading
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence

from .chat import Dialect, message_reasoning, resolve_dialect
from .checks import Finding, Policy, SampleView, ends_turn, logprobs_fit, reasoning_counts, run_checks, status_of
from .evidence import LogprobIds, cached_tokens, logprob_ids, matched_stop, reasoning_tokens
from .exchanges import Exchange, RecordError, loads_line, parse_exchange
from .hypotheses import Candidate, candidates
from .traits import CountDelta, ProviderTrait, RecordFacts, TraitStats
from . import fsio
from .fsio import dumps_line
from .outdir import check_output_file
from .rows import JsonlRowSink, ParquetRowSink
from .tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from multiprocessing.pool import AsyncResult

__all__ = ["BadLine", "ReconstructSummary", "reconstruct_exchange", "reconstruct_file", "reconstruct_record"]

#: Parts that are a single marker token rather than text to encode.
_MARKER_PARTS = {"think_start", "think_end", "end"}


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
    chosen: int = 0
    #: names of every candidate the evidence could not rule out, when more than one
    ambiguous: list[str] = field(default_factory=list)
    #: usage leaves out the end token (a provider trait)
    end_uncounted: bool = False

    def ids(self, k: int) -> list[int]:
        return [i for part in self.cand_ids[k] for i in part]

    def counted(self, k: int) -> int:
        """How many of candidate ``k``'s ids the provider's usage counts."""
        ends = ends_turn(self.cands[k].parts)
        return sum(len(ids) for ids in self.cand_ids[k]) - (1 if self.end_uncounted and ends else 0)


def reconstruct_exchange(
    ex: Exchange,
    tokenizer: Tokenizer,
    dialect: Dialect | None = None,
    policy: Policy | None = None,
    traits: Mapping[str, ProviderTrait] | None = None,
) -> list[dict[str, Any]]:
    """One row per choice. ``traits`` holds what a whole run showed about each provider
    (count offsets, text edits): see :mod:`tokenbridge.traits`."""
    return _reconstruct(ex, tokenizer, dialect, policy, traits)[0]


def _reconstruct(
    ex: Exchange,
    tokenizer: Tokenizer,
    dialect: Dialect | None,
    policy: Policy | None,
    traits: Mapping[str, ProviderTrait] | None,
) -> tuple[list[dict[str, Any]], RecordFacts]:
    """The rows, and what the record tells run-level detection (:mod:`.traits`)."""
    dialect = dialect or resolve_dialect(tokenizer)
    policy = policy or Policy()
    request = ex.request
    thinking = dialect.thinking(request)
    prompt_text = dialect.render_request(request)
    prompt_ids = tokenizer.encode_prompt(prompt_text)
    opens = bool(dialect.think_open and prompt_text.endswith(dialect.think_open))
    response = ex.response
    choices = response.get("choices") or []
    provider = response.get("provider") or ex.meta.get("provider")
    model = response.get("model") or request.get("model")
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else None
    trait = traits.get(str(provider)) if traits else None
    meta = _RowMeta(ex, provider, model, thinking, usage)

    if not choices:  # an error body: one rejected row that says why
        err = response.get("error")
        detail = err.get("message", err) if isinstance(err, dict) else err
        finding = Finding("finish_error", policy.severity("finish_error"), f"response has no choices: {detail}")
        findings = [finding] if finding.severity != "off" else []
        return [_row(meta, 0, prompt_ids, [], [], findings, None, "", "", None)], RecordFacts()

    joins = trait is not None and trait.joins_markers
    plans = [_plan(idx, choice, ex, tokenizer, dialect, thinking=thinking, opens=opens, joins=joins)
             for idx, choice in enumerate(choices)]
    if trait is not None and trait.end_uncounted:
        for p in plans:
            p.end_uncounted = True
    usage_prompt, usage_completion = _usage_pairs(usage, len(prompt_ids), trait)
    single = len(plans) == 1
    reasoning = reasoning_tokens(usage) if single else None  # summed over choices otherwise: not checked
    if any(len(p.cands) > 1 for p in plans):
        _choose(plans, usage_completion, policy, reasoning)
    total_completion = sum(p.counted(p.chosen) for p in plans)
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
            completion_ids=completion_ids,
            usage_prompt=usage_prompt,
            usage_completion=pair,
            native_prompt=ex.native_prompt,
            native_completion=p.native,
            logged=p.logged,
            matched_stop=p.stop,
            reasoning_tokens=reasoning,
            provider_edits=tuple(zip(trait.edits, trait.edit_sources)) if trait is not None else (),
            calibration=trait.describe() if trait is not None else None,
        )
        findings = run_checks(view, policy)
        if p.ambiguous and policy.severity("reconstruction_ambiguous") != "off":
            findings.append(Finding("reconstruction_ambiguous", policy.severity("reconstruction_ambiguous"),
                                    f"the response fits {len(p.ambiguous)} native sequences ({', '.join(p.ambiguous)}) "
                                    "and no evidence (usage, logprobs, token ids, stop id) tells them apart"))
        segments = _segments(len(prompt_ids), parts, part_ids)
        message = p.choice["message"]
        index = p.choice["index"] if _count(p.choice.get("index")) else p.index
        rows.append(_row(meta, index, prompt_ids, completion_ids, segments, findings, p.choice.get("finish_reason"),
                         message_reasoning(message) or "", message.get("content") or "", p.cands[p.chosen].name))
    if len(rows) > 1 and usage_completion is not None:
        _mark_siblings(rows, policy)
    markered = [p for p in plans if _has_marker(p.cands[0].parts)]
    facts = RecordFacts(_delta(plans, rows, usage, len(prompt_ids)), len(markered),
                        sum(any("marker_spaces" in c.names for c in p.cands) for p in markered))
    return rows, facts


def _has_marker(parts: Sequence[tuple[str, str]]) -> bool:
    """Whether the served text of these parts holds marker text (so vLLM's joins show)."""
    return any(kind in ("think_end", "tool_calls") for kind, _ in parts)


#: The only errors a calibrating sample may carry: the count mismatches themselves.
_COUNT_CODES = frozenset({"usage_prompt_mismatch", "usage_completion_mismatch", "usage_reasoning_mismatch"})


def _delta(plans: list[_Choice], rows: list[dict[str, Any]], usage: Mapping[str, Any] | None,
           n_prompt: int) -> CountDelta | None:
    if len(plans) != 1 or len(plans[0].cands) != 1 or usage is None:
        return None
    if any(f["severity"] == "error" and f["code"] not in _COUNT_CODES for f in rows[0]["findings"]):
        return None
    p = plans[0]
    parts = p.cands[0].parts
    completion = usage.get("completion_tokens")
    prompt = usage.get("prompt_tokens")
    return CountDelta(
        ended=ends_turn(parts),
        completion=len(p.ids(0)) - completion if _count(completion) else None,
        prompt=n_prompt - prompt if _count(prompt) else None,
        cached=cached_tokens(usage),
    )


def _plan(idx: int, choice: Mapping[str, Any], ex: Exchange, tok: Tokenizer, dialect: Dialect, *,
          thinking: bool, opens: bool, joins: bool) -> _Choice:
    message = choice["message"]
    finish = choice.get("finish_reason")
    native = ex.native_choices[idx] if idx < len(ex.native_choices) else None
    logged = logprob_ids(tok, choice)
    stop = matched_stop(choice)
    ends = _named_ends(tok, dialect, finish, stop, logged, native)
    cands = candidates(dialect, message, finish, thinking, opens, ends, joins_markers=joins)
    cand_ids = [[[tok.token_id(text)] if kind in _MARKER_PARTS else tok.encode(text) for kind, text in c.parts]
                for c in cands]
    return _Choice(idx, choice, native, logged, stop, cands, cand_ids)


def _named_ends(tok: Tokenizer, dialect: Dialect, finish: Any, stop: int | str | None,
                logged: LogprobIds | None, native: Sequence[int] | None) -> list[str]:
    """End markers other than the dialect's that the evidence names for this choice."""
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
        if text is not None and text in dialect.eos_markers and text != dialect.end_token and text not in out:
            out.append(text)
    return out


def _usage_pairs(usage: Mapping[str, Any] | None, n_prompt: int,
                 trait: ProviderTrait | None) -> tuple[tuple[int, int] | None, int | None]:
    """(our prompt count, usage's) and usage's completion count, with the provider's
    run-level calibration applied."""
    if usage is None:
        return None, None
    prompt = completion = None
    if _count(usage.get("prompt_tokens")):
        theirs = usage["prompt_tokens"]
        if trait is not None and trait.cached_excluded:
            theirs += cached_tokens(usage) or 0
        prompt = (n_prompt, theirs)
    if _count(usage.get("completion_tokens")):
        completion = usage["completion_tokens"]
    return prompt, completion


#: Most combinations of candidates tried against a usage count summed over choices.
_MAX_COMBINATIONS = 512


def _choose(plans: list[_Choice], usage_completion: int | None, policy: Policy, reasoning: int | None) -> None:
    """Pick, per choice, the one candidate the evidence proves; record ambiguity."""
    options: list[list[int]] = []
    for p in plans:
        keep = [k for k in range(len(p.cands)) if _fits(p, k, reasoning)]
        options.append(keep)
    if usage_completion is not None and policy.usage_tolerance == 0:
        sizes = [[plans[c].counted(k) for k in opts] for c, opts in enumerate(options)]
        n_combos = 1
        for opts in options:
            n_combos *= max(len(opts), 1)
        if all(options) and n_combos <= _MAX_COMBINATIONS:
            seen: list[set[int]] = [set() for _ in plans]
            for combo in itertools.product(*(range(len(o)) for o in options)):
                if sum(sizes[c][j] for c, j in enumerate(combo)) == usage_completion:
                    for c, j in enumerate(combo):
                        seen[c].add(options[c][j])
            if not any(seen):  # usage contradicts every reading: the mismatch says so
                for p, opts in zip(plans, options):
                    p.chosen = 0 if 0 in opts else opts[0]
                return
            options = [sorted(s) for s in seen]
    for p, opts in zip(plans, options):
        if len(opts) == 1:
            p.chosen = opts[0]
        elif len(opts) > 1:
            p.chosen = 0 if 0 in opts else opts[0]
            if len(p.cands) > 1:
                p.ambiguous = [p.cands[k].name or "formula" for k in opts]


def _fits(p: _Choice, k: int, reasoning: int | None) -> bool:
    """Whether candidate ``k`` agrees with this choice's own evidence."""
    ids = p.ids(k)
    if p.native is not None and list(p.native) != ids:
        return False
    parts, part_ids = p.cands[k].parts, p.cand_ids[k]
    if p.logged is not None and p.logged.ids is not None and logprobs_fit(p.logged.ids, parts, part_ids, ids) is None:
        return False
    if isinstance(p.stop, int) and ends_turn(parts) and ids[-1] != p.stop:
        return False
    return not reasoning or reasoning in reasoning_counts(parts, part_ids)


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _mark_siblings(rows: list[dict[str, Any]], policy: Policy) -> None:
    """With n > 1, usage counts all choices together: a choice is proven only when no
    other choice has an error, since one choice's error can hide another's. A sibling
    with warnings only (say ``truncated``) still has exact ids, so it hides nothing."""
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


def _segments(n_prompt: int, parts: Sequence[tuple[str, str]], part_ids: Sequence[Sequence[int]],
              ) -> list[dict[str, Any]]:
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


def _row(meta: _RowMeta, choice: int, prompt_ids: list[int], completion_ids: list[int], segments: list[dict[str, Any]],
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
        "completion_ids": completion_ids,
        "input_ids": [*prompt_ids, *completion_ids],
        "loss_mask": [0] * len(prompt_ids) + [1] * len(completion_ids),
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


def _brief(row: Mapping[str, Any]) -> tuple[str, list[str], str, bool]:
    """What the summary needs of a row: status, codes, provider, and whether its text
    keeps any leading/trailing whitespace (a provider that strips never does)."""
    edge = any(t[:1].isspace() or t[-1:].isspace() for t in (row["reasoning"], row["content"]) if isinstance(t, str))
    return row["status"], [f["code"] for f in row["findings"]], str(row["provider"]), edge


@dataclass
class ReconstructSummary:
    records: int = 0
    rows: int = 0
    status: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    bad_lines: list[BadLine] = field(default_factory=list)
    #: provider -> [rows, rows whose text keeps edge whitespace]
    edges: dict[str, list[int]] = field(default_factory=dict)
    #: count deltas and text shapes per provider, for run-level calibration
    stats: TraitStats = field(default_factory=TraitStats)
    #: the provider traits the rows were checked with (after a calibrating second pass)
    traits: dict[str, ProviderTrait] = field(default_factory=dict)

    def add(self, briefs: Iterable[tuple[str, list[str], str, bool]], facts: RecordFacts | None = None) -> None:
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
#: Per record of a chunk: (line, end offset of its rows in the chunk's bytes, briefs) when
#: written as JSONL, (line, rows, None) for Parquet, (line, None, (field, message)) when bad.
_Entry = tuple[int, Any, Any]


def _init_worker(tokenizer_source: str, dialect_name: str | None, policy: Policy | None, as_json: bool,
                 traits: Mapping[str, ProviderTrait] | None = None, spool: str | None = None) -> None:
    _quiet_worker_signals()
    tok = load_tokenizer(tokenizer_source)
    _WORKER.update(tok=tok, dialect=resolve_dialect(tok, dialect_name), policy=policy, as_json=as_json,
                   traits=traits, spool=spool, spooled=0)


def _chunk_lines(chunk: Chunk) -> Iterator[tuple[int, str]]:
    """The (line number, text) pairs :func:`~tokenbridge.exchanges.iter_lines` gives for
    these lines: UTF-8 with surrogate escapes, universal newlines, blank lines skipped."""
    first, data = chunk
    for lineno, line in enumerate(io.StringIO(data.decode("utf-8", "surrogateescape"), newline=None), first):
        if line.strip():
            yield lineno, line


def _work(chunk: Chunk) -> tuple[bytes | str, list[_Entry]]:
    """Reconstruct a chunk of lines. JSONL rows come back as one buffer (every row
    serialised here, newline included) plus where each record's rows end in it; in a
    pool the buffer goes to a file in the spool folder and only its name comes back."""
    tok, dialect, policy, as_json = _WORKER["tok"], _WORKER["dialect"], _WORKER["policy"], _WORKER["as_json"]
    traits = _WORKER.get("traits")
    out: list[_Entry] = []
    parts: list[bytes] = []
    end = 0
    for lineno, line in _chunk_lines(chunk):
        try:
            rows, facts = _reconstruct(parse_exchange(loads_line(line)), tok, dialect, policy, traits)
        except RecordError as exc:
            out.append((lineno, None, (exc.field, exc.detail)))
            continue
        except Exception as exc:  # a template or tokenizer failure on this record only
            out.append((lineno, None, ("<record>", f"{type(exc).__name__}: {exc}")))
            continue
        if as_json:
            for row in rows:
                data = dumps_line(row)
                parts += (data, b"\n")
                end += len(data) + 1
            out.append((lineno, end, ([_brief(r) for r in rows], facts)))
        else:
            out.append((lineno, rows, ([_brief(r) for r in rows], facts)))
    blob = b"".join(parts)
    spool = _WORKER["spool"]
    if spool is None or not blob:
        return blob, out
    _WORKER["spooled"] += 1
    path = os.path.join(spool, f"{os.getpid()}-{_WORKER['spooled']}")
    with open(path, "xb") as fh:
        fh.write(blob)
    return path, out


@contextmanager
def _chunk_rows(result: bytes | str) -> Iterator[memoryview]:
    """The rows of one :func:`_work` result, from memory or mapped from its spool file
    (removed after): the main process never copies them through a pipe."""
    if isinstance(result, bytes):
        yield memoryview(result)
        return
    try:
        with open(result, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                yield view
            finally:
                view.release()
    finally:
        os.unlink(result)


def _quiet_worker_signals() -> None:
    """In a pool worker: Ctrl-C (sent to the whole process group) is the parent's to
    handle, and SIGTERM (the parent stopping the pool) ends the worker without a traceback."""
    if mp.parent_process() is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _chunks(path: str | Path, max_lines: int, max_bytes: int = 256 * 1024) -> Iterator[Chunk]:
    """The file's lines in chunks of at most ``max_lines`` lines or about ``max_bytes``,
    as raw bytes read in blocks: the main process neither decodes nor splits text, and a
    chunk ships to a worker as one buffer. Numbering follows text mode (``\r``,
    ``\r\n`` and ``\n`` each end a line), as :func:`~tokenbridge.exchanges.iter_lines`
    does; chunks end after a ``\n``, so never inside ``\r\n``."""
    lineno = 1
    partial: list[bytes] = []  # a line longer than a block, until its newline arrives
    with open(path, "rb") as fh:
        while block := fh.read(max_bytes):
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                partial.append(block)
                continue
            data = b"".join([*partial, block[:cut]]) if partial else block[:cut]
            partial = [block[cut:]] if cut < len(block) else []
            for piece in _at_most_lines(data, max_lines):
                yield lineno, piece
                lineno += piece.count(b"\n")
                if b"\r" in piece:  # a lone \r ends a line in text mode too (memchr-fast test)
                    lineno += piece.count(b"\r") - piece.count(b"\r\n")
    if partial:
        yield lineno, b"".join(partial)


def _at_most_lines(data: bytes, max_lines: int) -> Iterator[bytes]:
    """``data`` (whole lines) cut into pieces of at most ``max_lines`` ``\n``-lines."""
    if data.count(b"\n") <= max_lines:
        yield data
        return
    start = pos = 0
    n = 0
    while (pos := data.find(b"\n", pos) + 1) > 0:
        n += 1
        if n == max_lines:
            yield data[start:pos]
            start, n = pos, 0
    if start < len(data):
        yield data[start:]


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
    When the run itself shows a provider trait (the end token left uncounted, cached
    tokens left out, whitespace stripping, vLLM's joined text), the file is reconstructed a second time with it, so every row is checked
    against what the whole run showed; ``summary.traits`` says what was applied.
    """
    tok_source = tokenizer.source if isinstance(tokenizer, Tokenizer) else str(tokenizer)
    dst = Path(dst)
    check_output_file(dst, src)
    if workers is None:  # auto: all cores, unless the pool's start-up costs more than it saves
        workers = 1 if os.path.getsize(src) < 256_000 else (os.cpu_count() or 1)
    known = {name: ProviderTrait(name, edits=edits, edit_sources=("probe",) * len(edits))
             for name, edits in (provider_profile or {}).items() if edits}
    with fsio.staged_file(dst, point="reconstruct") as tmp:
        summary = _reconstruct_pass(src, tmp, dst, workers, chunk_lines, (tok_source, dialect, policy, known))
        traits = summary.stats.traits(summary.stripping_providers(), provider_profile)
        if traits != known:
            again = _reconstruct_pass(src, tmp, dst, workers, chunk_lines, (tok_source, dialect, policy, traits))
            again.stats = summary.stats
            summary = again
        summary.traits = traits
    return summary


def _reconstruct_pass(src: str | Path, tmp: Path, dst: Path, workers: int, chunk_lines: int,
                      setup: tuple[str, str | None, Policy | None, Mapping[str, ProviderTrait]]) -> ReconstructSummary:
    """One pass of ``src`` into ``tmp`` with the given provider traits."""
    tok_source, dialect, policy, traits = setup
    as_parquet = dst.suffix == ".parquet"
    summary = ReconstructSummary()
    # Pool workers hand their JSONL rows over as files in a private folder beside the
    # output (a temp name: a killed run's folder is removed by the next run).
    spool = fsio.temp_path(dst) if workers > 1 and not as_parquet else None
    if spool is not None:
        spool.mkdir(mode=0o700)
    sink: JsonlRowSink | ParquetRowSink = _ParquetSink(tmp) if as_parquet else _JsonlSink(tmp)
    init_args = (tok_source, dialect, policy, not as_parquet, traits, None if spool is None else str(spool))
    results = _run_chunks(_chunks(src, chunk_lines), workers, init_args)
    try:
        for result, entries in results:
            with _chunk_rows(result) as view:
                start = 0
                for lineno, rows, info in entries:
                    if rows is None:
                        summary.bad_lines.append(BadLine(str(src), lineno, info[0], info[1]))
                        continue
                    summary.add(*info)
                    if isinstance(sink, ParquetRowSink):  # as_parquet
                        sink.write(rows)
                    else:
                        part = view[start:rows]
                        try:
                            sink.write(part)
                        finally:  # even if an error keeps it referenced: the map must close
                            part.release()
                        start = rows
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


#: :func:`_work`'s result: the chunk's rows (bytes, or a spool file's path) and its entries.
_Result = tuple[bytes | str, list[_Entry]]


#: :func:`_init_worker`'s arguments: tokenizer source, dialect, policy, as JSON, traits, spool folder.
_WorkerArgs = tuple[str, str | None, Policy | None, bool, Mapping[str, ProviderTrait], str | None]


def _run_chunks(chunks: Iterator[Chunk], workers: int, init_args: _WorkerArgs) -> Generator[_Result, None, None]:
    """Each chunk's :func:`_work` result, in input order, on ``workers`` processes."""
    if workers <= 1:
        _init_worker(*init_args[:5])  # in this process: rows stay in memory
        for chunk in chunks:
            yield _work(chunk)
        return
    # fork shares the already-loaded tokenizer (start-up in milliseconds, not a second a
    # worker); it is only safe while this process runs no other threads.
    method = "fork" if threading.active_count() == 1 and "fork" in mp.get_all_start_methods() else "spawn"
    if method == "fork":
        _init_worker(*init_args)
    ctx = mp.get_context(method)
    with ctx.Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
        pending: deque[AsyncResult[_Result]] = deque()
        max_pending = workers * 4
        for chunk in chunks:
            pending.append(pool.apply_async(_work, (chunk,)))
            while len(pending) >= max_pending:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


#: The row files' writers: rows.py holds the one schema and the one reader/writer pair.
_JsonlSink, _ParquetSink = JsonlRowSink, ParquetRowSink
