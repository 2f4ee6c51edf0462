"""The report's numbers as rich tables, for ``tokenbridge report`` in a terminal."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..display import printable
from .collect import exchanges_absent, left_out_notes, source_note, unreadable_note

__all__ = ["print_summary"]

#: Sample ids printed per finding code and status (report.json keeps more).
_IDS_SHOWN = 10


def _fmt(v: Any) -> str | Text:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return _plain(v)


def _plain(v: Any) -> Text:
    """Text from the data (a provider name, an id) as rich text: no markup, controls shown."""
    return Text(printable(str(v)))


def _table(title: str, head: list[str], rows: list[list[Any]], text_columns: int = 1) -> Table:
    table = Table(title=title, title_justify="left")
    for k, h in enumerate(head):
        table.add_column(_plain(h), justify="left" if k < text_columns else "right")
    for row in rows:
        table.add_row(*(_fmt(v) for v in row))
    return table


def _ids_table(title: str, label: str, kept: dict[str, list[list[Any]]], counts: dict[str, int]) -> Table:
    """First ids per key, ready for ``inspect --id`` (with ``(choice N)`` where N is not 0)."""
    table = Table(title=title, title_justify="left")
    table.add_column(label)
    table.add_column("rows", justify="right")
    table.add_column(f"first sample ids (up to {_IDS_SHOWN})", overflow="fold")
    for key, samples in kept.items():
        total = counts.get(key, 0)
        if total:
            ids = " ".join(sid if not choice else f"{sid} (choice {choice})" for sid, choice in samples[:_IDS_SHOWN])
            table.add_row(_plain(key), f"{total:,}", _plain(ids + (" …" if total > _IDS_SHOWN else "")))
    return table


def print_summary(data: dict[str, Any], console: Console | None = None) -> None:
    """Print the same numbers as report.html; a section without data says so."""
    console = console or Console()
    rows = data["rows"]
    st = rows["status"]
    console.print(f"[bold]tokenbridge report[/bold] {escape(printable(data['run_dir']))}: {rows['total']} rows "
                  f"([green]{st['ok']} ok[/green], [yellow]{st['flagged']} flagged[/yellow], "
                  f"[red]{st['rejected']} rejected[/red])")
    gen = data.get("generation")
    if gen:
        n = gen["samples"]
        errors = ", ".join(f"{k} {v}" for k, v in gen["errors"].items()) or "none"
        console.print(_table("Generation (state.sqlite, every run)", ["runs", "done", "failed", "pending", "requests",
                                                                       "cost (USD)"],
                             [[gen["runs"], n["done"], n["failed"], n["pending"], gen["requests"], gen["cost_total"]]]))
        console.print(_plain(f"failed attempts: {errors}"))
    elif data.get("generation_error"):  # a store there that cannot be read: said, as the page says it
        console.print(_plain(f"Generation: not read ({data['generation_error']})"))
    for key, label in (("by_provider", "provider"), ("by_dataset", "dataset")):
        groups = data[key]
        console.print(_table(f"Status per {label}", [label, "rows", "ok", "flagged", "rejected"],
                             [[n, g["rows"], g["status"]["ok"], g["status"]["flagged"], g["status"]["rejected"]]
                              for n, g in groups.items()]))
    if data["findings"]:
        providers = list(data["by_provider"])
        console.print(_table("Findings per provider", ["code", "all"] + providers,
                             [[c, n] + [data["by_provider"][p]["findings"].get(c, 0) for p in providers]
                              for c, n in data["findings"].items()]))
        glossary = data["glossary"]
        console.print(_table("Finding codes seen", ["code", "default", "meaning"],
                             [[c, glossary[c]["default"], glossary[c]["meaning"]] for c in data["findings"] if c in glossary],
                             text_columns=3))
        console.print(_ids_table("Samples per finding code", "code", data["samples_by_finding"], data["findings"]))
    else:
        console.print("Findings: none")
    console.print(_ids_table("Samples per status", "status", data["samples_by_status"], rows["status"]))
    console.print(_plain(f"look at one: tokenbridge inspect {data['sources']['reconstructed']} --tokenizer TOKENIZER "
                         "--id ID"))
    if note := source_note(data["sources"]):
        console.print(_plain(f"note: {note}"))
    lengths = data["lengths"]
    if lengths["prompt"].get("count"):
        keys = ["count", "mean", "p50", "p90", "p99", "max"]
        console.print(_table("Lengths (ok + flagged rows), tokens", ["side"] + keys,
                             [[s] + [lengths[s][k] for k in keys] for s in ("prompt", "completion")]))
    else:
        console.print("Lengths: no data (no ok or flagged row)")
    parity = data["usage_parity"]
    if parity:
        keys = ["count", "exact", "exact_share", "mean", "min", "max"]
        console.print(_table("Usage parity (usage − ours, per exchange)", ["side"] + keys,
                             [[s] + [parity[s].get(k) for k in keys] for s in ("prompt", "completion")]))
    else:
        console.print("Usage parity: no data (no row carries usage)")
    ex = data.get("exchanges")
    if ex:
        lat = ex["latency_s"]
        console.print(_table("Exchanges (done samples)", ["exchanges", "attempts", "without choices", "cost (USD)",
                                                          "duration (s)", "completion tok/s", "latency p50 (s)"],
                             [[ex["count"], ex["attempts"], ex["errors"], ex.get("cost_total"), ex.get("duration_s"),
                               ex.get("completion_tokens_per_s"), lat.get("p50")]]))
    else:
        console.print(_plain(f"Cost and throughput: no data ({exchanges_absent(data['run_dir'])})"))
    if note := unreadable_note(data):
        console.print(_plain(f"note: {note}"))
    for note in left_out_notes(data["left_out"]):
        console.print(_plain(f"left out of the statistics: {note}"))
