"""One pass over reconstruct output feeds every export, the draft vocabulary and the report.

Reading and checking ``reconstructed.jsonl`` is most of what each later stage costs, so
``run`` reads it once: every row is parsed and checked against the row contract once
(:func:`tokenbridge.rows.iter_rows`), validated as a training row once if any consumer
wants its status (:func:`check_training_row`), and then handed to each consumer:

* each export (:class:`ExportJob`) writes into its own staging folder
  (:func:`tokenbridge.fsio.publish_dir`), published only when the whole pass succeeded;
* the vocabulary (:class:`VocabJob`) counts masked tokens, then writes its folder;
* ``stats`` (the report's :class:`tokenbridge.report.collect.RowStats`, or anything with
  ``add(row)``) sees every row, rejected ones included, each held to the contract the
  standalone ``report`` holds it to, whether or not an export or the vocabulary is in the
  pass (an ``ok`` row trainable; every row's status its findings', each sample choice once).

A bad row stops the pass before anything is published; the output folders are checked
(:func:`tokenbridge.outdir.check_output_dir`) before anything is read. ``export_file``
and ``build_vocab`` are passes with one job.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from collections.abc import Iterator, Sequence

from ..fsio import publish_dir, reading
from ..outdir import check_output_dir, marker, own_names
from ..rows import ReconstructedRow, iter_rows
from .exporter import ExportJob, ExportRun, ExportSummary
from .validate import RowContract, check_training_row
from .vocab import VocabCounter, VocabJob, VocabSummary

__all__ = ["PassResult", "RowStatsSink", "run_pass"]


class RowStatsSink(Protocol):
    """What the report's statistics need: every row, in file order."""

    def add(self, row: ReconstructedRow) -> None: ...


@dataclass
class PassResult:
    rows_read: int = 0
    exports: list[ExportSummary] = field(default_factory=list)  # in job order
    vocab: VocabSummary | None = None


def run_pass(
    src: str | Path,
    exports: Sequence[ExportJob] = (),
    vocab: VocabJob | None = None,
    stats: RowStatsSink | None = None,
    vocab_size: int | None = None,
    markers: frozenset[int] | None = None,
) -> PassResult:
    """Read ``src`` once and write every export in ``exports``, the ``vocab`` folder, and
    feed ``stats``. Raises :class:`~tokenbridge.export.ExportError` (a bad row, or a job
    left with no row) with nothing published, and
    :class:`~tokenbridge.outdir.OutputRefused` before reading when an output may not be replaced.
    Every row an export or the vocabulary takes is held to :class:`~.validate.RowContract`,
    its ids against ``vocab_size`` (default: the vocabulary job's target size) when known
    and its marker segments against the tokenizer's ``markers`` when given; every other
    row's status against its findings."""
    src = Path(src)
    for job in exports:
        check_output_dir(job.out_dir, "export", inputs=[src], force=job.force, fmt=job.fmt, any_format=job.own_folder)
    if vocab is not None:
        check_output_dir(vocab.out_dir, "vocab", inputs=[src], force=vocab.force)
    result = PassResult()
    with reading(src):  # an input named like a killed run's temp is not swept away
        with ExitStack() as stack:
            runs = [stack.enter_context(_staged_export(job, src)) for job in exports]
            counter = VocabCounter(vocab, src) if vocab is not None else None
            consumers: list[ExportRun | VocabCounter] = [*runs, *([counter] if counter is not None else [])]
            # the report vouches for every row as the standalone ``report`` does (an ``ok`` row
            # trainable, each row's status and (id, choice) once), with no export or vocabulary too
            trained = frozenset().union(*(c.wanted for c in consumers), {"ok"} if stats is not None else ())
            checked = bool(consumers) or stats is not None
            contract = RowContract(src, vocab_size if vocab_size is not None or vocab is None else vocab.target_vocab_size,
                                   markers)
            for line, row in iter_rows(src):
                result.rows_read += 1
                if row["status"] in trained:
                    ids, _ = check_training_row(row, src, line)
                    contract.check(row, line, ids)
                elif checked:  # left out, but a status its findings do not give is a hand edit to name
                    contract.check(row, line, None)
                for consumer in consumers:
                    consumer.add(line, row)
                if stats is not None:
                    stats.add(row)
            for run in runs:
                run.check_not_empty()
            if counter is not None:
                counter.check_not_empty()
            for run in runs:
                run.close()
                result.exports.append(run.summary)
        # leaving the stack published every export folder; the vocabulary's is written now
        if counter is not None:
            result.vocab = counter.publish()
    return result


@contextmanager
def _staged_export(job: ExportJob, src: Path) -> Iterator[ExportRun]:
    with publish_dir(job.out_dir, point="export", marker=marker("export", format=job.fmt),
                     owned=own_names("export")) as tmp:
        run = ExportRun(job, src, tmp)
        try:
            yield run
        except BaseException:
            run.writer.abort()
            raise
