"""``tokenbridge run CONFIG``'s config file: every section checked before anything is sent.

Sections: ``[run]`` (tokenizer, out, dialect), ``[emulator]`` (omit it to talk to
``base_url`` for real; ``config`` names an emulator config file, any other key overrides
it), ``[generate]`` (the generate config, :mod:`.generate.settings`), ``[reconstruct]``,
``[export]``, ``[vocab]``, ``[report]``. Each is a schema (frozen dataclasses with pydantic
types, see :mod:`.schema`); :func:`load_run_config` reports the problems of *all*
sections at once, one line each (``run.toml:31: export.formats[0]: unknown value
'specforg'; did you mean 'specforge'?``), and :func:`check_before_generate` the ones that
need the tokenizer loaded. Both come before the first request, so a typo never costs a
paid generation.
"""

from __future__ import annotations

import os

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from collections.abc import Callable, Mapping

from pydantic import AfterValidator, Field, field_validator, with_config

from .display import problems_of, several
from .fsio import real_path
from .checks import CODES, Policy
from .exit_codes import ExitCode
from .export.formats import FORMATS
from .outdir import RUN_OUTPUTS, OutputKind, existing_inputs, run_folder_problem
from .schema import (FORBID, Bool, DialectName, NonNegInt, Str, VocabSize, Where, did_you_mean, read_config_text,
                     read_mapping, validate)
from .tokenizer import Tokenizer
from .tokenizer_source import TOKENIZER_ENV
from .traits import ProfileError, load_provider_profile

if TYPE_CHECKING:
    from .emulator.config import EmulatorConfig

__all__ = ["PipelineError", "RunConfig", "check_before_generate", "check_out", "emulator_config", "load_run_config"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class PipelineError(Exception):
    """A config or stage error; the message names the file and key or stage (one line per
    problem). ``code`` is the exit code the CLI should end with."""

    def __init__(self, message: str, code: int = ExitCode.INCOMPLETE):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RunConfig:
    source: Path
    out: Path
    tokenizer: str
    dialect: str | None
    generate: Mapping[str, Any]  # [generate], its paths (datasets, tokenizer) joined to the config's folder
    use_emulator: bool
    emulator: Path | None
    emulator_overrides: Mapping[str, Any]
    policy: Policy
    #: provider -> text edits, from [reconstruct] provider_profile (None: no profile)
    provider_profile: Mapping[str, tuple[str, ...]] | None
    export_formats: tuple[str, ...]
    include_flagged: bool
    draft_vocab_size: int | None
    target_vocab_size: int | None
    report: bool
    #: what goes around a tokenizer folder's load error: where the config names it
    #: (``file:LINE: run.tokenizer: ``), and `` (TOKENBRIDGE_TOKENIZER)`` where that gave it
    tokenizer_at: tuple[str, str] = field(default=("", ""), compare=False)


# --- the schema of the sections that are not another config's ------------------------------

#: The names are the exporter's FORMATS, read at import; a static checker sees a ``str``.
if TYPE_CHECKING:
    ExportFormat = str
else:
    ExportFormat = Literal[FORMATS]


def _finding_code(code: str) -> str:
    if code not in CODES:
        raise ValueError(f"unknown finding code {code!r}" + did_you_mean(code, list(CODES)))
    return code


FindingCode = Annotated[Str, AfterValidator(_finding_code)]
Severity = Literal["error", "warning", "off"]


@with_config(FORBID)
@dataclass(frozen=True)
class RunSection:
    # a tokenizer folder or a Hub repo id (owner/name); without it, $TOKENBRIDGE_TOKENIZER
    tokenizer: Annotated[Str, Field(min_length=1)] | None = None
    out: Annotated[Str, Field(min_length=1)] | None = None  # default: runs/<config stem>
    dialect: DialectName | None = None


@with_config(FORBID)
@dataclass(frozen=True)
class ReconstructSection:
    usage_tolerance: NonNegInt = 0
    severity: Mapping[FindingCode, Severity] = field(default_factory=dict)
    #: `tokenbridge probe --json` output: providers whose text edits are invisible per sample
    provider_profile: Str | None = None


@with_config(FORBID)
@dataclass(frozen=True)
class ExportSection:
    formats: tuple[ExportFormat, ...] = tuple(FORMATS)
    include_flagged: Bool = False

    @field_validator("formats")
    @classmethod
    def _each_once(cls, formats: tuple[str, ...]) -> tuple[str, ...]:
        """A format named twice would be exported twice into one folder, the second run over the first."""
        twice = sorted({f for f in formats if formats.count(f) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} named more than once")
        return formats


@with_config(FORBID)
@dataclass(frozen=True)
class VocabSection:
    draft_vocab_size: VocabSize | None = None
    #: the model's output size (``lm_head`` rows), the length of ``t2d``: default, the tokenizer
    #: folder's ``config.json`` ``vocab_size``, else the tokenizer's ids (with a warning)
    target_vocab_size: VocabSize | None = None


@with_config(FORBID)
@dataclass(frozen=True)
class ReportSection:
    enabled: Bool = True


@with_config(FORBID)
@dataclass(frozen=True)
class RunFile:
    """The whole file; ``emulator`` and ``generate`` are checked by their own schemas."""

    run: RunSection
    emulator: Mapping[Str, Any] | None = None
    generate: Mapping[Str, Any] = field(default_factory=dict)
    reconstruct: ReconstructSection = field(default_factory=ReconstructSection)
    export: ExportSection = field(default_factory=ExportSection)
    vocab: VocabSection = field(default_factory=VocabSection)
    report: ReportSection = field(default_factory=ReportSection)


# --- loading ---------------------------------------------------------------------------------


def _config_error(message: str) -> PipelineError:
    return PipelineError(message, ExitCode.CONFIG)


def load_run_config(path: str | Path) -> RunConfig:
    """Read and check a run config; :class:`PipelineError` (code 2) lists every problem."""
    path = Path(path)
    if path.suffix.lower() in (".yaml", ".yml"):
        raise _config_error(f"{path}: a run config is TOML (.toml)")
    data, text = read_mapping(path, _config_error)
    where = Where(str(path), text)
    base = path.parent
    parsed, problems = validate(RunFile, data, where)

    raw_run = data.get("run")
    run: Mapping[str, Any] = raw_run if isinstance(raw_run, Mapping) else {}
    raw_tokenizer = run.get("tokenizer")
    tokenizer = raw_tokenizer if isinstance(raw_tokenizer, str) else ""
    if tokenizer:
        tokenizer, problem = _tokenizer_source(tokenizer, base)
        if problem:
            problems.append(where.problem(("run", "tokenizer"), problem))
    elif raw_tokenizer is None:  # not in the file: the environment's, relative to the working directory
        env = os.environ.get(TOKENIZER_ENV, "").strip()
        tokenizer, problem = _tokenizer_source(env, Path.cwd()) if env else (
            "", f"missing: name a tokenizer folder or Hub repo id here, or set {TOKENIZER_ENV}")
        if problem:
            problems.append(where.problem(("run", "tokenizer"), f"{problem} ({TOKENIZER_ENV})" if env else problem))
    gen, datasets = _check_generate(data, where, base, tokenizer, problems)
    emulator, overrides = _check_emulator(data, where, base, problems)
    profile = None
    if parsed is not None and parsed.reconstruct.provider_profile:
        profile_path = _relative(parsed.reconstruct.provider_profile, base)
        if profile_path.exists() and not profile_path.is_file():  # a FIFO blocked the check until written to
            problems.append(where.problem(("reconstruct", "provider_profile"), f"{profile_path}: not a regular file"))
        else:
            try:
                profile = load_provider_profile(profile_path)
            except ProfileError as exc:
                problems.append(where.problem(("reconstruct", "provider_profile"), str(exc)))

    if problems or parsed is None:
        ordered = sorted(problems, key=lambda line: _file_order(line, str(path)))
        raise several(_config_error, ordered)
    return RunConfig(
        source=path, out=_relative(parsed.run.out or "runs/" + path.stem, base), tokenizer=tokenizer,
        dialect=parsed.run.dialect, generate={**gen, "datasets": datasets},
        use_emulator=data.get("emulator") is not None, emulator=emulator, emulator_overrides=overrides,
        policy=Policy(severities=dict(parsed.reconstruct.severity), usage_tolerance=parsed.reconstruct.usage_tolerance),
        provider_profile=profile, export_formats=parsed.export.formats, include_flagged=parsed.export.include_flagged,
        draft_vocab_size=parsed.vocab.draft_vocab_size, target_vocab_size=parsed.vocab.target_vocab_size,
        report=parsed.report.enabled,
        tokenizer_at=(where.problem(("run", "tokenizer"), ""), f" ({TOKENIZER_ENV})" if raw_tokenizer is None else ""),
    )


def _relative(value: str, base: Path) -> Path:
    """A path from the config file: relative to the file's folder."""
    given = Path(value).expanduser()
    return given if given.is_absolute() else real_path(base / given)


def _check_generate(
    data: Mapping[str, Any], where: Where, base: Path, tokenizer: str, problems: list[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """[generate] by the generate schema (the run's tokenizer by default), plus what only
    ``run`` needs: a model, at least one dataset, and dataset paths that exist.

    The paths returned (datasets, tokenizer) are joined to the config's folder here, once:
    ``run`` reads them as they are, since joining again found ``sub/sub/data.jsonl`` for
    ``sub/run.toml`` (or silently another file that happened to sit there)."""
    from .generate.settings import settings_problems

    section = data.get("generate", {})
    gen = dict(section) if isinstance(section, Mapping) else {}
    if tokenizer:
        gen.setdefault("tokenizer", tokenizer)
    settings, found = settings_problems(gen, where.at("generate"), base_dir=base)
    problems += found
    if not found and isinstance(section, Mapping):
        if not settings.request.model:
            problems.append(where.problem(("generate", "model"), "missing (the model id to send, e.g. moonshotai/kimi-k2.5)"))
        if not settings.datasets:
            problems.append(where.problem(("generate", "datasets"), "missing (at least one prompt dataset)"))
        for i, spec in enumerate(settings.datasets):
            try:
                spec.path.stat()
            except (FileNotFoundError, NotADirectoryError):
                problems.append(where.problem(("generate", "datasets", i, "path"), f"no such file or folder: {spec.path}"))
            except OSError as exc:  # a folder on the way without search permission (exists() raised it)
                problems.append(where.problem(("generate", "datasets", i, "path"),
                                              f"cannot be read: {spec.path} ({exc.strerror or exc})"))
    if settings.tokenizer is not None:
        gen["tokenizer"] = settings.tokenizer
    datasets = [
        {"name": d.name, "path": str(d.path), **({"limit": d.limit} if d.limit is not None else {}),
         **({"split": d.split} if d.split else {})}
        for d in settings.datasets
    ]
    return gen, datasets


def _check_emulator(
    data: Mapping[str, Any], where: Where, base: Path, problems: list[str]
) -> tuple[Path | None, dict[str, Any]]:
    """[emulator]: its ``config`` file (whose problems name that file), then the section's
    overrides of it. Returns the file and the overrides."""
    from .emulator import ConfigError as EmulatorConfigError
    from .emulator import EmulatorConfig, load_emulator_config
    from .emulator.config import emulator_config_problems

    section = data.get("emulator")
    overrides = dict(section) if isinstance(section, Mapping) else {}
    file = overrides.pop("config", None)
    emulator: Path | None = None
    if file is not None and not isinstance(file, str):
        problems.append(where.problem(("emulator", "config"), f"must be a path (a string), got {file!r}"))
    elif file and "\x00" in file:
        problems.append(where.problem(("emulator", "config"), "must not contain a NUL character"))
    elif file:
        emulator = _relative(file, base)
    base_cfg: EmulatorConfig | None = EmulatorConfig()
    unreadable = _unreadable(emulator) if emulator is not None else None
    if unreadable:  # a parent without search permission: exists() itself raises
        problems.append(where.problem(("emulator", "config"), f"{emulator}: cannot read ({unreadable})"))
        base_cfg = None
    elif emulator is not None and not emulator.exists():  # named in this file: its line and key say where
        problems.append(where.problem(("emulator", "config"), f"{emulator}: no such config file"))
        base_cfg = None
    elif emulator is not None:
        try:
            base_cfg = load_emulator_config(emulator)
        except EmulatorConfigError as exc:  # a problem inside that file: its own lines name it
            problems.extend(problems_of(exc))
            base_cfg = None
    if base_cfg is not None:
        problems += emulator_config_problems(overrides, where.at("emulator"), base_cfg)[1]
    return emulator, overrides


def _file_order(problem: str, source: str) -> tuple[bool, int]:
    """This file's problems first, by line; then those of files it names (the emulator's)."""
    if not problem.startswith(source + ":"):
        return True, 0
    line = problem[len(source) + 1:].split(":", 1)[0]
    return False, int(line) if line.isdigit() else 1 << 30


def _unreadable(path: Path) -> str | None:
    """Why ``path`` cannot even be looked at (a folder above it without search permission),
    or None (missing or there: the caller's own checks say which)."""
    try:
        os.stat(path)
    except PermissionError as exc:
        return exc.strerror or str(exc)
    except OSError:
        return None
    return None


def _tokenizer_source(value: str, base: Path) -> tuple[str, str | None]:
    """A tokenizer folder (relative to the config file) or a Hub repo id, and what is wrong."""
    if value.startswith((".", "/", "~")) or os.path.lexists(base / value):
        folder = str(_relative(value, base))
        try:
            if not Path(folder).is_dir():
                return folder, f"no such tokenizer folder: {folder}"
        except PermissionError as exc:  # a parent without search permission
            return folder, f"cannot read the tokenizer folder {folder} ({exc.strerror})"
        return folder, None
    if not _HUB_ID.match(value):
        return value, f"{value!r} is neither a tokenizer folder nor a Hub repo id (owner/name)"
    return value, None


def emulator_config(cfg: RunConfig) -> EmulatorConfig:
    """The emulator config ``run`` starts: the ``config`` file with the section's overrides."""
    from .emulator import ConfigError as EmulatorConfigError
    from .emulator import EmulatorConfig, load_emulator_config
    from .emulator.config import emulator_config_problems

    try:
        base = load_emulator_config(cfg.emulator) if cfg.emulator else EmulatorConfig()
    except EmulatorConfigError as exc:
        raise several(_config_error, problems_of(exc)) from None
    out, problems = emulator_config_problems(cfg.emulator_overrides, Where(str(cfg.source)).at("emulator"), base)
    if out is None:
        raise several(_config_error, problems)
    return out


def check_before_generate(cfg: RunConfig, tok: Tokenizer) -> None:
    """The checks that need the tokenizer: the dialect fits it, a given target vocabulary
    holds every id of the tokenizer (reconstruct writes any of them: a smaller one refused
    every row, after the paid generation), and the draft vocabulary is no larger than the
    target. Raises :class:`PipelineError` (code 2)."""
    from .chat import DialectError, TemplateError, resolve_dialect

    try:
        text = read_config_text(cfg.source)
    except (OSError, UnicodeDecodeError):
        text = None
    where = Where(str(cfg.source), text)
    problems: list[str] = []
    try:
        resolve_dialect(tok, cfg.dialect)
    except (DialectError, TemplateError) as exc:
        problems.append(where.problem(("run", "dialect") if cfg.dialect else ("run", "tokenizer"), str(exc)))
    if cfg.target_vocab_size is not None and cfg.target_vocab_size < tok.vocab_size:
        problems.append(where.problem(("vocab", "target_vocab_size"), f"must be >= the tokenizer's {tok.vocab_size} "
                                      f"ids (0 to {tok.vocab_size - 1}; every row's ids must fit the target "
                                      f"vocabulary), got {cfg.target_vocab_size}"))
    target = cfg.target_vocab_size or tok.output_vocab_size
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > target:
        problems.append(where.problem(("vocab", "draft_vocab_size"), f"must be <= the target vocabulary size "
                                      f"{target}, got {cfg.draft_vocab_size}"))
    if problems:
        raise several(_config_error, problems)


def check_stage_folders(cfg: RunConfig, recorded: Callable[[str, Path], bool] = lambda stage, folder: False) -> None:
    """The folders ``run`` writes its stages' outputs into (``export/<format>``, ``vocab``,
    ``report``) must be missing, empty or tokenbridge's earlier output of that stage
    (:func:`~tokenbridge.outdir.check_output_dir`), checked before anything is sent. A
    refusal names the config key that asks for the output, not a flag ``run`` has not got
    (it quoted ``-o`` and ``--force``). ``recorded(stage, folder)``: the folder is, by its
    entries' identities, the one the stage recorded writing (nothing to read: a rerun of a
    finished run opens no output). Raises :class:`PipelineError` (code 2)."""
    from .outdir import OutputRefused, check_output_dir

    try:
        text = read_config_text(cfg.source)
    except (OSError, UnicodeDecodeError):
        text = None
    where = Where(str(cfg.source), text)
    inputs = [cfg.out / "reconstructed.jsonl"]
    wanted: list[tuple[str, Path, OutputKind, str | None, tuple[str, str]]] = [
        (f"export:{fmt}", cfg.out / "export" / fmt, "export", fmt, ("export", "formats")) for fmt in cfg.export_formats]
    if cfg.draft_vocab_size:
        wanted.append(("vocab", cfg.out / "vocab", "vocab", None, ("vocab", "draft_vocab_size")))
    if cfg.report:
        wanted.append(("report", cfg.out / "report", "report", None, ("report", "enabled")))
    problems = []
    exports = cfg.out / "export"
    if cfg.export_formats and exports.is_symlink():  # as a link at export/<format> or vocab is refused
        problems.append(where.problem(("export", "formats"), (
            f"{exports}: is a symbolic link (to {os.readlink(exports)}); run writes its exports in the run folder "
            "itself, not through a link to another: nothing was written: move it away or give [run] out another folder")))
    for stage, target, kind, fmt, key in wanted:
        if recorded(stage, target):
            continue
        flag = where.problem(key, "").rstrip()
        what = f"its {fmt} export" if fmt else f"its {kind}"
        try:
            check_output_dir(target, kind, inputs=inputs, flag=flag, fmt=fmt, any_format=True,
                             advice=f"nothing was written: move it away (run writes {what} there) or give [run] out "
                                    "another folder")
        except OutputRefused as exc:
            problems.append(str(exc))
    if problems:
        raise several(_config_error, problems)


def check_out(cfg: RunConfig) -> None:
    """``[run] out`` must be missing, empty or an earlier run's folder (never ``/``, a
    system folder or ``$HOME``): a run writes its files into it, so a user's folder would
    lose files of the same names. Checked when the run starts (the folder may have changed
    since the config was loaded). Raises :class:`PipelineError` (code 2)."""
    datasets = (d["path"] for d in cfg.generate.get("datasets", ()))
    inputs = existing_inputs(cfg.source, cfg.tokenizer, cfg.emulator, *datasets)  # none may be what the run writes
    why = run_folder_problem(cfg.out, inputs=inputs, writes=RUN_OUTPUTS)
    for item in inputs:  # a tokenizer or dataset folder: the run would write vocab/, export/... into it
        if why is None and os.path.isdir(item) and real_path(cfg.out).is_relative_to(real_path(item)):
            why = f"{cfg.out}: lies in the input folder {item}; give a folder outside it"
    if why is None:
        return
    try:
        text = read_config_text(cfg.source)
    except (OSError, UnicodeDecodeError):
        text = None
    raise _config_error(Where(str(cfg.source), text).problem(("run", "out"), why))
