"""Training-data exports and the draft vocabulary, from reconstruct output.

Python API (what ``tokenbridge export`` / ``tokenbridge vocab`` and the pipeline call)::

    from tokenbridge.export import export_file, build_vocab, run_pass, ExportJob, VocabJob, ExportError

    summary = export_file("RUN/reconstructed.jsonl", "RUN/export/specforge", "specforge",
                          include_flagged=False)        # -> ExportSummary
    vocab = build_vocab("RUN/reconstructed.jsonl", 32000, "RUN/vocab",
                        target_vocab_size=163840)       # -> VocabSummary
    result = run_pass("RUN/reconstructed.jsonl",        # one read for all of them (what `run` does)
                      exports=[ExportJob("specforge", "RUN/export/specforge")],
                      vocab=VocabJob(32000, "RUN/vocab", 163840), stats=report_row_stats)

Input: reconstruct's JSONL (or Parquet by suffix), read through :mod:`tokenbridge.rows`.
Only ``status == "ok"`` rows are used unless ``include_flagged``; ``rejected`` rows
never. Every used row is validated first (:mod:`.validate`): a wrong row stops with an
:class:`ExportError` naming file, line and field. Formats (:mod:`.writers`, each a
:class:`~.writers.Writer`): ``specforge``, ``speculators``, ``parquet``,
``conversations``. The one pass: :mod:`.onepass`. Vocabulary layout and tie-breaking:
:mod:`.vocab`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .exporter import FORMATS, ExportJob, ExportSummary, export_file
    from .onepass import PassResult, run_pass
    from .source import ExportError, iter_records
    from .validate import check_training_row
    from .vocab import VocabJob, VocabSummary, build_vocab, select_draft_vocab
    from .writers import Writer

#: Where each public name lives. Loaded on first use (PEP 562), so importing one light
#: submodule (``formats``, ``source``, ``validate``) does not load the writers' numpy and
#: pyarrow: ``reconstruct`` and ``inspect`` start without them.
_HOMES: dict[str, str] = {
    "FORMATS": "formats", "ExportJob": "exporter", "ExportSummary": "exporter", "export_file": "exporter",
    "PassResult": "onepass", "run_pass": "onepass", "ExportError": "source", "iter_records": "source",
    "check_training_row": "validate", "VocabJob": "vocab", "VocabSummary": "vocab", "build_vocab": "vocab",
    "select_draft_vocab": "vocab", "Writer": "writers",
}


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "FORMATS",
    "ExportError",
    "ExportJob",
    "ExportSummary",
    "PassResult",
    "VocabJob",
    "VocabSummary",
    "Writer",
    "build_vocab",
    "check_training_row",
    "export_file",
    "iter_records",
    "run_pass",
    "select_draft_vocab",
]
