"""The report's numbers as rich tables, for ``tokenbridge report`` in a terminal."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["print_summary"]


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _table(title: str, head: list[str], rows: list[list[Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for k, h in enumerate(head):
        table.add_column(h, justify="left" if k == 0 else "right")
    for row in rows:
        table.add_row(*(_fmt(v) for v in row))
    return table


def print_summary(data: dict[str, Any], console: Console | None = None) -> None:
    """Print the same numbers as report.html; a section without data says so."""
    console = console or Console()
    rows = data["rows"]
    st = rows["status"]
    console.print(f"[bold]tokenbridge report[/bold] {data['run_dir']}: {rows['total']} rows "
                  f"([green]{st['ok']} ok[/green], [yellow]{st['flagged']} flagged[/yellow], "
                  f"[red]{st['rejected']} rejected[/red])")
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
    else:
        console.print("Findings: none")
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
        console.print(_table("Exchanges", ["exchanges", "errors", "cost (USD)", "duration (s)", "completion tok/s",
                                           "latency p50 (s)"],
                             [[ex["count"], ex["errors"], ex.get("cost_total"), ex.get("duration_s"),
                               ex.get("completion_tokens_per_s"), lat.get("p50")]]))
    else:
        console.print("Cost and throughput: no data (exchanges.jsonl not found)")
