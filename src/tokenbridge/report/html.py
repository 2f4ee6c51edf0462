"""The report page: one self-contained HTML file (inline CSS, figures as data: URIs, no JS).

Each section is ``<section id=NAME data-has-data=true|false>``; a section without data
says so in a ``<p class="empty">`` instead of showing an empty chart.
"""

from __future__ import annotations

import datetime as dt
from html import escape
from typing import Any
from collections.abc import Iterable, Iterator, Sequence

from ..display import printable
from .collect import exchanges_absent, left_out_notes, source_note, unreadable_note

__all__ = ["SECTIONS", "render_html"]

#: (id, title) of every section, in page order.
SECTIONS = (
    ("overview", "Overview"),
    ("generation", "Generation"),
    ("status", "Status per provider and dataset"),
    ("findings", "Findings"),
    ("samples", "Samples to inspect"),
    ("glossary", "Finding codes"),
    ("lengths", "Prompt and completion lengths"),
    ("parity", "Usage parity"),
    ("cost", "Cost over time"),
    ("throughput", "Throughput over time"),
)

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
header{background:#263238;color:#fff;padding:16px 28px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;opacity:.8}nav{padding:8px 28px;background:#eceff1}nav a{margin-right:14px;color:#1565c0}
main{padding:8px 28px 40px;max-width:1100px}section{background:#fff;border:1px solid #e0e0e0;border-radius:6px;
padding:12px 18px;margin:16px 0}h2{font-size:17px;margin:4px 0 10px}h3{font-size:14px;margin:14px 0 6px}
table{border-collapse:collapse;margin:6px 0 10px;font-size:13px}th,td{border:1px solid #e0e0e0;padding:3px 9px;
text-align:right}th:first-child,td:first-child{text-align:left}thead th{background:#f5f5f5}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{border:1px solid #e0e0e0;border-radius:6px;padding:8px 14px;
min-width:120px}.card b{display:block;font-size:20px}.empty{color:#757575;font-style:italic}
img.fig{max-width:100%;height:auto;display:block;margin:6px 0}.ok{color:#2e7d32}.flagged{color:#b8860b}
.rejected{color:#c62828}.note{color:#616161;font-size:12px}td.ids,th.ids{text-align:left;font:12px/1.5 monospace}
td.ids code{white-space:nowrap}#glossary td{text-align:left}#glossary td:last-child{text-align:right}
"""


def render_html(data: dict[str, Any], figures: dict[str, str | None]) -> str:
    body = [
        _overview(data),
        _generation(data),
        _status(data, figures),
        _findings(data, figures),
        _samples(data),
        _glossary(data),
        _lengths(data, figures),
        _parity(data, figures),
        _cost(data, figures),
        _throughput(data, figures),
    ]
    when = dt.datetime.fromtimestamp(data["generated_at"], dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    nav = "".join(f'<a href="#{sid}">{escape(title)}</a>' for sid, title in SECTIONS)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>tokenbridge report: {_text(data['run_dir'])}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>tokenbridge report</h1><p>{_text(data['run_dir'])} · generated {when}</p></header>"
        f"<nav>{nav}</nav><main>{''.join(body)}</main></body></html>\n"
    )


def _section(sid: str, has_data: bool, content: str) -> str:
    title = dict(SECTIONS)[sid]
    return (f'<section id="{sid}" data-has-data="{str(has_data).lower()}"><h2>{escape(title)}</h2>'
            f"{content}</section>")


def _empty(why: str) -> str:
    return f'<p class="empty">No data: {escape(why)}</p>'


def _fig(figures: dict[str, str | None], name: str, alt: str) -> str:
    uri = figures.get(name)
    return "" if uri is None else f'<img class="fig" data-figure="{name}" alt="{escape(alt)}" src="{uri}">'


def _text(v: Any) -> str:
    """Text from the data (a provider name, a sample id): escaped for HTML, controls shown."""
    return escape(printable(str(v)))


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    th = "".join(f"<th>{_text(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


class _Share(float):
    """A fraction shown as a percentage."""


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, _Share):
        return f"{v:.1%}"
    if isinstance(v, float):
        return escape(f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}")
    if isinstance(v, int):
        return f"{v:,}"
    return _text(v)


def _no_exchanges(data: dict[str, Any]) -> str:
    return exchanges_absent(data["run_dir"]) if data["sources"]["exchanges"] is None else \
        "no exchange carries meta.finished_at"


def _overview(data: dict[str, Any]) -> str:
    rows, ex = data["rows"], data.get("exchanges")
    cards = [("rows", rows["total"])] + [(s, rows["status"][s]) for s in ("ok", "flagged", "rejected")]
    if ex:
        cards += [("exchanges", ex["count"]), ("cost (USD)", ex.get("cost_total")),
                  ("duration (s)", ex.get("duration_s")), ("completion tok/s", ex.get("completion_tokens_per_s"))]
    html = '<div class="cards">' + "".join(
        f'<div class="card {escape(k) if k in ("ok", "flagged", "rejected") else ""}"><b>{_cell(v)}</b>{escape(k)}</div>'
        for k, v in cards) + "</div>"
    sources = data["sources"]
    html += (f'<p class="note">reconstructed: {_text(sources["reconstructed"])}; exchanges: '
             f'{_text(sources["exchanges"] or "not found")}</p>')
    for note in (source_note(sources), unreadable_note(data)):
        if note:
            html += f'<p class="note">{_text(note)}</p>'
    notes = left_out_notes(data["left_out"])
    if notes:
        html += ('<p class="note" id="left-out">Left out of these statistics (unusable numbers): '
                 + "; ".join(_text(n) for n in notes) + ".</p>")
    return _section("overview", rows["total"] > 0, html)


def _generation(data: dict[str, Any]) -> str:
    gen = data.get("generation")
    if not gen:
        why = data.get("generation_error") or "state.sqlite (generate's store) is not in the run folder"
        return _section("generation", False, _empty(why))
    n = gen["samples"]
    html = _table(["runs", "done", "failed", "pending", "requests", "failed attempts", "cost (USD)"],
                  [[gen["runs"], n["done"], n["failed"], n["pending"], gen["requests"], sum(gen["errors"].values()),
                    gen["cost_total"]]])
    if gen["errors"]:
        html += "<h3>Failed attempts per error class</h3>" + _table(["error class", "attempts"], gen["errors"].items())
    html += ('<p class="note">From state.sqlite: every generate invocation in this folder. Requests count every '
             "attempt, retries included; a failed attempt was retried or ended its sample as failed.</p>")
    return _section("generation", True, html)


def _ids_cell(samples: list[list[Any]], total: int) -> str:
    shown = " ".join(f"<code>{_text(sid)}</code>" if not choice else f"<code>{_text(sid)} (choice {choice})</code>"
                     for sid, choice in samples)
    more = total - len(samples)
    return shown + (f" <i>… and {more:,} more</i>" if more > 0 else "")


def _ids_table(label: str, kept: dict[str, list[list[Any]]], counts: dict[str, int]) -> str:
    rows = "".join(f"<tr><td>{_text(k)}</td><td>{counts.get(k, 0):,}</td><td class=\"ids\">{_ids_cell(v, counts.get(k, 0))}"
                   "</td></tr>" for k, v in kept.items() if counts.get(k, 0))
    return (f"<table><thead><tr><th>{escape(label)}</th><th>rows</th><th class=\"ids\">sample ids</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>")


def _samples(data: dict[str, Any]) -> str:
    if not data["rows"]["total"]:
        return _section("samples", False, _empty("the reconstructed file has no rows"))
    recon = data["sources"]["reconstructed"]
    html = (f'<p class="note">Look at one: <code>tokenbridge inspect {_text(recon)} --tokenizer TOKENIZER '
            "--id ID</code> (add <code>--choice N</code> where a choice is given). The first ids of each kind, "
            "in file order; report.json holds the same lists.</p>")
    if data["findings"]:
        html += "<h3>Per finding code</h3>" + _ids_table("code", data["samples_by_finding"], data["findings"])
    html += "<h3>Per status</h3>" + _ids_table("status", data["samples_by_status"], data["rows"]["status"])
    return _section("samples", True, html)


def _glossary(data: dict[str, Any]) -> str:
    rows = [[code, g["default"], g["meaning"], data["findings"].get(code, 0)] for code, g in data["glossary"].items()]
    html = (_table(["code", "default severity", "meaning", "rows here"], rows)
            + '<p class="note">A row is ok with no finding, rejected with any error, flagged otherwise. '
              "<code>--warn</code> / <code>--error</code> / <code>--off CODE</code> change a severity.</p>")
    return _section("glossary", True, html)


def _status_rows(groups: dict[str, Any]) -> Iterator[list[Any]]:
    for name, g in groups.items():
        st = g["status"]
        yield [name, g["rows"], st["ok"], st["flagged"], st["rejected"], _Share(st["ok"] / g["rows"]) if g["rows"] else None]


def _status(data: dict[str, Any], figures: dict[str, str | None]) -> str:
    if not data["rows"]["total"]:
        return _section("status", False, _empty("the reconstructed file has no rows"))
    head = ["", "rows", "ok", "flagged", "rejected", "ok share"]
    html = (_fig(figures, "status_provider", "status per provider")
            + "<h3>Per provider</h3>" + _table(["provider"] + head[1:], _status_rows(data["by_provider"]))
            + _fig(figures, "status_dataset", "status per dataset")
            + "<h3>Per dataset</h3>" + _table(["dataset"] + head[1:], _status_rows(data["by_dataset"])))
    return _section("status", True, html)


def _findings_table(groups: dict[str, Any], label: str) -> str:
    codes = sorted({c for g in groups.values() for c in g["findings"]})
    names = list(groups)
    return _table([f"code \\ {label}"] + names, ([c] + [groups[n]["findings"].get(c, 0) for n in names] for c in codes))


def _findings(data: dict[str, Any], figures: dict[str, str | None]) -> str:
    if not data["findings"]:
        return _section("findings", False, _empty("no row has a finding"))
    html = (_fig(figures, "findings", "finding codes")
            + "<h3>Per provider</h3>" + _findings_table(data["by_provider"], "provider")
            + "<h3>Per dataset</h3>" + _findings_table(data["by_dataset"], "dataset"))
    return _section("findings", True, html)


def _lengths(data: dict[str, Any], figures: dict[str, str | None]) -> str:
    lengths = data["lengths"]
    if not lengths["prompt"].get("count"):
        return _section("lengths", False, _empty("no ok or flagged row"))
    keys = ["count", "total", "mean", "min", "p50", "p90", "p99", "max"]
    html = (_fig(figures, "lengths", "length histograms")
            + _table(["tokens"] + keys, ([side] + [lengths[side][k] for k in keys] for side in ("prompt", "completion")))
            + f'<p class="note">Over {escape(lengths["rows"])}.</p>')
    return _section("lengths", True, html)


def _parity(data: dict[str, Any], figures: dict[str, str | None]) -> str:
    parity = data["usage_parity"]
    if parity is None:
        return _section("parity", False, _empty("no row carries usage"))
    keys = ["count", "exact", "exact_share", "mean", "mean_abs", "min", "max"]
    def cells(stats: dict[str, Any]) -> list[Any]:
        return [_Share(stats[k]) if k == "exact_share" and k in stats else stats.get(k) for k in keys]

    rows = [[side] + cells(parity[side]) for side in ("prompt", "completion")]
    per = [[prov, side] + cells(d[side]) for prov, d in parity["by_provider"].items() for side in ("prompt", "completion")]
    html = (_fig(figures, "parity", "usage parity deltas") + _table(["side"] + keys, rows)
            + "<h3>Per provider</h3>" + _table(["provider", "side"] + keys, per)
            + f'<p class="note">{escape(parity["definition"])}; 0 means the provider counted exactly our tokens.</p>')
    return _section("parity", True, html)


def _cost(data: dict[str, Any], figures: dict[str, str | None]) -> str:
    ex = data.get("exchanges")
    if not ex or not ex.get("timeline"):
        return _section("cost", False, _empty(_no_exchanges(data)))
    if ex.get("cost_total") is None:
        return _section("cost", False, _empty("no exchange carries meta.cost or usage.cost"))
    per = [[p, g["exchanges"], g["cost"], g["cost"] / g["exchanges"] if g["exchanges"] else None]
           for p, g in ex["by_provider"].items()]
    html = (_fig(figures, "cost", "cumulative cost")
            + _table(["provider", "exchanges", "cost (USD)", "USD / exchange"], per)
            + f'<p class="note">{ex["priced"]} of {ex["count"]} exchanges priced.</p>')
    return _section("cost", True, html)


def _throughput(data: dict[str, Any], figures: dict[str, str | None]) -> str:
    ex = data.get("exchanges")
    if not ex or not ex.get("timeline"):
        return _section("throughput", False, _empty(_no_exchanges(data)))
    lat = ex["latency_s"]
    per = [[p, g["exchanges"], g["completion_tokens"], g["mean_latency_s"]] for p, g in ex["by_provider"].items()]
    html = (_fig(figures, "throughput", "throughput over time")
            + _table(["exchanges", "attempts", "without choices", "duration (s)", "completion tok/s", "latency p50 (s)",
                      "latency p90 (s)"],
                     [[ex["count"], ex["attempts"], ex["errors"], ex.get("duration_s"), ex.get("completion_tokens_per_s"),
                       lat.get("p50"), lat.get("p90")]])
            + '<p class="note">Over the done samples in exchanges.jsonl: attempts include their retries; '
              "the Generation section counts every sample and attempt in the store.</p>"
            + _table(["provider", "exchanges", "completion tokens", "mean latency (s)"], per))
    return _section("throughput", True, html)
