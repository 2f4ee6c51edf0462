"""``export_file``: reconstruct output -> one trainer's format, validated, streamed.

Rows are read, checked (:func:`check_training_row`) and written one at a time, in the one
pass over the file (:mod:`.onepass`) that may feed other exports, the vocabulary and the
report too; the output is built in a hidden sibling folder and swapped in only when
complete, so a failed export (a bad row stops it with file, line and field) leaves any
previous export of that folder untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import yaml

from ..display import printable
from ..fsio import OutputRefused, kill_point, read_small_text
from ..outdir import export_target
from ..rows import ReconstructedRow
from .formats import FORMATS
from .source import ExportError
from .writers import WRITERS, Writer

__all__ = ["FORMATS", "ExportJob", "ExportRun", "ExportSummary", "export_file"]


@dataclass
class ExportSummary:
    """What an export read, kept and skipped."""

    format: str
    source: str
    out_dir: str
    include_flagged: bool
    files: list[str] = field(default_factory=list)
    rows_read: int = 0
    rows_exported: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {"flagged": 0, "rejected": 0})
    tokens: int = 0
    completion_tokens: int = 0
    datasets: Counter[str] = field(default_factory=Counter)
    providers: Counter[str] = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["datasets"] = dict(sorted(self.datasets.items()))
        out["providers"] = dict(sorted(self.providers.items()))
        return out


@dataclass(frozen=True)
class ExportJob:
    """One export to write in a pass over reconstruct output (:func:`tokenbridge.export.run_pass`)."""

    fmt: str
    out_dir: Path
    include_flagged: bool = False
    force: bool = False
    #: Parquet shard tuning (``shard_rows``, ``shard_bytes``, ``row_group_rows``), speculators ``shard_bytes``
    options: Mapping[str, Any] = field(default_factory=dict)
    #: publish a folder with no row rather than fail (``run``: conversations may leave out every
    #: row it gets, cut turns, while the id formats export them)
    allow_empty: bool = False
    #: the folder is this format's own (``run``'s ``RUN/export/<fmt>``): an export of another
    #: format found there (a standalone export's wrong ``-f``) is replaced, not refused
    own_folder: bool = False

    def __post_init__(self) -> None:
        if self.fmt not in WRITERS:
            raise ValueError(f"unknown export format {self.fmt!r}; choose one of {', '.join(FORMATS)}")
        object.__setattr__(self, "out_dir", Path(self.out_dir))


def export_file(
    src: str | Path,
    out_dir: str | Path,
    fmt: str,
    include_flagged: bool = False,
    force: bool = False,
    vocab_size: int | None = None,
    **writer_options: Any,
) -> ExportSummary:
    """Export the ``ok`` rows of ``src`` (plus ``flagged`` ones if asked) to ``out_dir``.

    ``rejected`` rows are never exported. Raises :class:`ExportError` on the first row
    whose ids or mask are wrong, and when no row is left to export. ``writer_options``
    tune the Parquet shards (``shard_rows``, ``shard_bytes``, ``row_group_rows``).
    Each exported row is also held to :class:`~.validate.RowContract` (ids checked against
    ``vocab_size`` when given).
    ``out_dir`` must be missing, empty or an earlier export (else
    :class:`~tokenbridge.outdir.OutputRefused`, unless ``force``; see :mod:`tokenbridge.outdir`);
    a folder of exports (``RUN/export``) gets this format in ``out_dir/fmt``
    (:func:`~tokenbridge.outdir.export_target`), the other formats' folders left as they are.
    One export is a pass with one job: :func:`tokenbridge.export.run_pass` writes several at once.
    """
    from .onepass import run_pass

    job = ExportJob(fmt, export_target(out_dir, fmt), include_flagged, force, writer_options)
    return run_pass(src, exports=[job], vocab_size=vocab_size).exports[0]


class ExportRun:
    """One export during a pass: its writer in the staging folder, and its counts."""

    def __init__(self, job: ExportJob, src: Path, tmp: Path):
        self.job, self.src, self.tmp = job, src, tmp
        self.wanted = frozenset({"ok", "flagged"} if job.include_flagged else {"ok"})
        self.summary = ExportSummary(job.fmt, str(src), str(job.out_dir), job.include_flagged)
        self.writer: Writer = WRITERS[job.fmt](**job.options)
        self.writer.open(tmp)
        #: a format that leaves out rows it cannot write (conversations: cut turns), and the count's key
        self._skip = getattr(self.writer, "skip", None)
        if self._skip is not None:
            self.summary.skipped[self.writer.skip_key] = 0  # type: ignore[attr-defined]

    def add(self, line: int, rec: ReconstructedRow) -> None:
        summary = self.summary
        summary.rows_read += 1
        status = rec["status"]
        if status not in self.wanted:
            summary.skipped[status] += 1
            return
        if self._skip is not None and self._skip(rec):
            summary.skipped[self.writer.skip_key] += 1  # type: ignore[attr-defined]
            return
        self.writer.write(rec)
        n = len(rec["input_ids"])
        summary.rows_exported += 1
        summary.tokens += n
        summary.completion_tokens += n - len(rec["prompt_ids"])
        summary.datasets[str(rec["dataset"])] += 1
        summary.providers[str(rec["provider"])] += 1
        kill_point("export:row")

    def check_not_empty(self) -> None:
        summary = self.summary
        if summary.rows_exported == 0 and not self.job.allow_empty:
            hint = " (pass include_flagged / --include-flagged to export flagged rows)" if summary.skipped["flagged"] else ""
            raise ExportError(self.src, None, "status", f"no row to export: {summary.rows_read} read, skipped "
                              f"{summary.skipped['flagged']} flagged and {summary.skipped['rejected']} rejected"
                              f"{_not_a_turn(summary)}{hint}")

    def close(self) -> None:
        """Close the writer and write the dataset card; the folder is then ready to publish."""
        files = self.writer.close()
        if self.job.fmt == "speculators":
            _refuse_stale_caches(self.job.out_dir, self.tmp)
        self.summary.files = [p.relative_to(self.tmp).as_posix() for p in files] + ["README.md"]
        (self.tmp / "README.md").write_text(_card(self.summary), encoding="utf-8")
        kill_point("export:written")


#: What speculators (0.9.0) keeps in its ``--data-path`` (the export folder) for the rows it
#: was given there: the vocabulary it caches as ``d2t-<N>.npy`` / ``t2d-<N>.npy`` and loads
#: whenever both exist (``train/cli.py::parse_vocab_mappings``), and ``token_freq.pt``, read
#: when no ``--token-freq-path`` is given. Its hidden states are ``hidden_states/hs_<row index>.safetensors``
#: (``FileTransfer``), any entry there counted.
_SPECULATORS_CACHES = re.compile(r"^(?:(?:d2t|t2d)-\d+\.npy|token_freq\.pt)$")


def _ids_digest(folder: Path) -> str | None:
    """A digest of a speculators export's ``input_ids`` in row order (each row's length, then
    all ids), read from the shards its ``state.json`` names; None where there is no such
    export to read. What speculators' caches depend on: the ids and the order, not the
    metadata columns (a provider renamed, a finding reworded) the shards also hold."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        state = json.loads(read_small_text(folder / "state.json"))
        files = [f["filename"] for f in state["_data_files"]]
        lengths, values = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
        for name in files:
            if not isinstance(name, str) or "/" in name:
                return None
            with pa.memory_map(str(folder / name)) as source:
                for batch in ipc.open_stream(source):
                    ids = batch.column("input_ids")
                    lengths.update(ids.value_lengths().to_numpy(zero_copy_only=False).astype("<i8").tobytes())
                    values.update(ids.flatten().to_numpy(zero_copy_only=False).astype("<i8").tobytes())
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException):  # not a readable export: unknown rows
        return None
    return lengths.hexdigest() + values.hexdigest()


def _stale_caches(target: Path) -> list[str]:
    """The entries of ``target`` in which speculators keeps what it made of the rows there
    (:data:`_SPECULATORS_CACHES`, and ``hidden_states/`` when it holds anything), sorted."""
    try:
        names = sorted(n for n in os.listdir(target) if _SPECULATORS_CACHES.match(n))
    except OSError:
        return []
    try:
        with os.scandir(target / "hidden_states") as entries:
            if next(entries, None) is not None:
                names.insert(0, "hidden_states/")
    except OSError:  # none there, or not a folder
        pass
    return names


def _refuse_stale_caches(target: Path, staged: Path) -> None:
    """Raise :class:`~tokenbridge.fsio.OutputRefused` when the speculators export staged in
    ``staged`` changes the rows of ``target`` (their ids or order, :func:`_ids_digest`; or
    ``target`` holds no readable export) and ``target`` holds speculators' caches of the old rows (:func:`_stale_caches`).
    A re-export keeps every entry it did not write, and speculators reads these as they are:
    a stale vocabulary, and each row's hidden states by row index (rows whose ids differ
    dropped with a warning). Same rows (a rerun): kept, as every other entry of the user's."""
    names = _stale_caches(target)
    if not names:
        return
    before = _ids_digest(target)
    if before is not None and before == _ids_digest(staged):
        return
    raise OutputRefused(
        f"{target}: holds speculators' caches of the rows exported there before ({', '.join(names)}), and this "
        "export changes those rows: speculators would use them as they are (a stale draft vocabulary, hidden states "
        f"of other rows); nothing was written: move them out of {target}, or export into a new folder", target)


def _not_a_turn(summary: ExportSummary) -> str:
    """The conversations format's own skips, as words to add to a count of skipped rows."""
    n = summary.skipped.get("not_a_chat_turn")
    return "" if n is None else f", {n} not a chat turn (cut, or a reading no chat template writes)"


_LOADING = {
    "specforge": "SpecForge (online, pre-tokenized): set `data.prompts_path: {dir}/train.jsonl`.",
    "speculators": "speculators: `--data-path {dir}` (a `datasets.load_from_disk` folder; "
                   "hidden states go to `{dir}/hidden_states`, and speculators caches its draft vocabulary there "
                   "as `d2t-N.npy` / `t2d-N.npy` and reads a `token_freq.pt` there: a re-export of the same rows "
                   "keeps them, as everything else it did not write; one that changes the rows is refused while "
                   "they are there, since they belong to the old rows: move them away, or export into a new "
                   "folder).\n\n"
                   "Rows are in the order of the source file (reconstruct's, often one dataset after another), "
                   "not shuffled. speculators' trainer splits by row index: the last (1 - `--train-data-ratio`) "
                   "of the rows (default 0.9: the last 10%) are validation and never trained on, so whole "
                   "datasets may land there. Set `--train-data-ratio` (`data.train_data_ratio` in its YAML), or "
                   "shuffle into a new folder before generating hidden states: "
                   "`datasets.load_from_disk(\"{dir}\").shuffle(seed=0).save_to_disk(\"NEW\")`.",
    "parquet": "`datasets.load_dataset(\"parquet\", data_files=\"{dir}/data/*.parquet\", split=\"train\")`, "
               "or `datasets.load_dataset(\"{dir}\")`.",
    "conversations": "Conversations re-tokenized by the trainer's own chat template (SpecForge raw data, "
                     "speculators `prepare-data`); re-tokenizing may not reproduce tokenbridge's exact ids.\n\n"
                     "Only the final assistant turn is the target model's; earlier assistant turns in a history "
                     "are the prompt dataset's. SpecForge trains every assistant turn unless "
                     "`data.train_only_last_turn: true`; speculators' `prepare-data` makes a supervised row of "
                     "every assistant turn (no option), so histories with earlier assistant turns train text the "
                     "target never produced. The id formats (specforge, speculators, parquet) train only the "
                     "proven completion.",
}


#: Characters Markdown reads as syntax inside a table cell (a column, a code span, emphasis,
#: a link or image, an HTML tag or entity, the escape itself), and those GFM's autolinks
#: start from (``https:``, ``www.``, ``a@b``): each gets a backslash.
_MARKDOWN = re.compile(r"([\\`*_\[\]<>&|~:.@])")


def _cell(name: str) -> str:
    """A dataset or provider name (data, from the API or the prompt files) as one Markdown
    table cell that shows it as it is: controls, line breaks and invisible characters
    escaped (:func:`~tokenbridge.display.printable`), Markdown and HTML syntax backslashed,
    so no name can add a row, a column, a link or a tag to a card meant for publishing."""
    return _MARKDOWN.sub(r"\\\1", printable(name))


def _card(summary: ExportSummary) -> str:
    """Dataset card: YAML front matter (``configs`` for the Hub loader, our counts) + prose."""
    meta: dict[str, Any] = {}
    if summary.format == "parquet":
        meta["configs"] = [{"config_name": "default", "data_files": [{"split": "train", "path": "data/train-*.parquet"}]}]
    stats = summary.to_dict()
    stats.pop("out_dir")
    stats["source"] = printable(stats["source"])  # a path: its bytes need not be UTF-8
    for names in ("datasets", "providers"):  # data: shown escaped here too (GitHub renders the front matter)
        shown: Counter[str] = Counter()
        for k, v in stats[names].items():
            shown[printable(k)] += v
        stats[names] = dict(shown)
    meta["tokenbridge"] = stats
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    lines = [
        "---", front.rstrip("\n"), "---", "",
        f"# tokenbridge export: {summary.format}", "",
        "Exact target-model token ids rebuilt from API text by tokenbridge. `loss_mask` is 0 over the prompt "
        "and 1 over the whole completion (reasoning, `</think>`, content, tool-call markers, end token).", "",
        f"- Source: `{printable(summary.source)}`",
        f"- Statuses exported: {'ok + flagged' if summary.include_flagged else 'ok only'} (rejected never)",
        f"- Rows: {summary.rows_exported} exported of {summary.rows_read} read "
        f"(skipped {summary.skipped['flagged']} flagged, {summary.skipped['rejected']} rejected{_not_a_turn(summary)})",
        f"- Tokens: {summary.tokens} in total, {summary.completion_tokens} under the loss mask",
        "", "| dataset | rows |", "| --- | ---: |",
        *[f"| {_cell(k)} | {v} |" for k, v in sorted(summary.datasets.items())],
        "", "| provider | rows |", "| --- | ---: |",
        *[f"| {_cell(k)} | {v} |" for k, v in sorted(summary.providers.items())],
        "", "## Loading", "", _LOADING[summary.format].format(dir=printable(summary.out_dir)), "",
        "Every row carries `id`, `choice`, `dataset`, `provider`, `model`, `status` and `findings`.", "",
    ]
    return "\n".join(lines)
