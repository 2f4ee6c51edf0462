"""Run report: one self-contained HTML page, the same numbers as JSON and in the terminal.

Python API::

    from tokenbridge.report import build_report, collect_run, print_summary

    html_path = build_report("RUN")     # RUN/report/report.html + RUN/report/report.json
    data = collect_run("RUN")           # the numbers only (what report.json holds)
    print_summary(data)                 # rich tables

Inputs: ``RUN/reconstructed.jsonl`` (or ``.parquet``; required) and, when present,
``RUN/exchanges.jsonl`` (``meta.finished_at``, ``meta.cost``, ``meta.latency_s``,
``response.usage``) for cost and throughput over time, and ``RUN/state.sqlite`` (read
only) for generate's own counts. Sections: overview, generation, status and finding
counts per provider and per dataset, sample ids per finding code and per status, a
glossary of finding codes, prompt/completion length distributions, usage-parity deltas,
cost and throughput over time. Figures: :mod:`.plots`.
"""

from __future__ import annotations

from pathlib import Path

from ..jsonl import dumps_document
from .collect import ReportError, RowStats, collect_run
from .terminal import print_summary

__all__ = ["ReportError", "RowStats", "build_report", "collect_run", "print_summary"]


def build_report(run_dir: str | Path, force: bool = False, rows: RowStats | None = None) -> Path:
    """Write ``RUN/report/report.html`` and ``report.json`` (as one set); return the HTML path.

    ``RUN/report`` must be missing, empty or an earlier report (else
    :class:`~tokenbridge.outdir.OutputRefused`, unless ``force``). ``rows``: statistics
    already gathered over ``RUN/reconstructed.jsonl`` (the pipeline's one pass,
    :func:`tokenbridge.export.run_pass`); without them the file is read here."""
    from ..fsio import kill_point, publish_dir
    from ..outdir import check_output_dir, marker, own_names
    from .html import render_html
    from .plots import render_figures

    run_dir = Path(run_dir)
    out = run_dir / "report"
    check_output_dir(out, "report", force=force, flag="report folder")
    data = collect_run(run_dir, rows)
    try:
        figures = render_figures(data)
    except ImportError as exc:  # pragma: no cover - matplotlib is a dependency
        raise ReportError(f"the report needs matplotlib ({exc})") from None
    with publish_dir(out, point="report", marker=marker("report"), owned=own_names("report")) as tmp:
        (tmp / "report.json").write_text(dumps_document(data, indent=1), encoding="utf-8")
        kill_point("report:written")
        (tmp / "report.html").write_text(render_html(data, figures), encoding="utf-8")
    return out / "report.html"
