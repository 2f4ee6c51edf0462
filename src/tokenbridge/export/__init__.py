"""Training-data exports and the draft vocabulary, from reconstruct output.

Python API (what ``tokenbridge export`` / ``tokenbridge vocab`` and the pipeline call)::

    from tokenbridge.export import export_file, build_vocab, ExportError

    summary = export_file("RUN/reconstructed.jsonl", "RUN/export/specforge", "specforge",
                          include_flagged=False)        # -> ExportSummary
    vocab = build_vocab("RUN/reconstructed.jsonl", 32000, "RUN/vocab",
                        target_vocab_size=163840)       # -> VocabSummary

Input: reconstruct's JSONL (or Parquet by suffix). Only ``status == "ok"`` rows are
used unless ``include_flagged``; ``rejected`` rows never. Every used row is validated
first (:mod:`.validate`): a wrong row stops with an :class:`ExportError` naming file,
line and field. Formats (:mod:`.writers`): ``specforge``, ``speculators``, ``parquet``,
``conversations``. Vocabulary layout and tie-breaking: :mod:`.vocab`.
"""

from .exporter import FORMATS, ExportSummary, export_file
from .source import ExportError, iter_records
from .validate import check_training_row
from .vocab import VocabSummary, build_vocab, select_draft_vocab

__all__ = [
    "FORMATS",
    "ExportError",
    "ExportSummary",
    "VocabSummary",
    "build_vocab",
    "check_training_row",
    "export_file",
    "iter_records",
    "select_draft_vocab",
]
