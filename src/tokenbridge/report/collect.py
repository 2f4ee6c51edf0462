"""The report's numbers, gathered in one streaming pass over each run file.

Rows are never held: per row we keep counters and a few integers (lengths, usage
deltas, timestamps) in compact arrays, so a run of millions of rows costs tens of MB.
Everything returned is plain JSON data; ``report.json`` is exactly this dict.

Every number read from the run files (a row's ``usage``, an exchange's ``response.usage``
and ``meta``, the store's summed cost) came from outside: each is checked once, where it
is read, by :func:`_tokens`, :func:`_usd`, :func:`_time`, :func:`_seconds` and
:func:`_attempts`. One that is not a usable value of its kind (a string, a negative or
fractional count, ``18446744073709551615`` tokens, a cost of ``1e308``, a time past the
year 9999) is left out of the statistics and counted under ``left_out``
(``{"rows" | "exchanges" | "store": {field: values left out}}``), which the page, the
terminal summary and ``report.json`` show; nothing then overflows an array, an ``int``
or a float sum, and ``report.json`` stays JSON (no ``Infinity``).
"""

from __future__ import annotations

import math
import os
import sqlite3
import time
from array import array
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Iterator

import numpy as np

from ..checks import CODES
from ..exchanges import RecordError, iter_objects, parse_exchange, repeated_id
from ..exit_codes import ExitCode
from ..fsio import kind_of
from ..jsonl import is_count, is_int
from ..outdir import open_read_only
from ..rows import STATUSES, ReconstructedRow, RowError, iter_rows

__all__ = ["ReportError", "RowStats", "collect_run", "left_out_notes", "source_note", "unreadable_note",
           "RECONSTRUCTED_NAMES"]

#: Where reconstruct output may sit in a run folder, in order of preference.
RECONSTRUCTED_NAMES = ("reconstructed.jsonl", "reconstructed.parquet")
_MAX_BINS = 60
#: Sample ids kept per finding code and per status (the report lists them for `inspect --id`).
IDS_KEPT = 50
_STATE_FILE = "state.sqlite"  # generate's store (tokenbridge.generate.store.STATE_FILE)
#: The largest token count taken from outside: generate's ``MAX_PLAUSIBLE_TOKENS``
#: (tokenbridge.generate.body, not imported: it loads the generate package).
MAX_TOKENS = 10**9
#: The most one exchange may cost, USD: generate's ``MAX_PLAUSIBLE_COST``.
MAX_COST = 1000.0
#: The latest unix time (seconds) taken from outside: the end of the year 9999, the last
#: one a date can show. A latency is at most as long.
MAX_TIME = 253402300799.0
#: What a field left out should have been, by the end of its name, in the words the report prints.
_RULES = (
    ("_tokens", f"a token count (an integer from 0 to {MAX_TOKENS:,})"),
    ("cost", f"a cost from 0 to {MAX_COST:g} USD"),
    ("_at", "a unix time from 0 to the year 9999"),
    ("latency_s", "a duration from 0 s to 8,000 years"),
    ("attempts", f"an attempt count (an integer from 1 to {MAX_TOKENS:,})"),
    ("(summed)", "a finite number"),
)
#: The words for each source of ``left_out``.
_SOURCES = {"rows": ("sample in the rows", "samples in the rows"), "exchanges": ("exchange", "exchanges"), "store": ("store", "stores")}


class ReportError(ValueError):
    """The run folder cannot be reported on (the message says which file and why).
    ``exit_code``: a bad row or record is bad data (1), as for every other command; a
    missing file or extra is a usage error (2)."""

    def __init__(self, message: str, exit_code: ExitCode = ExitCode.USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def collect_run(run_dir: str | Path, rows: RowStats | None = None) -> dict[str, Any]:
    """Every number the report shows, from ``RUN/reconstructed.*`` and ``RUN/exchanges.jsonl``.

    ``rows``: the row statistics already gathered over that reconstructed file (the
    pipeline's one pass); without it the file is read here."""
    run_dir = Path(run_dir)
    recon, other = _rows_file(run_dir, given=rows is not None)
    exchanges = run_dir / "exchanges.jsonl"
    data: dict[str, Any] = {
        "run_dir": str(run_dir),
        "generated_at": time.time(),
        "sources": {"reconstructed": str(recon), "exchanges": str(exchanges) if exchanges.is_file() else None,
                    "not_read": None if other is None else str(other)},
    }
    left_out: dict[str, Counter[str]] = {"rows": Counter(), "exchanges": Counter(), "store": Counter()}
    data.update(rows.result() if rows is not None else _rows_section(recon))
    left_out["rows"] = data.pop("rows_left_out")
    data["glossary"] = {code: {"default": sev, "meaning": meaning} for code, (sev, meaning) in CODES.items()}
    data["exchanges"] = _exchanges_section(exchanges, left_out["exchanges"]) if exchanges.is_file() else None
    state = run_dir / _STATE_FILE
    data["sources"]["state"] = str(state) if state.is_file() else None
    data["generation"], data["generation_error"] = None, None
    if state.is_file():
        try:
            data["generation"] = _generation_section(state, left_out["store"])
        except ReportError as exc:  # the rows are the report's subject: a broken store only loses this section
            data["generation_error"] = str(exc)
    elif os.path.lexists(state):  # a folder or a link to nothing there: not the same as no store
        data["generation_error"] = f"{state}: not a readable file (a folder, a link to nothing, ...)"
    data["left_out"] = {source: dict(sorted(fields.items())) for source, fields in left_out.items() if fields}
    return data


def _rows_file(run_dir: Path, *, given: bool) -> tuple[Path, Path | None]:
    """The rows file to report on, and the other one when the folder holds both. The
    pipeline's statistics (``given``) are always over ``reconstructed.jsonl``; on its own
    the report reads the file written last: a ``reconstruct -o RUN/reconstructed.parquet``
    after a run left the run's JSONL beside it, and reading that without a word reported
    on rows the user had replaced."""
    found = [(run_dir / n, (run_dir / n).stat().st_mtime_ns) for n in RECONSTRUCTED_NAMES if (run_dir / n).is_file()]
    if not found:
        raise ReportError(f"{run_dir}: no {' or '.join(RECONSTRUCTED_NAMES)} to report on")
    if len(found) == 1:
        return found[0][0], None
    (jsonl, jsonl_time), (parquet, parquet_time) = found
    return (parquet, jsonl) if not given and parquet_time > jsonl_time else (jsonl, parquet)


def exchanges_absent(run_dir: str | Path) -> str:
    """Why the report has no exchanges, in words: the file is not there, or it is there and
    is no regular file (a FIFO, a folder: "not found" sent the user looking for a file)."""
    path = Path(run_dir) / "exchanges.jsonl"
    try:
        mode = path.stat().st_mode
    except OSError:
        return "exchanges.jsonl is not in the run folder"
    return f"exchanges.jsonl is {kind_of(mode)}, not a regular file: not read"


def source_note(sources: dict[str, Any]) -> str | None:
    """Which rows file the report read when the folder holds both."""
    other = sources.get("not_read")
    if not other:
        return None
    return f"rows read from {sources['reconstructed']}; {other} is also there and was not read"


def left_out_notes(left_out: dict[str, dict[str, int]]) -> list[str]:
    """One line per field whose values were left out (``data["left_out"]``), for the page
    and the terminal: ``"meta.cost of 2 exchanges: not a cost from 0 to 1000 USD"``."""
    notes = []
    for source, fields in left_out.items():
        one, many = _SOURCES.get(source, (source, source))
        for field, n in fields.items():
            rule = next((why for end, why in _RULES if field.endswith(end)), "a usable number")
            where = f"the {one}" if source == "store" else f"{n:,} {one if n == 1 else many}"
            notes.append(f"{field} of {where}: not {rule}")
    return notes


# --- reconstructed rows -------------------------------------------------------------------


class RowStats:
    """The report's numbers over reconstructed rows, fed one row at a time (by
    :func:`collect_run`'s own read, or by the pipeline's one pass, :func:`tokenbridge.export.run_pass`)."""

    def __init__(self) -> None:
        self.status: Counter[str] = Counter()
        self.findings: Counter[str] = Counter()
        self.by: dict[str, defaultdict[str, dict[str, Counter[str]]]] = {
            key: defaultdict(lambda: {"status": Counter(), "findings": Counter()}) for key in ("provider", "dataset")}
        self.prompt_len, self.completion_len = array("q"), array("q")
        self.parity = _Parity()
        self.ids = _SampleIds()

    def add(self, row: ReconstructedRow) -> None:
        st = row["status"]
        codes = [f["code"] for f in row["findings"]]
        self.status[st] += 1
        self.findings.update(codes)
        self.ids.add(row, st, codes)
        for key, groups in self.by.items():
            group = groups[str(row[key])]  # type: ignore[literal-required]  # "provider" / "dataset"
            group["status"][st] += 1
            group["findings"].update(codes)
        n_prompt, n_completion = len(row["prompt_ids"]), len(row["completion_ids"])
        if st in ("ok", "flagged"):
            self.prompt_len.append(n_prompt)
            self.completion_len.append(n_completion)
        self.parity.add(row, n_prompt, n_completion)

    def result(self) -> dict[str, Any]:
        self.parity.close()
        findings, status = self.findings, self.status
        return {
            "rows": {"total": sum(status.values()), "status": {s: status.get(s, 0) for s in STATUSES}},
            "findings": dict(findings.most_common()),
            "by_provider": _groups(self.by["provider"]),
            "by_dataset": _groups(self.by["dataset"]),
            "lengths": {
                "rows": "ok and flagged rows",
                "prompt": _describe(self.prompt_len),
                "completion": _describe(self.completion_len),
                "prompt_hist": _histogram(self.prompt_len),
                "completion_hist": _histogram(self.completion_len),
            },
            "usage_parity": self.parity.result(),
            "rows_left_out": self.parity.left_out,
            "samples_by_status": self.ids.result(self.ids.by_status, STATUSES),
            "samples_by_finding": self.ids.result(self.ids.by_code, [c for c, _ in findings.most_common()]),
        }


def _rows_section(path: Path) -> dict[str, Any]:
    """The rows' statistics, every row held to the contract export holds its rows to (a
    report counts what it can vouch for: a file edited by hand fails here as it would there):
    its status agrees with its findings, each sample choice once, and an ``ok`` row's ids,
    mask and segments are trainable (a rejected row may have no completion to train on)."""
    from ..export.validate import RowContract, stored_row_ids

    stats = RowStats()
    contract = RowContract(path)
    try:
        for line, row in iter_rows(path):
            contract.check(row, line, stored_row_ids(row, path, line))
            stats.add(row)
    except RowError as exc:
        raise ReportError(str(exc), ExitCode.INCOMPLETE) from None
    return stats.result()


class _SampleIds:
    """The first :data:`IDS_KEPT` ``[id, choice]`` per status and per finding code, in file order."""

    def __init__(self) -> None:
        self.by_status: dict[str, list[list[Any]]] = defaultdict(list)
        self.by_code: dict[str, list[list[Any]]] = defaultdict(list)

    def add(self, rec: ReconstructedRow, status: str, codes: list[Any]) -> None:
        sample = [rec["id"], rec["choice"]]
        for kept in [self.by_status[status]] + [self.by_code[str(c)] for c in dict.fromkeys(codes)]:
            if len(kept) < IDS_KEPT:
                kept.append(sample)

    @staticmethod
    def result(kept: dict[str, list[list[Any]]], keys: Iterable[str]) -> dict[str, list[list[Any]]]:
        return {k: kept.get(k, []) for k in keys}


def _groups(groups: dict[str, dict[str, Counter[str]]]) -> dict[str, Any]:
    return {
        name: {"rows": sum(g["status"].values()), "status": {s: g["status"].get(s, 0) for s in STATUSES},
               "findings": dict(g["findings"].most_common())}
        for name, g in sorted(groups.items())
    }


class _Parity:
    """usage.* minus our counts, once per exchange (consecutive rows sharing an id).

    A response's ``usage.completion_tokens`` counts every choice, so the completion
    side compares it with the sum over that exchange's rows.
    """

    def __init__(self) -> None:
        self.key: Any = None
        self.deltas = {"prompt": array("q"), "completion": array("q")}
        self.provider: dict[str, dict[str, array[int]]] = defaultdict(lambda: {"prompt": array("q"), "completion": array("q")})
        #: usage fields left out: not a usable token count (:func:`_tokens`)
        self.left_out: Counter[str] = Counter()
        self._pending: tuple[str, dict[str, Any], int, int] | None = None

    def add(self, rec: ReconstructedRow, n_prompt: int, n_completion: int) -> None:
        key = rec["id"]
        if self._pending is not None and key == self.key:
            prov, usage, p, c = self._pending
            self._pending = (prov, usage, p, c + n_completion)
            return
        self.close()
        self.key = key
        row_usage = rec["usage"]
        if row_usage is not None:
            self._pending = (str(rec["provider"]), row_usage, n_prompt, n_completion)

    def close(self) -> None:
        if self._pending is None:
            return
        prov, usage, p, c = self._pending
        self._pending = None
        for side, ours in (("prompt", p), ("completion", c)):
            theirs = _tokens(usage.get(f"{side}_tokens"), f"usage.{side}_tokens", self.left_out, integral=False)
            if theirs is not None:
                self.deltas[side].append(theirs - ours)
                self.provider[prov][side].append(theirs - ours)

    def result(self) -> dict[str, Any] | None:
        if not any(len(d) for d in self.deltas.values()):
            return None
        return {
            "definition": "usage.*_tokens minus our token count, per exchange",
            "prompt": _delta_stats(self.deltas["prompt"]),
            "completion": _delta_stats(self.deltas["completion"]),
            "prompt_values": _delta_hist(self.deltas["prompt"]),
            "completion_values": _delta_hist(self.deltas["completion"]),
            "by_provider": {
                prov: {side: _delta_stats(d[side]) for side in ("prompt", "completion")}
                for prov, d in sorted(self.provider.items())
            },
        }


def _delta_stats(values: array[int]) -> dict[str, Any]:
    if not len(values):
        return {"count": 0}
    a = np.asarray(values, dtype=np.int64)
    return {"count": int(a.size), "exact": int((a == 0).sum()), "exact_share": float((a == 0).mean()),
            "mean": float(a.mean()), "min": int(a.min()), "max": int(a.max()),
            "mean_abs": float(np.abs(a).mean())}


def _delta_hist(values: array[int]) -> dict[str, int]:
    """Exact delta -> count (deltas are few distinct small integers in practice)."""
    counts = Counter(values)
    if len(counts) > 200:  # a wide spread: bucket into 41 equal bins
        hist = _histogram(values, signed=True)
        return {f"{lo:g}..{hi:g}": n for lo, hi, n in zip(hist["edges"], hist["edges"][1:], hist["counts"])}
    return {str(k): v for k, v in sorted(counts.items())}


def _describe(values: array[int]) -> dict[str, Any]:
    if not len(values):
        return {"count": 0}
    a = np.asarray(values, dtype=np.int64)
    q = np.percentile(a, [50, 90, 99])
    return {"count": int(a.size), "total": int(a.sum()), "mean": float(a.mean()), "min": int(a.min()),
            "p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "max": int(a.max())}


def _histogram(values: Iterable[int], signed: bool = False) -> dict[str, Any]:
    a = np.asarray(values, dtype=np.int64)
    if not a.size:
        return {"edges": [], "counts": []}
    lo, hi = (int(a.min()), int(a.max())) if signed else (0, int(a.max()))
    bins = 41 if signed else min(40, max(1, hi - lo + 1))
    counts, edges = np.histogram(a, bins=bins, range=(lo, max(hi, lo + 1)))
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


# --- exchanges ------------------------------------------------------------------------------


def _exchanges_section(path: Path, left_out: Counter[str]) -> dict[str, Any]:
    """Cost, latency, attempts and the timeline over the exchanges; every number checked
    where it is read (an unusable one counted in ``left_out`` and not used)."""
    finished, cost, completion, prompt = array("d"), array("d"), array("q"), array("q")
    latency = array("d")
    started_min = math.inf
    count = errors = attempts = 0
    cost_total = 0.0
    priced = 0
    per_provider: dict[str, dict[str, float]] = defaultdict(lambda: {"exchanges": 0, "cost": 0.0, "latency_s": 0.0,
                                                                     "latency_n": 0, "completion_tokens": 0})
    unreadable: dict[str, Any] = {"lines": 0, "first": None}
    for rec in _objects(path, unreadable):
        count += 1
        meta, response = _dict(rec.get("meta")), _dict(rec.get("response"))
        usage = _dict(response.get("usage"))
        if not response.get("choices"):
            errors += 1
        c = _usd(meta.get("cost"), "meta.cost", left_out)
        if c is None:
            c = _usd(usage.get("cost"), "response.usage.cost", left_out)
        n_completion = _tokens(usage.get("completion_tokens"), "response.usage.completion_tokens", left_out) or 0
        n_prompt = _tokens(usage.get("prompt_tokens"), "response.usage.prompt_tokens", left_out) or 0
        lat = _seconds(meta.get("latency_s"), "meta.latency_s", left_out)
        attempts += _attempts(meta.get("attempts"), "meta.attempts", left_out) or 1
        prov = str(meta.get("provider") or response.get("provider"))
        g = per_provider[prov]
        g["exchanges"] += 1
        g["completion_tokens"] += n_completion
        if c is not None:
            cost_total += c
            priced += 1
            g["cost"] += c
        if lat is not None:
            latency.append(lat)
            g["latency_s"] += lat
            g["latency_n"] += 1
        start = _time(meta.get("started_at"), "meta.started_at", left_out)
        if start is not None:
            started_min = min(started_min, start)
        end = _time(meta.get("finished_at"), "meta.finished_at", left_out)
        if end is not None:
            finished.append(end)
            cost.append(c or 0.0)
            completion.append(n_completion)
            prompt.append(n_prompt)
    out: dict[str, Any] = {
        "count": count, "errors": errors, "attempts": attempts, "unreadable": unreadable,
        "cost_total": cost_total if priced else None, "priced": priced,
        "latency_s": _describe_float(latency),
        "by_provider": {
            prov: {"exchanges": int(g["exchanges"]), "cost": g["cost"], "completion_tokens": int(g["completion_tokens"]),
                   "mean_latency_s": g["latency_s"] / g["latency_n"] if g["latency_n"] else None}
            for prov, g in sorted(per_provider.items())
        },
        "timeline": None,
    }
    if len(finished):
        out["timeline"] = _timeline(finished, cost, prompt, completion, started_min)
        out["duration_s"] = out["timeline"]["duration_s"]
        rate = sum(completion) / out["duration_s"] if out["duration_s"] > 0 else None
        out["completion_tokens_per_s"] = rate if rate is not None and math.isfinite(rate) else None
    return out


def _objects(path: Path, unreadable: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The exchange records of ``path``; a line that is not one is counted in ``unreadable``
    (the first named) and skipped, as reconstruct skips it: not JSON, not an object, a number
    past a double (one such line stopped the whole report), and a record reconstruct refuses
    (no request, an id an earlier line has: its cost was counted twice)."""
    def skip(exc: RecordError) -> None:
        unreadable["lines"] += 1
        if unreadable["first"] is None:
            unreadable["first"] = f"line {exc.line}: {exc.field}: {exc.detail}"

    seen: dict[bytes, int] = {}
    for line, rec in iter_objects(path, on_bad=skip):
        try:
            ex = parse_exchange(rec)
            if (why := repeated_id(seen, ex.id, line)) is not None:
                raise RecordError("id", why)
        except RecordError as exc:
            exc.line = line
            skip(exc)
            continue
        yield rec


def unreadable_note(data: dict[str, Any]) -> str | None:
    """The lines of ``exchanges.jsonl`` the report could not read, when there are any."""
    bad = (data.get("exchanges") or {}).get("unreadable") or {}
    if not bad.get("lines"):
        return None
    n = bad["lines"]
    return (f"{n:,} line{'s' if n != 1 else ''} of exchanges.jsonl {'are' if n != 1 else 'is'} no record (not JSON, not "
            f"an object, or refused by reconstruct too): left out of cost and throughput; the first: {bad['first']}")


def _generation_section(path: Path, left_out: Counter[str]) -> dict[str, Any]:
    """What generate recorded over every invocation in this folder: the same numbers its
    summaries add up to (requests are attempts; errors are failed attempts by class). A
    summed cost that is not a finite number (a store edited by hand) is left out."""
    try:
        con = open_read_only(path)
        try:
            samples = dict(con.execute("SELECT status, COUNT(*) FROM samples GROUP BY status").fetchall())
            requests, cost = con.execute("SELECT COUNT(*), SUM(cost) FROM attempts").fetchone()
            errors = con.execute("SELECT error_class, COUNT(*) FROM attempts WHERE error_class IS NOT NULL"
                                 " GROUP BY error_class ORDER BY COUNT(*) DESC, error_class").fetchall()
            (runs,) = con.execute("SELECT COUNT(*) FROM runs").fetchone()
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise ReportError(f"{path}: cannot read generate's store: {exc}") from None
    return {
        "runs": int(runs),
        "samples": {s: int(samples.get(s, 0)) for s in ("done", "failed", "pending")},
        "requests": int(requests),
        "errors": {str(k): int(n) for k, n in errors},
        "cost_total": _finite(cost, "attempts.cost (summed)", left_out),
    }




def _dict(value: Any) -> dict[str, Any]:
    """``value`` when it is a JSON object, else ``{}`` (a record's optional sections)."""
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> bool:
    """A JSON number (not a bool); an int of any size is one."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _left(value: Any, field: str, left_out: Counter[str]) -> None:
    """Count ``value`` of ``field`` as left out, unless it is absent (None)."""
    if value is not None:
        left_out[field] += 1


def _tokens(value: Any, field: str, left_out: Counter[str], *, integral: bool = True) -> int | None:
    """A token count from outside: an integer from 0 to :data:`MAX_TOKENS`, as generate
    books one (``integral``: a float with no fraction too, as generate takes it; a row's
    usage is read as the gate reads it, integers only), else None (and left out)."""
    if isinstance(value, float) and integral and math.isfinite(value) and value.is_integer():
        value = int(value)
    if is_count(value) and value <= MAX_TOKENS:
        return value
    _left(value, field, left_out)
    return None


def _attempts(value: Any, field: str, left_out: Counter[str]) -> int | None:
    """An attempt count from outside: an integer from 1 to :data:`MAX_TOKENS`, else None."""
    if is_int(value) and 1 <= value <= MAX_TOKENS:
        return value
    _left(value, field, left_out)
    return None


def _bounded(value: Any, field: str, left_out: Counter[str], most: float) -> float | None:
    """A finite number from 0 to ``most`` from outside, else None (and left out). An int
    too large for a float is compared before it is converted."""
    if _number(value) and 0 <= value <= most:
        return float(value)
    _left(value, field, left_out)
    return None


def _usd(value: Any, field: str, left_out: Counter[str]) -> float | None:
    return _bounded(value, field, left_out, MAX_COST)


def _time(value: Any, field: str, left_out: Counter[str]) -> float | None:
    return _bounded(value, field, left_out, MAX_TIME)


def _seconds(value: Any, field: str, left_out: Counter[str]) -> float | None:
    return _bounded(value, field, left_out, MAX_TIME)


def _finite(value: Any, field: str, left_out: Counter[str]) -> float | None:
    """A finite number (the store's summed cost), else None (and left out)."""
    if _number(value) and math.isfinite(value):
        return float(value)
    _left(value, field, left_out)
    return None


def _describe_float(values: array[float]) -> dict[str, Any]:
    if not len(values):
        return {"count": 0}
    a = np.asarray(values, dtype=np.float64)
    q = np.percentile(a, [50, 90, 99])
    return {"count": int(a.size), "mean": float(a.mean()), "p50": float(q[0]), "p90": float(q[1]),
            "p99": float(q[2]), "max": float(a.max())}


def _timeline(finished: array[float], cost: array[float], prompt: array[int], completion: array[int], started_min: float,
              ) -> dict[str, Any]:
    """Per time bin (seconds from the first start): requests, tokens, cost; and the running cost."""
    t = np.asarray(finished, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    t = t[order]
    costs = np.asarray(cost, dtype=np.float64)[order]
    comp = np.asarray(completion, dtype=np.int64)[order]
    prm = np.asarray(prompt, dtype=np.int64)[order]
    t0 = min(float(t[0]), started_min)
    rel = t - t0
    duration = float(rel[-1])
    width = _nice_width(duration / _MAX_BINS if duration > 0 else 1.0)
    n_bins = max(1, int(math.floor(duration / width)) + 1)
    idx = np.minimum((rel // width).astype(np.int64), n_bins - 1)
    bins = [
        {"start_s": k * width, "requests": int(r), "completion_tokens": int(c), "prompt_tokens": int(p), "cost": float(s)}
        for k, (r, c, p, s) in enumerate(zip(
            np.bincount(idx, minlength=n_bins), np.bincount(idx, weights=comp, minlength=n_bins),
            np.bincount(idx, weights=prm, minlength=n_bins), np.bincount(idx, weights=costs, minlength=n_bins)))
    ]
    step = max(1, len(rel) // 2000)  # the running-cost curve, thinned to at most ~2000 points
    cumulative = np.cumsum(costs)
    points = [[float(rel[i]), float(cumulative[i])] for i in range(0, len(rel), step)]
    if points[-1][0] != float(rel[-1]):
        points.append([float(rel[-1]), float(cumulative[-1])])
    return {"t0": t0, "duration_s": duration, "bin_s": width, "bins": bins, "cumulative_cost": points}


def _nice_width(raw: float) -> float:
    """The smallest round bin width (seconds, minutes, hours, days) that is at least ``raw``."""
    for candidate in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600, 43200, 86400):
        if candidate >= raw:
            return float(candidate)
    return float(86400 * math.ceil(raw / 86400))
