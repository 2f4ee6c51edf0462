"""``tokenbridge run CONFIG``: datasets → generate → reconstruct → export → vocab → report.

Every stage is resumable and skipped when already done: a stage records a fingerprint
of its inputs (content hashes) and settings in ``RUN/pipeline.json`` after it finishes,
and runs again only when that fingerprint changes or its output is gone. Generation
resumes from its own store, so re-running after a crash continues where it stopped.
Content hashes are cached by file identity (:mod:`tokenbridge.digests`), so a rerun of a
finished run reads no data file in full.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from contextlib import nullcontext
from contextvars import ContextVar
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping

from . import fsio, interrupt
from .display import printable
from .digests import DigestCache, FileIdentity, read_digest
from .exit_codes import ExitCode
from .outdir import OutputKind, remove_own_output
from .runconfig import (PipelineError, RunConfig, check_before_generate, check_out, check_stage_folders,
                        load_run_config)
from .runconfig import emulator_config as _emulator_config

if TYPE_CHECKING:
    from .export import ExportJob, PassResult, VocabJob
    from .report import RowStats
    from .tokenizer import Tokenizer

__all__ = ["PipelineError", "RunConfig", "StageResult", "incomplete", "load_run_config", "run_pipeline"]


@dataclass
class StageResult:
    name: str
    status: str  # "ran" | "skipped"
    detail: dict[str, Any] = field(default_factory=dict)


def incomplete(results: list[StageResult]) -> bool:
    """Whether the run finished with something left behind: samples generate could not get
    or bad prompt rows, or exchange records reconstruct refused (exit 1, as each stage alone)."""
    for r in results:
        if r.name == "generate" and r.detail.get("exit_code") == ExitCode.INCOMPLETE:
            return True
        if r.name == "reconstruct" and r.detail.get("bad_lines"):
            return True
    return False


# --- stage bookkeeping -------------------------------------------------------------------


def _digest(path: Path) -> str:
    """The file's SHA-256; during a run from the run's cache (read only if it changed)."""
    state = _RUN_STATE.get()
    return state.digests.digest(path) if state is not None else read_digest(path).sha256


def _tokenizer_identity(source: str) -> str:
    """A digest of the files the tokenizer is read from (a folder), else its name: a changed
    vocab (gpt-oss's ``*.tiktoken`` ranks too), pattern or template must re-run reconstruction."""
    from .tokenizer import folder_files

    folder = Path(source)
    if not folder.is_dir():
        return source
    h = hashlib.sha256()
    for p in folder_files(folder):
        h.update(p.name.encode() + _digest(p).encode())
    return h.hexdigest()


def _fingerprint(inputs: list[Path], settings: Any) -> str:
    """What a stage's output depends on: the package, the gate, ``settings`` and the inputs'
    contents. Stages that write the run folder's path into their output (the exports'
    READMEs and load instructions, ``vocab.json``'s source, the report) put it in their
    settings (``at``): a run folder moved elsewhere makes them again, pointing at it."""
    from . import __version__
    from .checks import GATE_REVISION

    h = hashlib.sha256(json.dumps({"tokenbridge": __version__, "gate": GATE_REVISION, **settings}, sort_keys=True,
                                  default=str).encode())
    for p in inputs:
        h.update(_digest(p).encode() if p.exists() else b"-")
    return h.hexdigest()


class _State:
    """RUN/pipeline.json: one fingerprint per finished stage and the digest cache, written
    atomically. Made once per run; it is then the run's state (``_RUN_STATE``), whose cache
    :func:`_digest` uses. A damaged file is said (``echo``) and only costs re-running."""

    def __init__(self, out: Path, echo: Callable[[str], None] = print):
        self.path = out / "pipeline.json"
        self.data, self.digests, problems = _load_state(self.path)
        for problem in problems:
            echo(f"warning: {self.path}: {problem}")
        _RUN_STATE.set(self)

    def done(self, stage: str, fingerprint: str, output: Path) -> bool:
        """Whether ``stage`` finished with these inputs and its output is still the one it
        wrote: a file deleted from an output folder, or a folder another command rewrote (a
        standalone ``export``/``vocab``/``report`` with other settings), runs it again."""
        entry = self.data.get(stage, {})
        if entry.get("fingerprint") != fingerprint or not output.exists():
            return False
        names, wrote = entry.get("files"), entry.get("output")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return wrote is None  # recorded before outputs were (or a damaged entry: run it again)
        return bool(wrote == _output_signature(output, names))

    def wrote(self, stage: str, folder: Path) -> bool:
        """Whether ``folder`` is, by its entries' identities (nothing read), the output
        ``stage`` recorded writing, whatever its inputs now."""
        entry = self.data.get(stage, {})
        names = entry.get("files")
        return isinstance(names, list) and entry.get("output") == _output_signature(folder, names)

    def record(self, stage: str, fingerprint: str, detail: Mapping[str, Any], folder: Path | None = None) -> None:
        """``stage`` done; ``folder``: the output folder it wrote, whose entries :meth:`done` checks."""
        self.data[stage] = {"fingerprint": fingerprint, **detail}
        if folder is not None:
            names = _output_names(folder)
            self.data[stage].update(files=names, output=_output_signature(folder, names))
        self._save()

    def drop_field(self, stage: str, name: str) -> None:
        """Forget one field of ``stage``'s record (saved at once)."""
        if self.data.get(stage, {}).pop(name, None) is not None:
            self._save()

    def forget(self, stage: str) -> None:
        if self.data.pop(stage, None) is not None:
            self._save()

    def settle(self) -> None:
        """After the last stage: make the digests taken of fresh files trusted for the next run."""
        self.digests.settle()
        if self.digests.changed:
            self._save()

    def _save(self) -> None:
        doc = {**self.data, _DIGESTS_KEY: self.digests.to_json()}
        fsio.write_text(self.path, json.dumps(doc, indent=2, default=str) + "\n", point="state")
        self.digests.changed = False


def _output_names(folder: Path) -> list[str]:
    """The entries a stage's output folder holds as tokenbridge's (its marker's list), read
    once when the stage is recorded."""
    return sorted(fsio.marker_files(folder) or ())


def _output_signature(folder: Path, names: list[str]) -> list[Any]:
    """The identity (:class:`~tokenbridge.digests.FileIdentity`, nothing read) of an output
    folder's marker and of each of its entries ``names``, a sub-folder too; a missing one
    is None. A user's entries beside them do not count."""
    def ident(p: Path) -> list[int] | None:
        try:
            return list(astuple(FileIdentity.of(p.lstat())))
        except OSError:
            return None

    return [ident(folder / fsio.MARKER), *(ident(folder / name) for name in names)]


#: The run in progress (its _State), so _fingerprint finds the digest cache without being passed it.
_RUN_STATE: ContextVar[_State | None] = ContextVar("tokenbridge_run_state", default=None)
#: pipeline.json's key for the digest cache; every other top-level key is a stage.
_DIGESTS_KEY = "digests"
def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _counts(value: Any) -> bool:
    return isinstance(value, dict) and all(_count(n) for n in value.values())


def _texts(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _signature(value: Any) -> bool:
    """What :func:`_output_signature` writes: a list of identities (lists of counts) or nulls."""
    return isinstance(value, list) and all(v is None or (isinstance(v, list) and all(map(_count, v))) for v in value)


#: Every field a stage's entry may hold beyond its fingerprint, and what it must be: each is
#: read (printed, summed, compared) by the pipeline, so an entry is checked whole, once, as
#: it is loaded, and one off in any field only runs its stage again.
_ENTRY_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "status": ("an object of counts", _counts), "bad_lines": ("a count", _count),
    "bad_shown": ("a list of strings", _texts), "provider_notes": ("a list of strings", _texts),
    "rows_sha256": ("a string", lambda v: isinstance(v, str)), "rows": ("a count", _count),
    "skipped": ("an object of counts", _counts), "coverage": ("a number", _number),
    "distinct_tokens": ("a count", _count), "html": ("a string", lambda v: isinstance(v, str)),
    "files": ("a list of strings", _texts), "output": ("a list of file identities", _signature),
}
#: The fields a stage's line needs when it is skipped (a vocabulary's coverage is printed as a number).
_REQUIRED = {"vocab": ("coverage",)}


def _load_state(path: Path) -> tuple[dict[str, Any], DigestCache, list[str]]:
    """The stages and the digest cache of ``path`` (empty when it is missing), and what was
    damaged in it: a damaged stage only runs again, a damaged digest is only computed again."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}, DigestCache(), []
    except OSError as exc:
        raise PipelineError(f"{path}: cannot read the run's stage record ({exc.strerror or exc}); "
                            "move it away to re-run every stage") from None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return {}, DigestCache(), [f"damaged (not valid JSON: {exc}); every stage after generate runs again"]
    except RecursionError:  # parsed by the stdlib: nested deeper than Python's stack
        return {}, DigestCache(), ["damaged (nested too deeply to read); every stage after generate runs again"]
    if not isinstance(doc, dict):
        return {}, DigestCache(), ["damaged (not a JSON object); every stage after generate runs again"]
    digests, bad_digests = DigestCache.from_json(doc.pop(_DIGESTS_KEY, None))
    problems = []
    if bad_digests:
        problems.append(f"{len(bad_digests)} cached digest(s) damaged ({bad_digests[0]}); those files are read again")
    stages = {}
    for stage, entry in doc.items():
        why = _entry_problem(stage, entry)
        if why:
            problems.append(f"stage {stage!r} damaged ({why}); it runs again")
        else:
            stages[stage] = entry
    return stages, digests, problems


def _entry_problem(stage: str, entry: Any) -> str | None:
    """Why a stage's entry cannot be used, or None: every field the pipeline reads, checked
    whole (``reconstruct.status.ok = "148"`` was a TypeError once summed, ``skipped = [1]``
    an AttributeError)."""
    if not isinstance(entry, dict):
        return "not an object"
    if not isinstance(entry.get("fingerprint"), str):
        return "no fingerprint"
    for name in _REQUIRED.get(stage, ()):
        if name not in entry:
            return f"{name} is missing"
    for name, (what, valid) in _ENTRY_FIELDS.items():
        if name in entry and not valid(entry[name]):
            return f"{name} is not {what}"
    return None


def run_pipeline(cfg: RunConfig, echo: Callable[[str], None] = print) -> list[StageResult]:
    """Run every stage in order, holding the run folder's lock throughout; returns what
    each stage did. Raises PipelineError (and RunFolderBusy when another process holds
    the folder); a ``[run] out`` that is not a new, empty or earlier run folder is refused
    before anything is written into it (:func:`~tokenbridge.runconfig.check_out`)."""
    from .generate.lock import run_lock

    check_out(cfg)  # before the lock: its file would make any folder look like a run's
    datasets = (d["path"] for d in cfg.generate.get("datasets", ()))
    with fsio.reading(cfg.source, *datasets), \
            run_lock(cfg.out, command="run", retry=f"or set another [run] out in {cfg.source}"):
        for folder in (cfg.out, cfg.out / "export"):
            if not folder.is_symlink():  # a link at export is refused: nothing is done through it
                fsio.clean_stale_temps(folder)
        token = _RUN_STATE.set(None)
        try:
            results = _run_stages(cfg, echo)
            _settle(cfg.out)
            return results
        finally:
            _RUN_STATE.reset(token)


def _settle(out: Path) -> None:
    """After a complete run: re-read the outputs digested while still fresh (once, now that
    they have aged) and tell generate that exchanges.jsonl is the file it wrote, so the next
    run reads neither (see tokenbridge.digests)."""
    import sqlite3

    from .generate.run import EXCHANGES_FILE, confirm_exchanges
    from .generate.store import StoreError

    state = _RUN_STATE.get()
    if state is None:
        return
    state.settle()
    known = state.digests.entry(out / EXCHANGES_FILE)
    try:
        if known is not None:
            confirm_exchanges(out, known)
    except (StoreError, sqlite3.Error):
        pass  # only a saving: the next generate reads the file to tell


#: The files ``run`` itself reads and rewrites in its folder (generate's aside), and what each is.
_RUN_FILES = {"pipeline.json": "the run's stage record", "reconstructed.jsonl": "the rows reconstruct writes"}


def _check_run_files(out: Path) -> None:
    """Refuse (exit 2), before anything is sent, a file of :data:`_RUN_FILES` that is not
    missing or a regular file: a folder there crashed the run, a FIFO hung it, and a rewrite
    would have to remove what ``run`` did not make. A symlink to a regular file is allowed
    only at ``reconstructed.jsonl`` (its rows are used as they are; run never writes through
    it: :func:`_own_output`); ``pipeline.json`` is rewritten by every stage."""
    for name, what in _RUN_FILES.items():
        path = out / name
        why = _not_a_file(path, links=name == "reconstructed.jsonl")
        if why is not None:
            raise PipelineError(f"{path}: {why}, not {what}; run reads and rewrites that file itself: move it "
                                "away and run again", code=ExitCode.USAGE)


def _not_a_file(path: Path, *, links: bool) -> str | None:
    """What ``path`` is, in words, when it is neither missing nor a regular file (``links``:
    nor a symlink to one), else None. Nothing is opened: a FIFO would block."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror or exc})"
    if stat.S_ISREG(info.st_mode):
        return None
    if not stat.S_ISLNK(info.st_mode):
        return f"is {fsio.kind_of(info.st_mode)}"
    target = os.readlink(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return f"is a symbolic link to {target}, which is missing (or a loop)"
    if not links or not stat.S_ISREG(mode):
        return f"is a symbolic link to {target}, {fsio.kind_of(mode)}"
    return None


def _own_output(path: Path, what: str) -> None:
    """Before a stage writes ``path``, a file ``run`` names itself: refuse (exit 2) a
    symlink there. Written through, it would replace the file it names, outside the run
    folder (a user's curated rows); replaced, the link would be removed, and run removes
    nothing it did not make."""
    why = _not_a_file(path, links=False)
    if why is not None:
        raise PipelineError(f"{path}: {why}, not {what}; run writes that file itself and never through a link or "
                            "over anything but a file: remove it (the file a link names is kept) to have it written "
                            "again", code=ExitCode.USAGE)


def _not_an_edit(path: Path, done: Mapping[str, Any], echo: Callable[[str], None]) -> None:
    """Before reconstruct writes ``path`` again: refuse (exit 2) a file there that the stage's
    record says is not the one it wrote (edited or replaced since). While the stage skips,
    such a file is used as it is; a config change that made the stage run again replaced a
    user's curated rows without a word (a cold tester's). With no record (pipeline.json
    deleted or damaged, or a run killed between writing the rows and recording them, whose
    rerun must go on) the file is replaced, and the run says so."""
    if not path.is_file():
        return
    wrote = done.get("rows_sha256")
    if not isinstance(wrote, str):
        echo(f"reconstruct: warning: {path}: pipeline.json holds no digest of it (deleted, damaged or older, or a run "
             "stopped while writing it): written again")
        return
    if wrote != _digest(path):
        raise PipelineError(f"{path} is not the file reconstruct wrote (edited or replaced since), and reconstruct must "
                            "run again (its input or settings changed), which would replace it: move it elsewhere to "
                            "keep it, or delete it to have it written again", code=ExitCode.USAGE)


def _run_stages(cfg: RunConfig, echo: Callable[[str], None]) -> list[StageResult]:
    from .tokenizer import TokenizerError, load_tokenizer

    _check_run_files(cfg.out)
    state = _State(cfg.out, echo)
    try:
        tok = load_tokenizer(cfg.tokenizer)
    except TokenizerError as exc:  # a folder that is there but holds no tokenizer: named where the config names it
        raise PipelineError(f"{cfg.tokenizer_at[0]}{exc}{cfg.tokenizer_at[1]}", ExitCode.CONFIG) from None
    check_before_generate(cfg, tok)  # the config checks that need the tokenizer, before any request
    check_stage_folders(cfg, state.wrote)  # every output folder a stage writes, before any request
    results = [_generate_stage(cfg, tok, echo)]
    results.append(_reconstruct_stage(cfg, tok, state, echo))
    results.extend(_after_reconstruct(cfg, tok, state, echo))
    return results


def _generate_stage(cfg: RunConfig, tok: Tokenizer, echo: Callable[[str], None]) -> StageResult:
    """1. generate (resumes from its store; done samples are never sent again). Raises
    PipelineError when it stopped or failed: the later stages never run on stale exchanges."""
    from .emulator import running_emulator
    from .generate import generate_run, settings_from_mapping
    from .generate.engine import StopReason
    from .generate.errors import SettingsChanged
    from .generate.outcome import describe_run, no_finish_line

    out = cfg.out
    settings = settings_from_mapping(cfg.generate, source=str(cfg.source))  # paths joined by load_run_config
    context = running_emulator(_emulator_config(cfg), tokenizer=tok) if cfg.use_emulator else nullcontext(None)
    with context as url:
        if url is not None:
            settings = settings.with_overrides(base_url=url)
            echo(f"generate: built-in emulator at {url}")
        with interrupt.kept_handlers():  # generate leaves the default ones behind
            try:
                summary = generate_run(settings, out)
            except SettingsChanged as exc:  # run has no --out or --force-settings: its own ways out
                raise PipelineError(f"{exc.what}. Put those settings back in {cfg.source}, or give [run] out another "
                                    "folder for the new ones (the store keeps every answer it paid for)",
                                    code=exc.exit_code) from None
    exchanges = out / "exchanges.jsonl"
    detail = {"done": summary.done, "failed": summary.failed, "spent_usd": summary.spent_total,
              "stop_reason": summary.stop_reason, "exit_code": summary.exit_code}
    echo(f"generate: {describe_run(summary)}")
    for row in summary.bad_rows[:5]:  # what `generate` prints: each bad prompt row names file, line and field
        echo(printable(f"generate: bad row: {row}"))
    if len(summary.bad_rows) > 5:
        echo(f"generate: {len(summary.bad_rows)} bad rows in all (listed in {out / 'generate.json'})")
    for f in summary.failures[:5]:
        echo(printable(f"generate: failed: {f['id']}: {f['error_class']}: {f['error']}"))  # API text
    if summary.no_finish:
        echo(printable(f"generate: {no_finish_line(summary)}"))
    if summary.left_out:  # paid for, kept in the store, but no longer in this config's prompts
        echo(f"generate: {summary.left_out} stored sample(s) of prompts no longer in this config are kept in the "
             f"store and left out of {exchanges.name} and every stage after it")
    if summary.stop_reason:
        if summary.stop_reason == StopReason.INTERRUPTED:  # nothing to fix: the user stopped it
            raise PipelineError("generate stopped (interrupted); run the same command again to continue",
                                code=summary.exit_code or 1)
        raise PipelineError(f"generate stopped ({summary.stop_reason}); fix it and run the same command again",
                            code=summary.exit_code or 1)
    if summary.exit_code not in _GENERATE_GOES_ON or not summary.exchanges:  # not rewritten: stale
        why = "; ".join(summary.notices[-3:]) or f"exit status {summary.exit_code}"
        raise PipelineError(f"generate failed ({why}); the later stages were not run on a stale {exchanges.name}; "
                            "fix it and run the same command again", code=summary.exit_code)
    if not exchanges.exists():
        raise PipelineError(f"generate wrote no {exchanges}")
    return StageResult("generate", "ran", detail)


def _reconstruct_stage(cfg: RunConfig, tok: Tokenizer, state: _State, echo: Callable[[str], None]) -> StageResult:
    """2. reconstruct exchanges.jsonl into reconstructed.jsonl (skipped while unchanged)."""
    from .reconstruct import reconstruct_file
    from .view import status_text

    exchanges, reconstructed = cfg.out / "exchanges.jsonl", cfg.out / "reconstructed.jsonl"
    fp = _fingerprint([exchanges], {"tokenizer": _tokenizer_identity(cfg.tokenizer), "dialect": cfg.dialect,
                                    "policy": dict(cfg.policy.severities), "tol": cfg.policy.usage_tolerance,
                                    "profile": dict(cfg.provider_profile or {})})
    if state.done("reconstruct", fp, reconstructed):
        result = StageResult("reconstruct", "skipped", {"bad_lines": state.data["reconstruct"].get("bad_lines") or 0})
    else:
        _own_output(reconstructed, "the file reconstruct wrote")
        _not_an_edit(reconstructed, state.data.get("reconstruct") or {}, echo)
        # the digest of the rows it wrote last is no longer theirs once it writes: a run stopped
        # between the rename and the record must not take its own new rows for an edit
        state.drop_field("reconstruct", "rows_sha256")
        rs = reconstruct_file(exchanges, reconstructed, tok, dialect=cfg.dialect, policy=cfg.policy,
                              provider_profile=cfg.provider_profile)
        detail = rs.to_dict()
        # its digest, so a later run tells the file it wrote from one replaced or edited since
        # (a fresh file's digest is not trusted yet: the exports' fingerprints read it once more)
        state.record("reconstruct", fp, {"status": detail["status"], "bad_lines": rs.bad_line_count,
                                         # line, field, why: the file is the run's own, wherever the run is now
                                         "bad_shown": [f"{b.line}: {b.field}: {b.message}"
                                                       for b in rs.bad_lines[:_SHOWN_BAD_LINES]],
                                         "provider_notes": detail["provider_notes"] + rs.calibration_notes(),
                                         "rows_sha256": _digest(reconstructed)})
        result = StageResult("reconstruct", "ran", detail)
    echo(f"reconstruct: {result.status} → {reconstructed}: {status_text(state.data['reconstruct'].get('status') or {})}")
    wrote = state.data["reconstruct"].get("rows_sha256")
    if result.status == "skipped" and isinstance(wrote, str) and wrote != _digest(reconstructed):
        echo(f"reconstruct: warning: {reconstructed} is not the file this stage wrote (replaced or edited since): "
             "the counts above are the stage's, and the stages after it read the file as it is (rows the "
             "config's gate did not judge included); delete it to have it written again")
    for note in state.data["reconstruct"].get("provider_notes") or ():
        echo(f"reconstruct: warning: {printable(note)}")  # names providers
    _echo_bad_records(state.data["reconstruct"], exchanges, echo)
    return result


#: Bad records ``run`` names, as generate's bad rows; the count says how many in all.
_SHOWN_BAD_LINES = 5


def _echo_bad_records(done: Mapping[str, Any], exchanges: Path, echo: Callable[[str], None]) -> None:
    """The records reconstruct refused, as ``reconstruct`` itself prints them: a run whose
    every paid record was refused showed "0 ok, 0 flagged, 0 rejected" and exit 1, the why
    only in pipeline.json."""
    count = done.get("bad_lines") or 0
    for bad in done.get("bad_shown") or ():
        echo(printable(f"reconstruct: bad record: {exchanges}:{bad}"))
    if count:
        echo(f"reconstruct: {count} bad record(s) skipped (listed in pipeline.json)")


#: stage -> (fingerprint, "ran" | "skipped" | "empty"), in stage order
_Plan = dict[str, tuple[str, str]]


def _after_reconstruct(cfg: RunConfig, tok: Tokenizer, state: _State, echo: Callable[[str], None]) -> list[StageResult]:
    """3-5. exports (one stage per format, skipped, not failed, when no row qualifies), draft
    vocabulary and the report's row statistics, all from one pass over reconstructed.jsonl;
    then the report. A bad row is a PipelineError with the row's exit code (1)."""
    from .export import ExportError, run_pass
    from .report import RowStats

    out = cfg.out
    reconstructed = out / "reconstructed.jsonl"
    plan, exports, vocab_job = _plan_exports(cfg, tok, state)
    # the report is fingerprinted first: its row statistics come from the same pass, which
    # then runs only for what is due
    report_html = out / "report" / "report.html"
    report_fp = (_fingerprint([reconstructed, out / "exchanges.jsonl"], {"report": _store_counts(out), "at": str(out)})
                 if cfg.report else "")
    report_due = cfg.report and not state.done("report", report_fp, report_html.parent)
    row_stats = RowStats() if report_due else None
    passed = None
    if exports or vocab_job is not None or row_stats is not None:
        try:
            passed = run_pass(reconstructed, exports=exports, vocab=vocab_job, stats=row_stats, vocab_size=tok.vocab_size,
                              markers=frozenset(tok.marker_ids))
        except ExportError as exc:  # a bad row: bad data, as for reconstruct's bad records
            raise PipelineError(str(exc), code=exc.exit_code) from None
    results = _record_pass(cfg, state, plan, passed, echo)
    if cfg.report:
        results.append(_report_stage(cfg, state, report_fp, report_due, row_stats, echo))
    _left_over(cfg, state, echo)
    return results


def _stage_folder(out: Path, stage: str) -> Path:
    """Where a stage after reconstruct writes: ``export:FMT`` in ``export/FMT``, ``vocab``
    and ``report`` in their own folders."""
    fmt = stage.partition(":")[2]
    return out / "export" / fmt if fmt else out / stage


def _left_over(cfg: RunConfig, state: _State, echo: Callable[[str], None]) -> None:
    """Say which outputs an earlier run made for a stage this config no longer asks for
    (a format taken out of ``export.formats``, the vocabulary or the report turned off) and
    that were made from other rows than this run's: they stay as they were, and read as
    this run's they disagreed with it without a word (a cold tester's). Ones made from these
    very rows are still right and are not named."""
    rows = _digest(cfg.out / "reconstructed.jsonl")
    asked = {f"export:{f}" for f in cfg.export_formats}
    asked |= {stage for stage, on in (("vocab", cfg.draft_vocab_size), ("report", cfg.report)) if on}
    for stage, entry in state.data.items():
        fmt = stage.partition(":")[2]
        if stage in asked or not (fmt or stage in ("vocab", "report")) or entry.get("rows_sha256") in (rows, None):
            continue  # (no digest: a record older than them, which says nothing either way)
        target = _stage_folder(cfg.out, stage)
        if target.exists():
            why = (f"{fmt!r} is no longer in export.formats" if fmt else "vocab.draft_vocab_size is no longer set"
                   if stage == "vocab" else "report.enabled is false")
            echo(f"warning: {target} is an earlier run's ({why}), made from other rows than this run's: it is left "
                 "as it was; delete it if you do not need it")


def _plan_exports(cfg: RunConfig, tok: Tokenizer, state: _State) -> tuple[_Plan, list[ExportJob], VocabJob | None]:
    """What each export and the vocabulary do in this run, and the jobs for the pass."""
    from .export import ExportJob, VocabJob
    from .export.vocab import target_vocab_size_of

    out = cfg.out
    reconstructed = out / "reconstructed.jsonl"
    wanted = {"ok", "flagged"} if cfg.include_flagged else {"ok"}
    done = state.data.get("reconstruct", {})
    usable = sum(n for k, n in (done.get("status") or {}).items() if k in wanted)
    if done.get("rows_sha256") != _digest(reconstructed):  # replaced or edited since: its counts are not the stage's
        usable = _any_usable(reconstructed, wanted)
    exports: list[ExportJob] = []
    plan: _Plan = {}
    for fmt in cfg.export_formats:
        target = out / "export" / fmt
        fp = _fingerprint([reconstructed], {"format": fmt, "include_flagged": cfg.include_flagged, "at": str(out)})
        if state.done(f"export:{fmt}", fp, target):
            plan[f"export:{fmt}"] = (fp, "skipped")
        elif not usable:
            plan[f"export:{fmt}"] = (fp, "empty")
        else:
            plan[f"export:{fmt}"] = (fp, "ran")
            exports.append(ExportJob(fmt, target, include_flagged=cfg.include_flagged, allow_empty=True, own_folder=True))
    vocab_job = None
    if cfg.draft_vocab_size:
        target = out / "vocab"
        size, size_from, _ = target_vocab_size_of(tok, cfg.target_vocab_size)
        settings: dict[str, Any] = {"size": cfg.draft_vocab_size, "include_flagged": cfg.include_flagged, "at": str(out)}
        if size != tok.vocab_size:  # (where it is the tokenizer's, as before, a recorded run still skips)
            settings["target_vocab_size"] = size
        fp = _fingerprint([reconstructed], settings)
        if not usable:
            plan["vocab"] = (fp, "empty")
        elif state.done("vocab", fp, target):
            plan["vocab"] = (fp, "skipped")
        else:
            plan["vocab"] = (fp, "ran")
            vocab_job = VocabJob(cfg.draft_vocab_size, target, target_vocab_size=size,
                                 include_flagged=cfg.include_flagged, target_vocab_size_from=size_from)
    return plan, exports, vocab_job


def _any_usable(rows: Path, wanted: set[str]) -> int:
    """1 when a line of ``rows`` has a ``status`` in ``wanted``, else 0: read up to the first
    such line. A line that does not parse is passed over here; the pass that reads the rows
    names it."""
    import orjson

    with open(rows, "rb") as fh:
        for line in fh:
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(row, dict) and row.get("status") in wanted:
                return 1
    return 0


def _record_pass(cfg: RunConfig, state: _State, plan: _Plan, passed: PassResult | None,
                 echo: Callable[[str], None]) -> list[StageResult]:
    """One result (and line) per planned export / vocab stage; an empty one drops its stale output."""
    from .export.vocab import tokenizer_sized

    out = cfg.out
    results: list[StageResult] = []
    for stage, (fp, what) in plan.items():
        fmt = stage.partition(":")[2]
        kind: OutputKind = "export" if fmt else "vocab"
        target = _stage_folder(out, stage)
        if what == "empty":
            results.append(StageResult(stage, "empty", {"rows": 0} if fmt else {}))
            echo((f"export {fmt}: nothing to export (no {'ok/flagged' if cfg.include_flagged else 'ok'} rows)" if fmt
                  else "vocab: nothing to count (no usable rows)") + _drop_stale(state, stage, target, kind))
            continue
        detail = {}
        if what == "ran" and passed is not None:
            if fmt:
                es = next(e for e in passed.exports if e.format == fmt)
                detail = {"rows": es.rows_exported, "skipped": es.skipped}
            elif passed.vocab is not None:
                detail = {"coverage": passed.vocab.coverage, "distinct_tokens": passed.vocab.distinct_tokens}
                if passed.vocab.target_vocab_size_from == "tokenizer":
                    echo(f"warning: vocab: {tokenizer_sized(passed.vocab.target_vocab_size, cfg.tokenizer)}")
            state.record(stage, fp, {**detail, "rows_sha256": _digest(out / "reconstructed.jsonl")}, target)
        results.append(StageResult(stage, what, detail))
        turns = (state.data[stage].get("skipped") or {}).get("not_a_chat_turn") if fmt else None
        echo(f"export {fmt}: {what} → {target} {state.data[stage].get('rows')} rows"
             + (f" ({turns} more not a chat turn: skipped)" if turns else "") if fmt
             else f"vocab: {what} → {target} (coverage {state.data['vocab'].get('coverage'):.4f})")
    return results


def _report_stage(cfg: RunConfig, state: _State, fp: str, due: bool, row_stats: RowStats | None,
                  echo: Callable[[str], None]) -> StageResult:
    """5. the report (its inputs: the rows, the exchanges, and generate's counts in the store)."""
    from .report import build_report

    if not due:
        result, html = StageResult("report", "skipped"), cfg.out / "report" / "report.html"
    else:
        html = build_report(cfg.out, rows=row_stats)
        state.record("report", fp, {"html": str(html), "rows_sha256": _digest(cfg.out / "reconstructed.jsonl")},
                     html.parent)
        result = StageResult("report", "ran", {"html": str(html)})
    echo(f"report: {result.status} → {html}")
    return result


#: generate's exit statuses after which the later stages run: all done, or some failed
_GENERATE_GOES_ON = (0, 1)


def _store_counts(out: Path) -> dict[str, Any]:
    """What the report reads from generate's store, as counters (no row is read): the report
    is rebuilt when they move. Not the number of invocations: a rerun that sent nothing
    leaves the report as it was."""
    import sqlite3

    from .generate.store import Store, StoreError

    try:
        with Store.open(out) as store:
            return store.change_counts()
    except (StoreError, sqlite3.Error) as exc:  # the report says so itself; this only makes it run
        return {"unreadable": str(exc)}


def _drop_stale(state: _State, stage: str, target: Path, kind: OutputKind) -> str:
    """Remove a stage's previous output (only if tokenbridge made it), so an old export is
    never taken for this run's; returns what to add to the stage's line."""
    state.forget(stage)
    kept = remove_own_output(target, kind)
    if kept == []:
        return f"; removed the previous {target} (it was made from older data)"
    if kept:
        shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
        return (f"; removed tokenbridge's files from the previous {target} (made from older data), kept {shown} "
                "(not tokenbridge's)")
    if target.exists():
        return f"; {target} is not a tokenbridge {kind}, left alone"
    return ""
