"""Draft vocabulary for EAGLE-3: the N target tokens most often trained on.

Counts are taken over the loss mask (completion tokens only) of the rows a training
export would keep. Selection is frequency descending, then token id ascending, so the
result never depends on row order. When fewer than N distinct tokens were seen, the
rest is filled with the lowest token ids not seen yet, ascending (what SpecForge's and
speculators' own builders do, so the three agree on the same counts). The selected
ids are sorted ascending and become draft ids 0..N-1, giving

* ``d2t[d] = target_id - d`` (int64, shape [N]): ``target_id = d + d2t[d]``;
* ``t2d[t] = t is selected`` (bool, shape [target vocab size]).

Files written (``out_dir``):

* ``d2t.npy``, ``t2d.npy``: speculators ``--d2t-path`` / ``--t2d-path`` (``np.load``);
* ``vocab_mapping.pt``: ``{"d2t": LongTensor, "t2d": BoolTensor}`` for SpecForge
  ``model.vocab_mapping_path`` (``torch.load``), written by :mod:`.torchfile` (no torch
  needed);
* ``token_freq.pt``: ``{token_id: count}`` for speculators ``--token-freq-path`` (same);
* ``vocab.json``: sizes, coverage (fraction of masked tokens the draft vocab covers),
  coverage at other sizes, and which files were written.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..fsio import kill_point, publish_dir
from ..outdir import marker, own_names
from ..rows import ReconstructedRow
from . import torchfile
from .source import ExportError
from .writers import ids_array

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

__all__ = ["VocabCounter", "VocabJob", "VocabSummary", "build_vocab", "select_draft_vocab", "target_vocab_size_of",
           "tokenizer_sized"]

#: Masked ids are collected into a buffer this long before counting (bounded memory).
_COUNT_BUFFER = 1 << 20
_COVERAGE_SIZES = (1024, 4096, 8192, 16384, 32768, 65536)


@dataclass
class VocabSummary:
    draft_vocab_size: int
    target_vocab_size: int
    source: str
    include_flagged: bool
    #: where ``target_vocab_size`` came from: "given" (a flag, a config), "config.json" (the
    #: model's, in the tokenizer folder; Kimi's reserved range), or "tokenizer" (its ids alone)
    target_vocab_size_from: str = "given"
    rows: int = 0
    masked_tokens: int = 0
    distinct_tokens: int = 0
    filled_unseen: int = 0
    coverage: float = 0.0
    coverage_at: dict[str, float] = field(default_factory=dict)
    selection: str = "frequency desc, token id asc; short of N: lowest unseen ids, ascending"
    files: list[str] = field(default_factory=list)
    skipped_files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def target_vocab_size_of(tok: Tokenizer, given: int | None) -> tuple[int, str, str | None]:
    """(the length of ``t2d``, where it came from, a warning or None): ``given`` (a flag or a
    config), else the model's output size (:attr:`Tokenizer.model_vocab_size`), else the
    tokenizer's ids, with a warning: SpecForge and speculators load a ``t2d`` only as long
    as the model's ``lm_head`` (Qwen3's 151,936 rows for 151,669 tokenizer ids), so a
    mapping sized to the tokenizer is refused at training time, after the hidden states."""
    if given is not None:
        return given, "given", None
    if tok.model_vocab_size is not None:  # a folder with no config.json: Kimi's reserved range says it
        return tok.model_vocab_size, tok.model_vocab_from or "config.json", None
    return tok.vocab_size, "tokenizer", tokenizer_sized(tok.vocab_size, tok.source)


def tokenizer_sized(size: int, tokenizer: str) -> str:
    """The warning for a ``t2d`` sized to the tokenizer's ``size`` ids (see :func:`target_vocab_size_of`)."""
    return (f"t2d is sized to the tokenizer's {size} ids: {tokenizer} has no config.json with a readable "
            "vocab_size, the model's, which is often larger (padded), and SpecForge and speculators load a t2d only "
            "at the model's size; give it as --target-vocab-size (run: [vocab] target_vocab_size)")


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(d2t, t2d, filled)`` from per-target-id counts; ``filled`` = unseen ids added."""
    target_vocab_size = len(counts)
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft vocab size must be in 1..{target_vocab_size}, got {draft_vocab_size}")
    seen = np.flatnonzero(counts)
    order = seen[np.lexsort((seen, -counts[seen]))]  # last key is primary: count desc, then id asc
    chosen = order[:draft_vocab_size]
    filled = draft_vocab_size - len(chosen)
    if filled:
        unseen = np.flatnonzero(counts == 0)[:filled]
        chosen = np.concatenate([chosen, unseen])
    chosen = np.sort(chosen).astype(np.int64)
    d2t = chosen - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[chosen] = True
    return d2t, t2d, int(filled)


@dataclass(frozen=True)
class VocabJob:
    """The draft vocabulary to count in a pass over reconstruct output (:func:`tokenbridge.export.run_pass`)."""

    draft_vocab_size: int
    out_dir: Path
    target_vocab_size: int
    include_flagged: bool = False
    force: bool = False
    target_vocab_size_from: str = "given"

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"--draft-vocab-size must be in 1..{self.target_vocab_size}, got {self.draft_vocab_size}")
        object.__setattr__(self, "out_dir", Path(self.out_dir))


def build_vocab(
    src: str | Path,
    draft_vocab_size: int,
    out_dir: str | Path,
    target_vocab_size: int,
    include_flagged: bool = False,
    force: bool = False,
    *,
    target_vocab_size_from: str = "given",
) -> VocabSummary:
    """Count masked tokens of ``src`` and write the draft vocabulary files to ``out_dir``.

    The files are written as one set (:func:`tokenbridge.fsio.publish_dir`): a reader or a
    kill sees the old set or the new one, never ``d2t.npy`` and ``t2d.npy`` from two runs.
    ``out_dir`` must be missing, empty or an earlier vocab folder (else
    :class:`~tokenbridge.outdir.OutputRefused`, unless ``force``). The counting is a pass
    over ``src`` (:func:`tokenbridge.export.run_pass`), which can feed the exports too.
    """
    from .onepass import run_pass

    job = VocabJob(draft_vocab_size, Path(out_dir), target_vocab_size, include_flagged, force, target_vocab_size_from)
    vocab = run_pass(src, vocab=job).vocab
    assert vocab is not None
    return vocab


class VocabCounter:
    """Token counts under the loss mask of the rows a training export would keep."""

    def __init__(self, job: VocabJob, src: Path):
        self.job, self.src = job, src
        self.wanted = frozenset({"ok", "flagged"} if job.include_flagged else {"ok"})
        self.summary = VocabSummary(job.draft_vocab_size, job.target_vocab_size, str(src), job.include_flagged,
                                    job.target_vocab_size_from)
        self.counts = np.zeros(job.target_vocab_size, dtype=np.int64)
        self._buf: list[np.ndarray] = []
        self._buffered = 0

    def add(self, line: int, rec: ReconstructedRow) -> None:
        if rec["status"] not in self.wanted:
            return
        masked = ids_array(rec)[len(rec["prompt_ids"]):]  # validated: the mask is [0]*P + [1]*C
        top = int(masked.max())
        if top >= self.job.target_vocab_size:
            raise ExportError(self.src, line, "input_ids",
                              f"holds id {top}, outside the target vocab of {self.job.target_vocab_size}")
        self._buf.append(masked)
        self._buffered += len(masked)
        self.summary.rows += 1
        self.summary.masked_tokens += len(masked)
        if self._buffered >= _COUNT_BUFFER:
            self._drain()

    def _drain(self) -> None:
        if self._buf:
            self.counts += np.bincount(np.concatenate(self._buf), minlength=len(self.counts))
            self._buf.clear()
            self._buffered = 0

    def check_not_empty(self) -> None:
        if self.summary.masked_tokens == 0:
            raise ExportError(self.src, None, "status", "no ok row with masked tokens to count")

    def publish(self) -> VocabSummary:
        """Select the draft vocabulary and write its files as one set."""
        self._drain()
        self.check_not_empty()
        summary, counts = self.summary, self.counts
        d2t, t2d, filled = select_draft_vocab(counts, summary.draft_vocab_size)
        summary.distinct_tokens = int(np.count_nonzero(counts))
        summary.filled_unseen = filled
        ranked = np.sort(counts)[::-1]
        cumulative = np.cumsum(ranked, dtype=np.int64)
        summary.coverage = float(counts[t2d].sum() / summary.masked_tokens)
        summary.coverage_at = {
            str(n): float(cumulative[n - 1] / summary.masked_tokens)
            for n in _COVERAGE_SIZES if n <= summary.target_vocab_size
        }
        with publish_dir(self.job.out_dir, point="vocab", marker=marker("vocab"), owned=own_names("vocab")) as tmp:
            _write_files(tmp, d2t, t2d, counts, summary)
            kill_point("vocab:written")
            (tmp / "vocab.json").write_text(json.dumps(summary.to_dict(), indent=2) + "\n", encoding="utf-8")
        return summary


def _write_files(out_dir: Path, d2t: np.ndarray, t2d: np.ndarray, counts: np.ndarray, summary: VocabSummary) -> None:
    np.save(out_dir / "d2t.npy", d2t)
    np.save(out_dir / "t2d.npy", t2d)
    summary.files += ["d2t.npy", "t2d.npy"]
    # torch's own file format, written without torch (see torchfile): SpecForge needs it.
    torchfile.save({"d2t": d2t, "t2d": t2d}, out_dir / "vocab_mapping.pt")
    seen = np.flatnonzero(counts)
    torchfile.save({int(t): int(c) for t, c in zip(seen, counts[seen])}, out_dir / "token_freq.pt")
    summary.files += ["vocab_mapping.pt", "token_freq.pt"]
