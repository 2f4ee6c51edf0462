"""Rebuild the exact token ids of each API response and run the gate on them.

``reconstruct_record`` turns one exchange record into one row per choice;
``reconstruct_file`` streams a JSONL file through it on all cores, in input order, with
memory bounded by a fixed number of chunks in flight.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from .chat import Dialect, message_reasoning, resolve_dialect, thinking_enabled
from .checks import Finding, Policy, SampleView, run_checks, status_of
from .exchanges import Exchange, RecordError, iter_lines, loads_line, parse_exchange
from . import fsio
from .fsio import dumps_line
from .outdir import check_output_file
from .rows import JsonlRowSink, ParquetRowSink
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["BadLine", "ReconstructSummary", "reconstruct_exchange", "reconstruct_file", "reconstruct_record"]

#: Parts that are a single marker token rather than text to encode.
_MARKER_PARTS = {"think_start", "think_end", "end"}


def reconstruct_record(
    record: Mapping[str, Any],
    tokenizer: Tokenizer,
    dialect: Dialect | None = None,
    policy: Policy | None = None,
) -> list[dict[str, Any]]:
    """One reconstructed row per choice of an exchange record (raises RecordError)."""
    return reconstruct_exchange(parse_exchange(record), tokenizer, dialect, policy)


def reconstruct_exchange(
    ex: Exchange,
    tokenizer: Tokenizer,
    dialect: Dialect | None = None,
    policy: Policy | None = None,
) -> list[dict[str, Any]]:
    dialect = dialect or resolve_dialect(tokenizer)
    request = ex.request
    thinking = thinking_enabled(request)
    prompt_text = dialect.render_request(request)
    prompt_ids = tokenizer.encode(prompt_text)
    opens = bool(dialect.think_open) and prompt_text.endswith(dialect.think_open)
    response = ex.response
    choices = response.get("choices") or []
    provider = response.get("provider") or ex.meta.get("provider")
    model = response.get("model") or request.get("model")
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else None

    if not choices:  # an error body: one rejected row that says why
        err = response.get("error")
        detail = err.get("message", err) if isinstance(err, dict) else err
        finding = Finding("finish_error", (policy or Policy()).severity("finish_error"), f"response has no choices: {detail}")
        findings = [finding] if finding.severity != "off" else []
        return [_row(ex, 0, prompt_ids, [], [], findings, provider, model, None, thinking, usage, "", "")]

    built = []
    for idx, choice in enumerate(choices):
        message = choice["message"]
        parts = dialect.completion_parts(message, choice.get("finish_reason"), thinking, opens)
        part_ids = [
            [tokenizer.token_id(text)] if kind in _MARKER_PARTS else tokenizer.encode(text) for kind, text in parts
        ]
        built.append((choice, parts, part_ids))

    total_completion = sum(sum(len(ids) for ids in part_ids) for _, _, part_ids in built)
    rows = []
    for idx, (choice, parts, part_ids) in enumerate(built):
        completion_ids: list[int] = []
        for ids in part_ids:
            completion_ids.extend(ids)
        usage_prompt = usage_completion = None
        if usage is not None:
            if _count(usage.get("prompt_tokens")):
                usage_prompt = (len(prompt_ids), usage["prompt_tokens"])
            if _count(usage.get("completion_tokens")):
                ours = len(completion_ids) if len(built) == 1 else total_completion
                usage_completion = (ours, usage["completion_tokens"])
        view = SampleView(
            tokenizer=tokenizer,
            dialect=dialect,
            request=request,
            choice=choice,
            thinking=thinking,
            prompt_text=prompt_text,
            prompt_ids=prompt_ids,
            parts=parts,
            part_ids=part_ids,
            completion_ids=completion_ids,
            usage_prompt=usage_prompt,
            usage_completion=usage_completion,
            native_prompt=ex.native_prompt,
            native_completion=ex.native_choices[idx] if idx < len(ex.native_choices) else None,
        )
        findings = run_checks(view, policy)
        segments = _segments(len(prompt_ids), parts, part_ids)
        message = choice["message"]
        row = _row(
            ex, choice["index"] if _count(choice.get("index")) else idx, prompt_ids, completion_ids, segments, findings, provider, model,
            choice.get("finish_reason"), thinking, usage, message_reasoning(message) or "", message.get("content") or "",
        )
        rows.append(row)
    if len(rows) > 1 and usage is not None and _count(usage.get("completion_tokens")):
        _mark_siblings(rows, policy or Policy())
    return rows


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mark_siblings(rows: list[dict[str, Any]], policy: Policy) -> None:
    """With n > 1, usage counts all choices together: a choice is proven only when
    every choice is clean, since one choice's error can hide another's."""
    dirty = [r["choice"] for r in rows if r["findings"]]
    sev = policy.severity("choices_unattributable")
    if not dirty or sev == "off":
        return
    for row in rows:
        if not row["findings"]:
            row["findings"] = [Finding("choices_unattributable", sev,
                                       f"usage is summed over {len(rows)} choices and choice(s) {dirty} have findings; "
                                       "this choice's count cannot be proven alone").to_dict()]
            row["status"] = status_of([Finding(f["code"], f["severity"], f["message"]) for f in row["findings"]])


def _segments(n_prompt: int, parts: Sequence[tuple[str, str]], part_ids: Sequence[Sequence[int]]) -> list[dict]:
    segs = [{"kind": "prompt", "start": 0, "end": n_prompt}]
    pos = n_prompt
    for (kind, _), ids in zip(parts, part_ids):
        if not ids:
            continue
        segs.append({"kind": kind, "start": pos, "end": pos + len(ids)})
        pos += len(ids)
    return segs


def _row(ex: Exchange, choice: int, prompt_ids, completion_ids, segments, findings: list[Finding],
         provider, model, finish_reason, thinking, usage, reasoning: str, content: str) -> dict[str, Any]:
    if not segments:
        segments = [{"kind": "prompt", "start": 0, "end": len(prompt_ids)}]
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
        "provider": provider,
        "model": model,
        "finish_reason": finish_reason,
        "thinking": thinking,
        "usage": usage,
        "messages": ex.request.get("messages"),
        "tools": ex.request.get("tools"),
        "reasoning": reasoning,
        "content": content,
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
    status: Counter = field(default_factory=Counter)
    codes: Counter = field(default_factory=Counter)
    bad_lines: list[BadLine] = field(default_factory=list)
    #: provider -> [rows, rows whose text keeps edge whitespace]
    edges: dict[str, list[int]] = field(default_factory=dict)

    def add(self, briefs: Iterable[tuple[str, list[str], str, bool]]) -> None:
        self.records += 1
        for status, codes, provider, edge in briefs:
            self.rows += 1
            self.status[status] += 1
            self.codes.update(codes)
            counts = self.edges.setdefault(provider, [0, 0])
            counts[0] += 1
            counts[1] += edge

    def stripping_suspects(self, min_rows: int = 20, min_rate: float = 0.1) -> list[str]:
        """Providers whose text never keeps edge whitespace while the others' often does.

        A provider that ``.strip()``s reasoning/content can turn ``".\n"`` into ``"."``,
        the same number of tokens with a different id: invisible per sample without
        ground-truth ids, but plain across a run.
        """
        notes = []
        for prov, (n, edge) in sorted(self.edges.items()):
            others = [(m, e) for p, (m, e) in self.edges.items() if p != prov and m >= min_rows]
            total = sum(m for m, _ in others)
            rate = sum(e for _, e in others) / total if total else 0.0
            if n >= min_rows and edge == 0 and rate >= min_rate:
                notes.append(
                    f"{prov}: none of its {n} samples keeps leading/trailing whitespace in reasoning or content, "
                    f"against {rate:.0%} of the other providers' samples: it probably strips whitespace, and a strip "
                    "that keeps the token count (e.g. '.\\n' -> '.') passes the gate unseen. Use ground-truth ids "
                    "or other providers."
                )
        return notes

    def to_dict(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "rows": self.rows,
            "status": {k: self.status.get(k, 0) for k in ("ok", "flagged", "rejected")},
            "codes": dict(sorted(self.codes.items())),
            "bad_lines": [b.__dict__ for b in self.bad_lines],
            "provider_notes": self.stripping_suspects(),
        }


# Per-process state for pool workers (set by the initializer).
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_source: str, dialect_name: str | None, policy: Policy | None, as_json: bool) -> None:
    _quiet_worker_signals()
    tok = load_tokenizer(tokenizer_source)
    _WORKER.update(tok=tok, dialect=resolve_dialect(tok, dialect_name), policy=policy, as_json=as_json)


def _work(chunk: list[tuple[int, str]]) -> list[tuple[int, Any, Any]]:
    """Reconstruct a chunk of lines: (line, rows or None, (field, message) or None)."""
    tok, dialect, policy, as_json = _WORKER["tok"], _WORKER["dialect"], _WORKER["policy"], _WORKER["as_json"]
    out = []
    for lineno, line in chunk:
        try:
            rows = reconstruct_record(loads_line(line), tok, dialect, policy)
        except RecordError as exc:
            out.append((lineno, None, (exc.field, exc.detail)))
            continue
        except Exception as exc:  # a template or tokenizer failure on this record only
            out.append((lineno, None, ("<record>", f"{type(exc).__name__}: {exc}")))
            continue
        if as_json:
            meta = [_brief(r) for r in rows]
            out.append((lineno, [dumps_line(r) for r in rows], meta))
        else:
            out.append((lineno, rows, None))
    return out


def _quiet_worker_signals() -> None:
    """In a pool worker: Ctrl-C (sent to the whole process group) is the parent's to
    handle, and SIGTERM (the parent stopping the pool) ends the worker without a traceback."""
    if mp.parent_process() is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _chunks(lines: Iterator[tuple[int, str]], size: int) -> Iterator[list[tuple[int, str]]]:
    chunk: list[tuple[int, str]] = []
    budget = 0
    for item in lines:
        chunk.append(item)
        budget += len(item[1])
        if len(chunk) >= size or budget >= 4_000_000:
            yield chunk
            chunk, budget = [], 0
    if chunk:
        yield chunk


def reconstruct_file(
    src: str | Path,
    dst: str | Path,
    tokenizer: str | Path | Tokenizer,
    dialect: str | None = None,
    policy: Policy | None = None,
    workers: int | None = None,
    chunk_lines: int = 32,
) -> ReconstructSummary:
    """Reconstruct every record of ``src`` (JSONL) into ``dst`` (JSONL, or Parquet by suffix).

    Output order is input order. Bad lines are collected in the summary (file, line,
    field) and skipped; the others are still written. The output is written to a
    temporary file and renamed into place when complete.
    """
    tok_source = tokenizer.source if isinstance(tokenizer, Tokenizer) else str(tokenizer)
    dst = Path(dst)
    check_output_file(dst, src)
    as_parquet = dst.suffix == ".parquet"
    if workers is None:  # auto: all cores, unless the pool's start-up costs more than it saves
        workers = 1 if os.path.getsize(src) < 256_000 else (os.cpu_count() or 1)
    summary = ReconstructSummary()
    with fsio.staged_file(dst, point="reconstruct") as tmp:
        sink = _ParquetSink(tmp) if as_parquet else _JsonlSink(tmp)
        results = _run_chunks(_chunks(iter_lines(src), chunk_lines), workers, (tok_source, dialect, policy, not as_parquet))
        try:
            for lineno, rows, info in results:
                if rows is None:
                    summary.bad_lines.append(BadLine(str(src), lineno, info[0], info[1]))
                    continue
                summary.add([_brief(r) for r in rows] if as_parquet else info)
                sink.write(rows)
                fsio.kill_point("reconstruct:record")
            sink.close()
        except BaseException:
            sink.abort()
            raise
        finally:
            results.close()  # stops the worker pool now, not when garbage collected
    return summary


def _run_chunks(chunks: Iterator[list], workers: int, init_args: tuple) -> Iterator[tuple]:
    if workers <= 1:
        _init_worker(*init_args)
        for chunk in chunks:
            yield from _work(chunk)
        return
    # fork shares the already-loaded tokenizer (start-up in milliseconds, not a second a
    # worker); it is only safe while this process runs no other threads.
    method = "fork" if threading.active_count() == 1 and "fork" in mp.get_all_start_methods() else "spawn"
    if method == "fork":
        _init_worker(*init_args)
    ctx = mp.get_context(method)
    with ctx.Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
        pending: deque = deque()
        max_pending = workers * 4
        for chunk in chunks:
            pending.append(pool.apply_async(_work, (chunk,)))
            while len(pending) >= max_pending:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


#: The row files' writers: rows.py holds the one schema and the one reader/writer pair.
_JsonlSink, _ParquetSink = JsonlRowSink, ParquetRowSink
