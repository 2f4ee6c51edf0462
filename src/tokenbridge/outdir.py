"""Which folders an output may replace: outputs never destroy what tokenbridge did not create.

An export, ``vocab`` or ``report`` folder is written whole and swapped into place
(:func:`tokenbridge.fsio.publish_dir`), which replaces whatever was there. So before
writing, :func:`check_output_dir` allows the target only when it is

* missing, or an empty folder, or
* a folder carrying tokenbridge's marker (``.tokenbridge-output``) from an earlier output
  of the same kind (or, for folders written before markers existed, exactly the files
  that kind writes);

anything else is refused (:class:`OutputRefused`, exit 2) unless ``force``. Replacing
an output replaces only what tokenbridge wrote there (:func:`own_names`: the files its
marker lists); every other entry (a user's ``hidden_states/``, notes) is moved into the
new folder and kept, with or without ``force``, and one whose name the new output writes
is refused before any work. :func:`remove_own_output` likewise removes only tokenbridge's
entries. Even with ``force`` these are never written into: a run folder (``state.sqlite``, ``exchanges.jsonl`` or
``pipeline.json`` inside, at any depth up to :data:`_RUN_SCAN_DEPTH`), an input file, its
folder or any parent of it, the current folder or any parent of it, ``$HOME`` and ``/``.

A file output (``reconstruct -o`` / ``--summary-json``, ``generate --summary-json``,
``probe --json``) is refused before any work (:func:`check_output_file`) when it names a
folder, anything but a regular file (a FIFO, a device node:
:func:`tokenbridge.fsio.output_file`), or what the command did not make: an input (same
path, symlink or hard link; or anything inside an input folder), another output of the
same command (or a folder holding one), an SQLite database, one of a run folder's
:data:`RUN_STATE_FILES` (its store and SQLite's side files, lock, ``exchanges.jsonl``,
``generate.json``) or ``pipeline.json``, or an entry of a marked output folder that the
next output of its kind takes as its own (an export's, ``vocab``'s, ``report``'s: written
whole, never file by file; a user's other entries there are theirs to write). A folder
output never takes one of those names (:func:`run_file_problem`).

``tokenbridge run``'s ``[run] out`` is written file by file (exchanges.jsonl,
reconstructed.jsonl, pipeline.json, ...), so it is accepted only when missing, empty, or a
folder an earlier run made (:func:`is_own_run_folder`: generate's store, known by its
schema, :func:`store_kind`), never when it is ``/``, a system folder (``/etc``, ``/usr``,
...) or ``$HOME``, and never when an input is one of the files the run writes there
(:func:`run_folder_problem`).

A folder of exports (the run layout's ``RUN/export``: every entry an earlier export's
folder) is never replaced whole by one format: :func:`export_target` sends that format to
its own sub-folder, so ``--force`` can only replace that format's output.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any, Literal, get_args
from collections.abc import Callable, Iterable, Mapping

from .jsonl import loads_document
from .fsio import (CARRIED, MARKER, OutputRefused, real_path, foreign_entries, is_temp_name, kind_of, marker_owned, output_file,
                   parent_problem, publish_dir, read_marker, read_small_text, unlisted_folders, write_protected)

__all__ = [
    "MARKER",
    "OutputKind",
    "OutputRefused",
    "RUN_OUTPUTS",
    "RUN_STATE_FILES",
    "check_output_dir",
    "check_output_file",
    "existing_inputs",
    "export_target",
    "is_own_run_folder",
    "is_run_folder",
    "lock_problem",
    "marker",
    "open_read_only",
    "own_names",
    "remove_own_output",
    "run_file_problem",
    "run_folder_of",
    "run_folder_problem",
    "run_inputs_problem",
    "store_kind",
    "store_problem",
]

OutputKind = Literal["export", "vocab", "report"]
RUN_FILES = ("state.sqlite", "exchanges.jsonl", "pipeline.json")
_RUN_SCAN_DEPTH = 3
_LEGACY_FILES: dict[str, frozenset[str]] = {
    "vocab": frozenset({"d2t.npy", "t2d.npy", "vocab_mapping.pt", "token_freq.pt", "vocab.json"}),
    "report": frozenset({"report.html", "report.json"}),
}
#: What each export format writes at the top of its folder (the marker aside): a folder
#: marked before markers listed their ``files`` is read with the union of these.
_EXPORT_FILES: dict[str, frozenset[str]] = {
    "specforge": frozenset({"README.md", "train.jsonl"}),
    "conversations": frozenset({"README.md", "conversations.jsonl"}),
    "speculators": frozenset({"README.md", "dataset_info.json", "state.json"}),
    "parquet": frozenset({"README.md", "data"}),
}
#: speculators' Arrow shards (``data-00000-of-00002.arrow``).
_SHARD = re.compile(r"^data-\d{5,}-of-\d{5,}\.arrow$")
#: What the Parquet export writes inside its ``data/`` folder; anything else there is the
#: user's (another split, say), whatever a marker lists.
_PARQUET_SHARD = re.compile(r"^data/train-\d{5,}-of-\d{5,}\.parquet$")
#: Never a run folder, whatever they hold (a run's files once written into one may not make it ours).
_SYSTEM_FOLDERS = frozenset(Path(p) for p in (
    "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt", "/opt",
    "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var"))
_SQLITE_HEADER = b"SQLite format 3\x00"
#: generate's store is the SQLite database whose ``meta`` table holds ``schema_version``
#: beside these tables (generate/store.py, not imported: slow to import).
_STORE_TABLES = frozenset({"meta", "samples", "attempts", "responses", "runs"})
#: Every table a store of a known version may hold: :data:`_STORE_TABLES` and ``in_flight``
#: (schema 3; an older store gets it as it is opened, before its upgrade commits).
_STORE_OWN_TABLES = _STORE_TABLES | {"in_flight"}
#: The store schemas this tokenbridge knows (generate/store.py's SCHEMA_VERSION and those it
#: upgrades): theirs hold only :data:`_STORE_OWN_TABLES` (and SQLite's own ``sqlite_*``), so
#: a database holding other tables as well is the user's, whatever was once written into it.
_STORE_VERSIONS = frozenset({"1", "2", "3"})
#: What generate's lock file ``RUN/.lock`` holds (generate/lock.py, not imported: slow to import).
_LOCK_TEXT = re.compile(rb"^\d+ tokenbridge \S")


def marker(kind: OutputKind, **info: Any) -> dict[str, Any]:
    """What :func:`tokenbridge.fsio.publish_dir` writes as the folder's marker."""
    return {"tokenbridge_output": kind, **info}


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


def run_folder_of(path: str | Path) -> Path | None:
    """The run folder (:func:`is_own_run_folder`: holding generate's store) that ``path``
    lies in, if any. A folder whose ``state.sqlite`` is the user's own database is not one:
    its lock file would be written there."""
    p = real_path(path)
    for folder in (p, *p.parents):
        if os.path.lexists(folder / "state.sqlite") and is_own_run_folder(folder):
            return folder
    return None


def _protected(inputs: Iterable[Path]) -> dict[Path, str]:
    """Folders no output may ever replace, each with the reason to print."""
    keep: dict[Path, str] = {Path("/"): "the root folder"}
    home = os.environ.get("HOME")
    if home:
        keep.setdefault(real_path(home), "your home folder")
    cwd = real_path(Path.cwd())
    keep.setdefault(cwd, "the current folder")
    for parent in cwd.parents:
        keep.setdefault(parent, "a parent of the current folder")
    for item in inputs:
        item = real_path(item)
        keep.setdefault(item, f"the input {item}")
        keep.setdefault(item.parent, f"the folder of the input {item}")
        for parent in item.parent.parents:
            keep.setdefault(parent, f"a parent of the input {item}")
    return keep


def _holds_run_folder(target: Path) -> Path | None:
    """A run folder at or under ``target`` (a few levels deep), if any."""
    base_depth = len(target.parts)
    for folder, dirs, _ in os.walk(target):
        here = Path(folder)
        if is_run_folder(here):
            return here
        if len(here.parts) - base_depth >= _RUN_SCAN_DEPTH:
            dirs.clear()
    return None


def _marker_field(target: Path, key: str) -> str | None:
    """A string field of ``target``'s marker (an export's ``format``), None when it has none."""
    data = read_marker(target)
    value = data.get(key) if data is not None else None
    return value if isinstance(value, str) else None


def _is_own(target: Path, kind: OutputKind) -> bool:
    """Whether ``target`` is an earlier tokenbridge output of ``kind``."""
    try:
        data = loads_document(read_small_text(target / MARKER))
        return isinstance(data, dict) and data.get("tokenbridge_output") == kind
    except (OSError, ValueError):  # ValueError: not UTF-8, not JSON, nested too deeply (JsonLineError)
        pass
    names = {n for n in os.listdir(target) if not is_temp_name(n)}
    if kind == "export":  # pre-marker exports: the dataset card says so
        try:
            return "\n# tokenbridge export: " in read_small_text(target / "README.md", 65536)
        except (OSError, UnicodeDecodeError):
            return False
    return bool(names) and names <= _LEGACY_FILES[kind] and _signed(target, kind)


#: What a file tokenbridge wrote before markers existed holds: the keys its JSON summary
#: starts with, or the report page's title. A user's own ``vocab.json`` or ``report.html``
#: alone in a folder is not an earlier output (it would be replaced, ``--force`` or not).
_LEGACY_SIGNS: dict[str, tuple[tuple[str, tuple[str, ...] | str], ...]] = {
    "vocab": (("vocab.json", ("draft_vocab_size", "target_vocab_size")),),
    "report": (("report.json", ("run_dir", "generated_at", "rows")), ("report.html", "<title>tokenbridge report:")),
}


def _signed(target: Path, kind: OutputKind) -> bool:
    """Whether an unmarked folder holds a file whose content shows tokenbridge wrote it as ``kind``."""
    for name, sign in _LEGACY_SIGNS[kind]:
        try:
            head = read_small_text(target / name)
        except (OSError, UnicodeDecodeError):
            continue
        if isinstance(sign, str):
            if sign in head[:65536]:
                return True
            continue
        try:
            data = loads_document(head)
        except ValueError:
            continue
        if isinstance(data, dict) and all(k in data for k in sign):
            return True
    return False


def _writes(kind: OutputKind, fmt: str | None = None, *, shards_too: bool = True) -> Callable[[str], bool]:
    """Whether ``kind`` (an export of ``fmt``; any format when None) writes an entry of that
    name (at the top, or inside its own folder: ``data/train-00000-of-00001.parquet``).
    ``shards_too=False``: only the names it writes whatever the rows (a shard's name holds
    how many shards the rows make, known once they are written)."""
    if kind == "export":
        names = _EXPORT_FILES[fmt] if fmt in _EXPORT_FILES else frozenset().union(*_EXPORT_FILES.values())
        shards, parquet = shards_too and fmt in (None, "speculators"), shards_too and fmt in (None, "parquet")
        return lambda name: (name in names or name in (MARKER, CARRIED) or (shards and _SHARD.match(name) is not None)
                             or (parquet and _PARQUET_SHARD.match(name) is not None))
    names = _LEGACY_FILES[kind]
    return lambda name: name in names or name in (MARKER, CARRIED)


def own_names(kind: OutputKind) -> Callable[[Path], Callable[[str], bool]]:
    """For :func:`tokenbridge.fsio.publish_dir`: which entries of an output folder of
    ``kind`` tokenbridge wrote, and so may replace or remove. A folder marked as ``kind``:
    the names its marker lists (``files``), or for a marker from before that list, the
    names ``kind`` writes; an unmarked earlier export or vocabulary (:func:`_is_own`): the
    names ``kind`` writes; any other folder: none. Everything else is the user's and is kept."""
    def test(target: Path) -> Callable[[str], bool]:
        if not _is_own(target, kind):
            return lambda name: False
        writes, listed = _writes(kind), marker_owned(target)
        if listed is None:
            return writes
        # exactly what the marker lists is ours (a user's shard-named file in data/ is kept);
        # only inside a folder a marker from before nested lists claims whole, the names the
        # export writes decide (a user's other split there is kept too)
        whole = unlisted_folders(target) if kind == "export" else frozenset()

        def ours(name: str) -> bool:
            top, inside, _ = name.partition("/")
            return writes(name) if inside and top in whole else listed(name)
        return ours
    return test


def check_output_dir(
    target: str | Path, kind: OutputKind, *, inputs: Iterable[str | Path] = (), force: bool = False, flag: str = "-o",
    fmt: str | None = None, any_format: bool = False, advice: str | None = None,
) -> None:
    """Raise :class:`OutputRefused` unless ``target`` may be replaced by a new ``kind`` output
    (an export of format ``fmt``: one of another format only with ``force`` or ``any_format``).
    ``flag`` leads each message (the option, or for ``run`` the config key); ``advice`` is
    what to do about a folder of someone else's entries (default: another folder, or ``--force``)."""
    target = Path(target)
    resolved = real_path(target)
    why = _protected(Path(i) for i in inputs).get(resolved)
    if why:
        raise OutputRefused(f"{flag} {target}: refusing to replace {why}; give a new or empty folder")
    for item in inputs:
        if real_path(item).is_relative_to(resolved):
            raise OutputRefused(f"{flag} {target}: refusing to replace a folder that holds the input {item}")
        if os.path.isdir(item) and resolved.is_relative_to(real_path(item)):  # a tokenizer folder, say
            raise OutputRefused(f"{flag} {target}: lies in the input folder {item}; give a folder outside it")
    taken = run_file_problem(target)
    if taken:
        raise OutputRefused(f"{flag} {target}: {taken}; give a new folder outside the run's own files")
    parent = parent_problem(target)
    if parent is not None:
        raise OutputRefused(f"{flag} {target}: {parent}; give a path inside a folder")
    if not target.exists() and not target.is_symlink():
        return
    if target.is_symlink():  # the output replaces the folder whole: the link would be replaced, not followed
        raise OutputRefused(f"{flag} {target}: is a symbolic link (to {os.readlink(target)}); give the folder itself "
                            f"({resolved}) or a new one")
    if not target.is_dir():
        raise OutputRefused(f"{flag} {target}: exists and is not a folder; give a new or empty folder")
    run = _holds_run_folder(resolved)
    if run is not None:
        where = "is a run folder" if run == resolved else f"holds the run folder {run}"
        raise OutputRefused(f"{flag} {target}: {where} (state.sqlite, exchanges.jsonl); give a sub-folder such as "
                            f"{target / kind}")
    taken = _marker_taken(target)
    if taken:
        raise OutputRefused(f"{flag} {target}: {taken}; nothing was written: move it away or give another folder",
                            target / MARKER)
    if not (force or not os.listdir(target) or _is_own(target, kind)):
        raise OutputRefused(f"{flag} {target}: folder is not empty and is not an earlier tokenbridge {kind}; "
                            + (advice or "give a new or empty folder, or --force to write into it (its own entries "
                                         "are kept)"))
    held = _marker_field(target, "format") if kind == "export" and not (force or any_format) else None
    if held is not None and fmt is not None and held != fmt:  # a re-export replaces its own format, not another one by mistake
        raise OutputRefused(f"{flag} {target}: holds a {held} export and this is a {fmt} export; give another folder "
                            f"(such as {target.parent / fmt}), or --force to replace it")
    # a user's file named like a shard is kept (moved into the new output), unless the export
    # writes that very shard: then publishing refuses it, naming it, before anything is replaced
    writes = _writes(kind, fmt, shards_too=False)
    for name in foreign_entries(target, own_names(kind)(target)):
        if writes(name):
            raise OutputRefused(f"{flag} {target}: {target / name} is not tokenbridge's and the new {kind} writes "
                                "that name; nothing was written: move it away or give another folder", target / name)


def _marker_taken(target: Path) -> str | None:
    """Why the marker cannot be written in ``target``: something not a file holds its name
    (a user's folder there failed the write at the end, exit 1, naming nothing)."""
    try:
        mode = os.stat(target / MARKER).st_mode
    except OSError:  # none there (or a dangling link: replaced by the new marker)
        return None
    if stat.S_ISREG(mode):
        return None
    return f"{target / MARKER} is {kind_of(mode)}, where tokenbridge keeps the file that marks its output"


def check_output_file(target: str | Path, source: str | Path | None = None, *, flag: str = "-o",
                      name: str = "reconstructed.jsonl", outputs: Mapping[str, str | Path] | None = None,
                      inputs: Iterable[str | Path | None] = (), runs: Iterable[str | Path] = ()) -> None:
    """Refuse, before any work, an output file that is a folder, not a regular file
    (:func:`tokenbridge.fsio.output_file`), or would replace what the command did not make:
    an input (``source`` and ``inputs``; path, symlink or hard link; anything inside an input
    folder), a run folder's state (:data:`RUN_STATE_FILES` of the command's own run folders
    ``runs``, made yet or not, or of any folder holding a ``state.sqlite`` or tokenbridge's
    lock; hard links to them too), an SQLite database (no file output is one: it is a store,
    or the user's own), or another output of the same command (``outputs``: its flag -> its
    path; a folder output inside this path too)."""
    target = Path(target)
    if target.is_dir():
        raise OutputRefused(f"{flag} {target}: is a folder; give a file name such as {target / name}", target)
    parent = parent_problem(target)
    if parent is not None:
        raise OutputRefused(f"{flag} {target}: {parent}; give a path inside a folder", target)
    output_file(target, flag=flag)
    why = _file_problem(target, [i for i in (source, *inputs) if i is not None], runs, outputs or {})
    if why is not None:
        raise OutputRefused(f"{flag} {target}: {why}", target)


#: What a run folder holds that no output may replace or take the name of, and what each is:
#: generate's store and the files SQLite keeps beside it, the run's lock, the exchanges
#: generate rewrites from the store, and generate's summary.
RUN_STATE_FILES: dict[str, str] = {
    "state.sqlite": "the store (every response, attempt and cost)",
    "state.sqlite-wal": "the store's write-ahead log",
    "state.sqlite-shm": "the store's shared-memory index",
    "state.sqlite-journal": "the store's rollback journal",
    ".lock": "the lock file",
    "exchanges.jsonl": "the exchanges generate writes from its store",
    "generate.json": "generate's summary",
}
#: What ``run`` writes into its folder besides :data:`RUN_STATE_FILES`.
RUN_OUTPUTS: tuple[str, ...] = (*RUN_STATE_FILES, "reconstructed.jsonl", "pipeline.json", "export", "vocab", "report")
#: A run folder's files no file output may replace: :data:`RUN_STATE_FILES`, and ``run``'s
#: record of its stages (replaced, the next ``run`` called it damaged and redid them all).
_RUN_FILES: dict[str, str] = {**RUN_STATE_FILES, "pipeline.json": "run's record of its stages"}


def _file_problem(target: Path, inputs: list[str | Path], runs: Iterable[str | Path],
                  outputs: Mapping[str, str | Path]) -> str | None:
    """Why the file output ``target`` may not be written, or None (see :func:`check_output_file`)."""
    real = Path(os.path.realpath(target))
    for item in inputs:
        if _same_file(target, item):
            return "is the input file; give another output name"
        if os.path.isdir(item) and real.is_relative_to(real_path(item)):
            return f"lies in the input folder {item}; give another output name"
    why = _tokenbridge_file_problem(target, real, inputs, {real_path(r) for r in runs})
    if why is not None:
        return why
    if write_protected(real):
        return (f"is write-protected (mode {stat.S_IMODE(os.stat(real).st_mode):04o}); refusing to replace it: "
                "make it writable or give another output name")
    for other_flag, other in outputs.items():
        if _same_file(target, other):
            return f"is also the {other_flag} output; give another name"
        if real_path(other).is_relative_to(real):
            return f"holds the {other_flag} output {other}; give another name"
    return None


def _tokenbridge_file_problem(target: Path, real: Path, inputs: list[str | Path], ours: set[Path],
                              advice: str | None = None) -> str | None:
    """Why ``target`` (resolved: ``real``) is a file of tokenbridge's own that no file output
    may replace, or None: a run folder's file (:data:`_RUN_FILES`, by name or hard link), an
    entry of a marked output folder that is tokenbridge's (:func:`_marked_own`; the user's
    entries there are theirs), or a store or any other SQLite database. ``advice`` ends the
    reason instead of a file output's."""
    refuse = advice or "refusing to replace it: give another output name"
    if real.name in _RUN_FILES and (real.parent in ours or _looks_like_run(real.parent)):
        return f"is {_RUN_FILES[real.name]} of the run folder {real.parent}; {refuse}"
    for folder in real.parents:
        if os.path.lexists(folder / MARKER) and _marked_own(folder, real.relative_to(folder).as_posix()):
            return (f"is {real.relative_to(folder)} of {folder}, an output tokenbridge wrote there and rewrites whole "
                    f"(a file written over it corrupts that output); {advice or 'give another output name'}")
    if not os.path.lexists(target):
        return None
    folders = ours | {real.parent} | {real_path(i).parent for i in inputs}
    for folder in sorted(f for f in folders if f in ours or _looks_like_run(f)):
        for state, what in _RUN_FILES.items():
            if folder / state != target and _same_file(real, folder / state):  # (a link there is its own file)
                return f"is a hard link to {folder / state}, {what} of that run folder; {refuse}"
    if _file_kind(real)[0] == "sqlite":
        kind = "a tokenbridge run's store" if _schema_kind(real)[0] == "tokenbridge" else "an SQLite database"
        return f"is {kind} (no output of tokenbridge is one); {refuse}"
    return None


def _marked_own(folder: Path, name: str) -> bool:
    """Whether ``name`` in ``folder`` (which carries a marker) is tokenbridge's, as the next
    output of its kind will take it (:func:`own_names`: the names the marker lists, or for a
    marker from before those lists the names its kind writes); the marker itself is; a
    marker that cannot be read claims the whole folder."""
    if name in (MARKER, CARRIED):
        return True
    kind = _marker_field(folder, "tokenbridge_output")
    if kind not in get_args(OutputKind):
        return True
    return own_names(kind)(folder)(name)  # type: ignore[arg-type]  # one of OutputKind, checked above


def _looks_like_run(folder: Path) -> bool:
    """A folder whose run files no output may take: it holds a ``state.sqlite`` (generate's
    store, or a database of the user's by that name: neither may be replaced) or
    tokenbridge's lock file."""
    return os.path.lexists(folder / "state.sqlite") or bool(_LOCK_TEXT.match(_head(folder / ".lock")))


def run_file_problem(target: str | Path) -> str | None:
    """Why a folder output at ``target`` may not be made, or None: it would take the name of
    one of a run folder's :data:`RUN_STATE_FILES` (a folder named ``state.sqlite-wal``
    there would leave the store unopenable)."""
    real = Path(os.path.realpath(target))
    if real.name in _RUN_FILES and _looks_like_run(real.parent):
        return f"is the name of {_RUN_FILES[real.name]} of the run folder {real.parent}"
    return None


def _same_file(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same path once resolved, or (both
    existing) the same inode, as a hard link is."""
    if real_path(a) == real_path(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one is missing
        return False


def existing_inputs(*paths: str | Path | None) -> list[Path]:
    """The given paths that exist (an input that is not there cannot be replaced; a Hub
    repo id or ``builtin:`` name is not a path here)."""
    return [Path(p) for p in paths if p is not None and str(p).strip() and os.path.lexists(p)]


def is_own_run_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder an earlier ``run`` or ``generate`` made: it holds
    generate's store ``state.sqlite`` (recognised by its schema, :func:`store_kind`, read
    only), or no store yet (or an empty one, or one that cannot be read now: a full disk)
    and the run lock ``.lock`` as tokenbridge writes it (``<pid> tokenbridge <command>``,
    made first and kept, so a run killed before its store existed counts too). A
    ``state.sqlite`` that is anything else (the user's own database, not SQLite, not a
    file) means the folder is not ours, whatever else is there; ``exchanges.jsonl`` or
    ``pipeline.json`` prove nothing: a user's folder may hold files of those names."""
    path = Path(path)
    kind = store_kind(path / "state.sqlite")
    if kind == "tokenbridge":
        return True
    return kind in (None, "empty", "unreadable") and bool(_LOCK_TEXT.match(_head(path / ".lock")))


StoreKind = Literal["tokenbridge", "empty", "foreign", "not sqlite", "not a file", "damaged", "unreadable"]
#: Why a ``state.sqlite`` of each other kind is not a store a run may write into, and what to do.
_NOT_A_STORE: dict[str, str] = {
    "empty": "an empty database, not a tokenbridge run's store, beside files of the folder's own",
    "foreign": "an SQLite database that is not a tokenbridge store (a store holds meta.schema_version and the "
               "tables meta, samples, attempts, responses and runs, no other); refusing to write into it",
    "not sqlite": "not a usable tokenbridge state file (not an SQLite database)",
    "not a file": "not a usable tokenbridge state file (not a regular file)",
    "damaged": "an SQLite database that SQLite reads as damaged ({why})",
    "unreadable": "cannot be read now ({why})",
}
#: What to do about each kind, after "nothing was written: " (run's and generate's refusal).
_ADVICE: dict[str, str] = {
    "damaged": "if it is a run's store it holds answers already paid for: keep it (sqlite3's .recover can read "
               "what is left of it) and give this run a new or empty folder",
    "unreadable": "the file may be a run's store holding answers already paid for, so keep this folder: free disk "
                  "space, or wait for the program that holds the file, and run the same command again",
}
#: SQLite's primary result codes that say the storage failed, not the file's content: BUSY,
#: LOCKED, NOMEM, READONLY, IOERR, FULL, CANTOPEN, PROTOCOL (generate/store.py's
#: _STORAGE_ERRORS, and out of memory). A read-only open that must grow ``-shm`` on a full
#: disk fails with IOERR: the store is fine.
_STORAGE_CODES = frozenset({5, 6, 7, 8, 10, 13, 14, 15})
#: SQLITE_CORRUPT: the file is SQLite, but damaged.
_CORRUPT = 11


def store_kind(path: str | Path) -> StoreKind | None:
    """What the file at ``path`` is as generate's store, read only (nothing is created or
    changed beside it): None when there is nothing there; ``"tokenbridge"`` for an SQLite
    database with tokenbridge's schema (its ``meta`` table holding ``schema_version``, and
    the ``samples``, ``attempts``, ``responses`` and ``runs`` tables; no other table, for
    the schema versions this tokenbridge knows: a user's database into which an older
    tokenbridge once wrote its tables is still the user's); ``"empty"`` for an
    empty file or a database with no table (a store killed before its schema was
    committed); ``"foreign"`` for any other SQLite database (a user's own); ``"not
    sqlite"`` for a file that is not one; ``"damaged"`` for one SQLite reads as corrupt;
    ``"unreadable"`` for one that cannot be read now (an I/O error, a full disk on which
    SQLite cannot grow its ``-shm``, a lock held too long): what it is is unknown;
    ``"not a file"`` for a folder, a FIFO or a device (never opened)."""
    return _store_reading(Path(path))[0]


def _store_reading(path: Path) -> tuple[StoreKind | None, str]:
    """:func:`store_kind`, and for ``"damaged"`` / ``"unreadable"`` why (SQLite's or the OS's words)."""
    kind, why = _file_kind(path)
    return _schema_kind(path) if kind == "sqlite" else (kind, why)


def _file_kind(path: Path) -> tuple[StoreKind | Literal["sqlite"] | None, str]:
    """:func:`store_kind` from the file's type and first bytes: ``"sqlite"`` when the schema must tell."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return "not a file", ""  # never opened: a FIFO would block, a device may act on open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # swapped for a FIFO since: opened without waiting
    except OSError:
        return ("not a file" if os.path.lexists(path) else None), ""  # a dangling symlink is not ours either
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a file", ""
        head = os.pread(fd, len(_SQLITE_HEADER), 0)
    except OSError as exc:  # EIO: the disk, not the file
        return "unreadable", exc.strerror or str(exc)
    finally:
        os.close(fd)
    return ("empty" if not head else "sqlite" if head == _SQLITE_HEADER else "not sqlite"), ""


def _schema_kind(path: Path) -> tuple[StoreKind, str]:
    """:func:`store_kind` of an SQLite file, from its tables (read only); a failed read is
    told apart by SQLite's result code: the storage (``"unreadable"``), a damaged file, or
    not a database at all."""
    import sqlite3

    try:
        conn = open_read_only(path)
    except sqlite3.Error as exc:
        return _failed_read(exc)
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return "empty", ""
        if not tables >= _STORE_TABLES:
            return "foreign", ""
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            return "foreign", ""
        others = {t for t in tables - _STORE_OWN_TABLES if not t.startswith("sqlite_")}
        return ("foreign" if others and str(row[0]) in _STORE_VERSIONS else "tokenbridge"), ""
    except sqlite3.Error as exc:
        return _failed_read(exc)
    finally:
        conn.close()


def _failed_read(exc: Exception) -> tuple[StoreKind, str]:
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    if primary in _STORAGE_CODES:
        return "unreadable", str(exc)
    return ("damaged", str(exc)) if primary == _CORRUPT else ("not sqlite", "")


def _not_a_store(path: Path, kind: str, why: str) -> str:
    return f"{path}: {_NOT_A_STORE[kind].format(why=why)}"


def store_problem(path: str | Path) -> str | None:
    """Why generate may not open ``path`` as its store, or None: it is missing, empty, or a
    tokenbridge store (:func:`store_kind`); or it cannot be read now (``"unreadable"``), which
    :func:`run_folder_problem` has already let through only in a run folder: opening it to
    write then fails with the storage error generate reports as one (exit 6, "nothing was
    lost"), never as a file to give up. The reason names the path."""
    kind, why = _store_reading(Path(path))
    return None if kind in (None, "empty", "tokenbridge", "unreadable") else _not_a_store(Path(path), kind, why)


def open_read_only(path: Path) -> Any:
    """An SQLite connection that reads ``path`` and leaves nothing behind.

    ``mode=ro`` on a WAL database still creates ``-wal`` / ``-shm`` beside it and, being
    read-only, never removes them. Without a ``-wal`` file the database was closed cleanly
    and holds everything, so it is opened ``immutable`` (nothing is created). With one (a
    killed generate, or one still running), ``mode=ro`` reads what it holds and finds both
    files already there. The store check here and the report (under the run folder's lock,
    so no writer is active) both read the store this way."""
    import sqlite3

    wal = path.with_name(path.name + "-wal")
    query = "mode=ro" if os.path.lexists(wal) else "mode=ro&immutable=1"
    return sqlite3.connect(f"{real_path(path).as_uri()}?{query}", uri=True, timeout=5)


def _head(path: Path) -> bytes:
    """The first bytes of ``path`` when it is a regular file (never opens a FIFO), else b""."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return b""
        with open(path, "rb") as fh:
            return fh.read(64)
    except OSError:
        return b""


def run_folder_problem(out: str | Path, *, inputs: Iterable[str | Path] = (),
                       writes: Iterable[str] = RUN_STATE_FILES) -> str | None:
    """Why ``out`` may not be a run's folder, or None: a run writes its files into it
    (replacing any of the same names), so it must be missing, empty or an earlier run's
    folder (:func:`is_own_run_folder`), and never ``/``, a system folder or ``$HOME``; and
    none of the command's ``inputs`` may be the folder or one of the files (or folders)
    the run ``writes`` there (path, symlink or hard link), nor lie inside one of them
    (:func:`run_inputs_problem`)."""
    out = Path(out)
    why = run_inputs_problem(out, inputs, writes)
    if why is not None:
        return why
    resolved = real_path(out)
    home = os.environ.get("HOME")
    what = ("the root folder" if resolved == Path("/") else "a system folder" if resolved in _SYSTEM_FOLDERS
            else "your home folder" if home and resolved == real_path(home) else None)
    if what:
        return f"{out}: refusing to write a run into {what}; give a new or empty folder"
    if not resolved.exists():
        parent = parent_problem(out)
        return None if parent is None else f"{out}: {parent}; give a new or empty folder"
    if not resolved.is_dir():
        return f"{out}: exists and is not a folder; give a new or empty folder"
    why = lock_problem(out) or _linked_output_problem(out, resolved, writes)
    if why is not None:
        return why
    if not os.listdir(resolved) or is_own_run_folder(resolved):
        return None
    kind, why = _store_reading(resolved / "state.sqlite")
    if kind is not None:
        advice = _ADVICE.get(kind, "give a new or empty folder")
        return f"{_not_a_store(out / 'state.sqlite', kind, why)}; nothing was written: {advice}"
    return (f"{out}: folder is not empty and is not a tokenbridge run folder (no state.sqlite or .lock of an "
            "earlier run); nothing was written: give a new or empty folder")


#: The files a run replaces whole by name (written beside, renamed onto the name, or through
#: a symlink there onto the file it names); the store and the lock are opened in place.
_REPLACED = ("exchanges.jsonl", "generate.json", "reconstructed.jsonl", "pipeline.json")


def _linked_output_problem(out: Path, resolved: Path, writes: Iterable[str]) -> str | None:
    """Why a file the run replaces by name in ``out`` may not be written: it is a symlink (the
    write goes to the file it names, as a user's own file elsewhere may) to a file of
    tokenbridge's own, such as a store of paid answers (:func:`_tokenbridge_file_problem`);
    None where no such link is there. (A store linked there is the run's own store, kept
    elsewhere: written into, never over.)"""
    home = Path(os.path.realpath(resolved / "state.sqlite")).parent  # where the run's own store is
    for name in (n for n in writes if n in _REPLACED):
        path = resolved / name
        if not os.path.islink(path):
            continue
        real = Path(os.path.realpath(path))
        if real.parent == home and real.name == name:  # the run's own file, kept beside its store
            continue
        why = _tokenbridge_file_problem(path, real, [], {resolved}, advice="the run would write over it: nothing was "
                                        "written: move the link away and run again")
        if why is not None:
            return f"{out / name}: is a symlink to {real}, which {why}"
    return None


def lock_problem(folder: str | Path) -> str | None:
    """Why ``folder/.lock`` cannot be taken as the run folder's lock file, or None (missing,
    or a regular file): the lock opens it read-write, cuts it and writes its pid there, so
    a FIFO failed with a traceback (or would block), and a symlink would have that done to
    the file it names, outside the folder. Nothing is opened here."""
    path = Path(folder) / ".lock"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path}: cannot be looked at ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    what = f"a symbolic link (to {os.readlink(path)})" if stat.S_ISLNK(mode) else kind_of(mode)
    return f"{path}: is {what}, not tokenbridge's lock file; nothing was written: move it away and run again"


def run_inputs_problem(out: str | Path, inputs: Iterable[str | Path],
                       writes: Iterable[str] = RUN_STATE_FILES) -> str | None:
    """Why a run in ``out`` would replace one of the command's ``inputs``, or None: an input
    may be neither the folder nor one of the files (or folders) the run ``writes`` there
    (path, symlink or hard link), nor lie inside one of them."""
    out = Path(out)
    resolved = real_path(out)
    for item in inputs:
        real = real_path(item)
        if real == resolved:
            return (f"{out}: is the input {item}; a run writes its files into that folder: give a new or empty "
                    "folder")
        for name in writes:
            if _same_file(item, resolved / name) or real.is_relative_to(resolved / name):
                return (f"{out}: the input {item} is the run folder's {name}, which the run rewrites; nothing was "
                        "written: move the input out of the run folder, or give another folder")
    return None


def export_target(target: str | Path, fmt: str) -> Path:
    """Where an export of ``fmt`` asked for at ``target`` is written: ``target/fmt`` when
    ``target`` is a folder of exports (not one itself, and every entry an earlier
    tokenbridge export's folder, as ``RUN/export`` holds ``specforge/``, ``parquet/``, ...),
    so exporting one format never replaces the others; else ``target`` itself."""
    target = Path(target)
    if not target.is_dir() or target.is_symlink() or (target / MARKER).exists():
        return target
    entries = [e for e in os.scandir(target) if not is_temp_name(e.name)]
    if entries and all(e.is_dir(follow_symlinks=False) and _is_own(Path(e.path), "export") for e in entries):
        return target / fmt
    return target


def remove_own_output(target: str | Path, kind: OutputKind) -> list[str] | None:
    """Remove what tokenbridge wrote in ``target``, an earlier ``kind`` output: the whole
    folder when it holds nothing else (returns ``[]``), else only tokenbridge's entries,
    in one swap that keeps the folder (marked, now listing no file of its own) and every
    other entry, whose names are returned. Anything else (missing, not ours, a run folder)
    is left alone: None."""
    target = Path(target)
    if not target.is_dir() or target.is_symlink() or not _is_own(target, kind):
        return None
    if _holds_run_folder(real_path(target)) is not None:
        return None
    owned = own_names(kind)
    kept = foreign_entries(target, owned(target))
    if kept:
        with publish_dir(target, point=kind, marker=marker(kind), owned=owned):
            pass
        return kept
    shutil.rmtree(target)
    return []
