"""The ``tokenbridge`` command line: thin wrappers over the library."""

from __future__ import annotations

import functools
import json
import os
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn
from collections.abc import Callable, Iterator, Mapping, Sequence

import typer

from .display import printable, problems_of
from .exit_codes import ExitCode
from .tokenizer import MAX_VOCAB_SIZE

#: The most ``reconstruct --workers``: more processes than any machine's cores is a typo (a
#: number past a Python index was an OverflowError, exit 8).
MAX_WORKERS = 1024
#: The most rows a Parquet shard or row group may be asked to hold (row counts are int64 in
#: Parquet; pyarrow overflowed past that, exit 8): more than any export holds.
MAX_ROWS = 2**31 - 1

if TYPE_CHECKING:
    from .checks import Policy
    from .generate import GenerateSettings
    from .generate.run import RunSummary
    from .tokenizer import Tokenizer

app = typer.Typer(
    add_completion=False,
    # click's plain help and usage errors: typer's rich help imports rich.markdown and
    # markdown_it, about 0.15 s of every start-up (`tokenbridge --help` must take <= 0.2 s)
    rich_markup_mode=None,
    # a bug's traceback is printed by main(), plainly: rich's pretty one shows every frame's
    # locals, and a local can be the API key
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
    help="Exact-token training data for speculative-decoding drafts from text-only APIs.",
)


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        _say(f"tokenbridge {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Exact-token training data for speculative-decoding drafts from text-only APIs."""


# --- reconstruct / inspect -------------------------------------------------------------


def _policy(usage_tolerance: int, warn: list[str], error: list[str], off: list[str]) -> Policy:
    """The severity flags, checked by the run config's ``[reconstruct]`` schema."""
    from .checks import Policy
    from .runconfig import ReconstructSection
    from .schema import Where, validate

    severities = {**{c: "warning" for c in warn}, **{c: "error" for c in error}, **{c: "off" for c in off}}
    flags = {"usage_tolerance": "--usage-tolerance", "severity": "--warn/--error/--off"}
    section, problems = validate(ReconstructSection, {"usage_tolerance": usage_tolerance, "severity": severities},
                                 Where("command line", flags=flags))
    if problems:
        _fail(problems)
    return Policy(severities=dict(section.severity), usage_tolerance=section.usage_tolerance)


def _dialect_flag(dialect: str | None) -> None:
    """``--dialect`` must name a known chat format (with "did you mean")."""
    from .schema import DialectName, Where, validate

    if dialect is not None:
        # DialectName is a Literal built from the registry at import: a type to pydantic, a variable to mypy
        problems = validate(dict[str, DialectName], {"dialect": dialect}, Where("command line", flags={"dialect": "--dialect"}))[1]
        if problems:
            _fail(problems)


def _say(text: str, *, err: bool = False) -> None:
    """One line for the user. It may quote data, an API's words or a path, so every control
    or invisible character in it is shown escaped (:func:`~tokenbridge.display.printable`):
    nothing from outside recolours, retitles or rewrites the terminal, or forges a line."""
    typer.echo(printable(text), err=err)


def _fail(problem: str | BaseException | Sequence[str], code: int = ExitCode.CONFIG) -> NoReturn:
    """One ``error:`` line per problem, then exit with ``code``: a text is one problem, a
    list one each, an exception its ``problems`` (:func:`~tokenbridge.display.several`: a
    config's several) or its text. A line break inside a problem is data (a file name can
    hold one), shown escaped: it never forges a line."""
    if isinstance(problem, BaseException):
        problems: Sequence[str] = problems_of(problem)
    else:
        problems = [problem] if isinstance(problem, str) else problem
    for line in problems:
        _say(f"error: {line.rstrip(chr(10))}", err=True)
    raise typer.Exit(int(code))


def _tokenizer(flag_value: str | None, config_value: str | None = None, config: str | None = None) -> Tokenizer:
    """The command's tokenizer: its flag, else its config's, else ``$TOKENBRIDGE_TOKENIZER``
    (never a path guessed from the working directory); a problem is one error line, exit 2."""
    from .tokenizer import TokenizerError, load_tokenizer
    from .tokenizer_source import choose_tokenizer

    try:
        return load_tokenizer(choose_tokenizer(flag_value, config_value, config=config))
    except TokenizerError as exc:
        _fail(exc)


def _check_dialect(tok: Tokenizer, name: str | None) -> None:
    """The dialect ``name`` (None: the tokenizer's own) resolved once before any work: one
    that does not fit the tokenizer, or a folder whose chat template does not compile, is
    one error line, exit 2."""
    from .chat import DialectError, resolve_dialect

    try:
        resolve_dialect(tok, name)
    except DialectError as exc:
        _fail(exc)


def _tokenizer_input(value: str | None) -> str | None:
    """The tokenizer a command will read (:func:`~tokenbridge.tokenizer_source.choose_tokenizer`'s
    choice, None when there is none): an input no output may replace when it is a local folder."""
    from .tokenizer_source import NoTokenizerError, choose_tokenizer

    try:
        return str(choose_tokenizer(value))
    except NoTokenizerError:
        return None


_TOKENIZER_HELP = "Tokenizer folder or Hub repo id (default: $TOKENBRIDGE_TOKENIZER)."

_SHOWN_BAD_LINES = 20  # reconstruct prints this many bad lines, then a count


def _resource_failures() -> tuple[type[BaseException], ...]:
    """What stopped the work that is neither a bug nor bad data: the machine ran out (memory,
    a worker killed), or the input was replaced or cut short under it. One line, exit 1.
    Looked up only when an error passes (the pool's module is slow to import)."""
    from .lanes import InputChanged, WorkerDied

    return (MemoryError, WorkerDied, InputChanged)


@contextmanager
def _writing(output: Path | None, command: str) -> Iterator[None]:
    """Around a stage that writes outputs: Ctrl-C/SIGTERM stop it with one line (exit
    130), a refused or failed output is one ``error:`` line, and an output inside a run
    folder is written under that folder's lock."""
    from .fsio import OutputWriteError
    from .interrupt import EXIT_INTERRUPTED, STOPPED, stop_on_signals
    from .outdir import OutputRefused, lock_problem, run_folder_of

    try:
        with stop_on_signals(), ExitStack() as stack:
            folder = run_folder_of(output) if output is not None else None
            why = lock_problem(folder) if folder is not None else None
            if why is not None:
                _fail(why)
            if folder is not None:  # imported only here: generate's package is slow to import
                from .generate.errors import GenerateError
                from .generate.lock import run_lock

                try:
                    stack.enter_context(run_lock(folder, command=command, retry="or write outside that run folder"))
                except GenerateError as exc:  # the run folder is busy
                    _fail(exc, exc.exit_code)
            yield
    except KeyboardInterrupt:
        _say(STOPPED, err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except OutputRefused as exc:
        _fail(exc, exc.exit_code)
    except OutputWriteError as exc:
        _fail(exc, ExitCode.INCOMPLETE)
    except typer.Exit:
        raise
    except _resource_failures() as exc:
        _fail(_resource_failure(exc, command), ExitCode.INCOMPLETE)


def _resource_failure(exc: BaseException, command: str) -> str:
    """What ran out (memory, or a worker killed) or changed under the command, in one line: not a bug."""
    if not isinstance(exc, MemoryError):
        return str(exc)
    if command == "reconstruct":
        return ("out of memory; nothing partial was kept: give the command more memory, or fewer --workers "
                "(a single record too large for it is a bad line instead)")
    return "out of memory; nothing partial was kept: give the command more memory"


def _jsonl_input(path: Path, *, parquet_ok: bool = False) -> None:
    """One line and exit 2 for an input that is plainly not JSONL (gzip, Parquet, SQLite, ...):
    read as lines, each of its binary lines was a bad record and the output came out empty."""
    from .jsonl import NotJsonlError, binary_kind

    kind = binary_kind(path)
    if kind is None or (parquet_ok and kind[0] == "a Parquet file" and path.suffix == ".parquet"):
        return
    _fail(str(NotJsonlError(path, kind)))


@app.command()
def reconstruct(
    input: Path = typer.Argument(..., exists=True, dir_okay=False, help="Exchange records (JSONL)."),
    output: Path = typer.Option(..., "-o", "--output", help="Output JSONL, or Parquet when it ends .parquet."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", "-t", help=_TOKENIZER_HELP),
    dialect: str | None = typer.Option(None, "--dialect", help="Chat format (default: from the tokenizer)."),
    workers: int = typer.Option(0, "--workers", "-j", min=0, max=MAX_WORKERS, help="Worker processes (0 = all cores)."),
    usage_tolerance: int = typer.Option(0, "--usage-tolerance", help="Allowed |ours - usage| token delta."),
    warn: list[str] = typer.Option([], "--warn", help="Treat this finding code as a warning (repeatable)."),
    error: list[str] = typer.Option([], "--error", help="Treat this finding code as an error (repeatable)."),
    off: list[str] = typer.Option([], "--off", help="Do not report this finding code (repeatable)."),
    summary_json: Path | None = typer.Option(None, "--summary-json", help="Also write the summary as JSON."),
    provider_profile: Path | None = typer.Option(
        None, "--provider-profile", help="`tokenbridge probe --json` output: flag providers whose text edits are invisible."
    ),
) -> None:
    """Rebuild exact token ids from API text and gate every sample."""
    from rich.console import Console

    from .jsonl import NotJsonlError
    from .reconstruct import reconstruct_file
    from .view import summary_table
    from .traits import ProfileError, load_provider_profile

    _jsonl_input(input)
    policy = _policy(usage_tolerance, warn, error, off)
    _dialect_flag(dialect)
    profile = None
    if provider_profile is not None:
        try:
            profile = load_provider_profile(provider_profile)
        except ProfileError as exc:
            _fail(f"--provider-profile: {exc}")
    with _writing(output.parent, "reconstruct"):
        from .outdir import check_output_file, existing_inputs

        # every output before any work: a refused --summary-json must not come after -o was written
        inputs = existing_inputs(provider_profile, _tokenizer_input(tokenizer))
        check_output_file(output, input, inputs=inputs)
        if summary_json is not None:
            check_output_file(summary_json, input, flag="--summary-json", name="summary.json", outputs={"-o": output},
                              inputs=inputs)
        tok = _tokenizer(tokenizer)  # loading takes a while: Ctrl-C there is one line too
        _check_dialect(tok, dialect)
        from .fsio import open_staged, reading

        with ExitStack() as staged:
            staged.enter_context(reading(input))  # before any temp is made: the sweep it makes leaves the input
            # the summary's temp made first: a folder it cannot be written in fails before -o is replaced
            summary_fh = staged.enter_context(open_staged(summary_json, point="summary")) if summary_json else None
            try:
                summary = reconstruct_file(input, output, tok, dialect=dialect, policy=policy, workers=workers or None,
                                           provider_profile=profile)
            except NotJsonlError as exc:  # a pipe's bytes, looked at once read
                _fail(exc)
            if summary_fh is not None:
                summary_fh.write((json.dumps(summary.to_dict(), indent=2) + "\n").encode("utf-8"))
    console = Console(stderr=False)
    console.print(summary_table(summary, title=f"{input} → {output}"))
    for note in summary.stripping_suspects():
        _say(f"warning: {note}", err=True)  # names providers
    for note in summary.calibration_notes():
        _say(f"note: {note}", err=True)
    for bad in summary.bad_lines[:_SHOWN_BAD_LINES]:
        _say(f"bad record: {bad}", err=True)
    if summary.bad_line_count > _SHOWN_BAD_LINES:
        more = summary.bad_line_count - _SHOWN_BAD_LINES
        listed = ("all" if summary.bad_line_count == len(summary.bad_lines)
                  else f"the first {len(summary.bad_lines):,}")
        _say(f"... and {more} more bad lines" + (f" ({listed} in --summary-json)" if summary_json else ""), err=True)
    if summary.records == 0 and not summary.bad_lines:
        _say(f"warning: {input} holds no records; {output} has no rows.", err=True)
    elif summary.rows == 0:
        _say(f"no record was written: {output} is empty.", err=True)
    elif summary.bad_lines:
        _say(f"{summary.bad_line_count} bad record(s) skipped; the others were written.", err=True)
    if summary.bad_lines:
        raise typer.Exit(int(ExitCode.INCOMPLETE))


@app.command()
def inspect(
    input: Path = typer.Argument(..., exists=True, dir_okay=False,
                                 help="Reconstruct output (JSONL or .parquet), or exchange JSONL."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", "-t", help=_TOKENIZER_HELP),
    sample_id: str | None = typer.Option(None, "--id", help="Sample id (default: the first record)."),
    choice: int = typer.Option(0, "--choice", min=0, help="Choice index."),
    tokens: str | None = typer.Option(None, "--tokens", help="Also list tokens A:B (positions; ':' for all)."),
    dialect: str | None = typer.Option(None, "--dialect", help="Chat format, for exchange records."),
) -> None:
    """Show one sample's tokens with their ids and segment kinds."""
    from rich.console import Console

    from .view import check_span, find_row, parse_span, render_row

    _jsonl_input(input, parquet_ok=True)

    if tokens is not None:
        try:
            parse_span(tokens)
        except ValueError as exc:
            raise typer.BadParameter(f"{tokens!r}: {exc}", param_hint="--tokens") from None
    from .chat import DialectError
    from .rows import RowError

    _dialect_flag(dialect)
    tok = _tokenizer(tokenizer)
    _check_dialect(tok, dialect)  # as reconstruct: a dialect the tokenizer does not fit is a bad flag, before any record
    try:
        row = find_row(input, tok, sample_id, choice, dialect)
    except DialectError as exc:  # a dialect given for a file of rows, already rendered
        _fail(exc)
    except LookupError as exc:
        _fail(str(exc.args[0]))
    except RowError as exc:  # a row edited by hand: bad data, as export says of it
        _fail(exc, exc.exit_code)
    if tokens is not None:
        try:
            check_span(tokens, len(row["input_ids"]))
        except ValueError as exc:
            _fail(f"--tokens {tokens}: {exc}")
    Console(highlight=False).print(render_row(row, tok, tokens))


# --- generate / probe ------------------------------------------------------------------


def _csv(value: str | None) -> list[str] | None:
    """A comma-separated flag's names; an empty one is kept, for the schema to refuse."""
    return [v.strip() for v in value.split(",")] if value is not None else None


@app.command()
def generate(
    prompts: list[str] | None = typer.Argument(
        None,
        help="Prompt datasets: PATH or NAME=PATH (JSONL, Parquet, HF save_to_disk folder, folder of files); "
        "given here, they replace the config's datasets.",
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Run folder (state.sqlite, exchanges.jsonl); rerun to resume."),
    base_url: str | None = typer.Option(None, "--base-url", help="API base, e.g. https://openrouter.ai/api/v1."),
    model: str | None = typer.Option(None, "--model", "-m", help="Model id, e.g. moonshotai/kimi-k2.5."),
    concurrency: int | None = typer.Option(None, "--concurrency", "-c", min=1, help="Requests in flight at most."),
    max_attempts: int | None = typer.Option(None, "--max-attempts", min=1, help="Attempts per sample per run."),
    stream: bool | None = typer.Option(None, "--stream/--no-stream", help="Use SSE streaming."),
    max_cost: float | None = typer.Option(None, "--max-cost", min=0, help="Stop before spending more (USD, run folder total)."),
    config: Path | None = typer.Option(None, "--config", exists=True, dir_okay=False, help="TOML/YAML settings."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count prompt tokens and estimate cost; send nothing."),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", "-t", help="Tokenizer folder (for --dry-run; default: the config's, else "
        "$TOKENBRIDGE_TOKENIZER, else prompt tokens are approximated)."),
    limit: int | None = typer.Option(None, "--limit", min=0,
                                     help="At most N samples per dataset (a dataset's own limit too)."),
    api_key_env: str | None = typer.Option(None, "--api-key-env", help="Env variable holding the key."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=1),
    temperature: float | None = typer.Option(None, "--temperature"),
    top_p: float | None = typer.Option(None, "--top-p"),
    seed: int | None = typer.Option(None, "--seed"),
    n: int | None = typer.Option(None, "--n", min=1, help="Choices per prompt."),
    reasoning: str | None = typer.Option(None, "--reasoning", help="Effort (minimal|low|medium|high|xhigh|max|none), or on / off."),
    provider_order: str | None = typer.Option(None, "--provider-order", help="Comma list: try these first."),
    provider_only: str | None = typer.Option(None, "--provider-only", help="Comma list: only these."),
    provider_ignore: str | None = typer.Option(None, "--provider-ignore", help="Comma list: never these."),
    quantizations: str | None = typer.Option(None, "--quantizations", help="Comma list, e.g. int4,fp8."),
    fallbacks: bool | None = typer.Option(None, "--fallbacks/--no-fallbacks", help="provider.allow_fallbacks."),
    progress: str | None = typer.Option(None, "--progress", help="auto | rich | plain | none."),
    summary_json: Path | None = typer.Option(None, "--summary-json", help="Also write the run summary here."),
    max_response_bytes: int | None = typer.Option(
        None, "--max-response-bytes", min=1024, help="Refuse a response (or stream) larger than this (default 64 MiB)."),
    attempt_timeout: float | None = typer.Option(
        None, "--attempt-timeout", min=0.001, help="Seconds one attempt may take in all, streams too (default 900)."),
    allow_plain_http: bool | None = typer.Option(
        None, "--allow-plain-http", help="Send the key over plain http:// to a host that is not this machine "
        "(a server on a network you trust); refused otherwise."),
    force_settings: bool = typer.Option(
        False, "--force-settings",
        help="Rerun on a folder whose done samples were made with other settings (model, request, base_url): "
        "keep those answers, send the rest with these settings.",
    ),
) -> None:
    """Send every prompt to the API once and store each response verbatim (resumable).

    Exit codes: 0 all done, 1 some samples failed or rows were bad (or --summary-json could not be written),
    2 usage/config error, 3 HTTP 402,
    4 --max-cost reached, 5 repeated 401, 6 store write failed, 7 run folder in use, 8 internal error,
    130 interrupted.
    """
    from .chat import DialectError
    from .generate import GenerateError, generate_run
    from .tokenizer import TokenizerError

    flags = {
        "base_url": base_url, "concurrency": concurrency, "max_attempts": max_attempts, "stream": stream,
        "max_cost": max_cost, "tokenizer": tokenizer, "limit": limit, "api_key_env": api_key_env,
        "progress": progress, "max_response_bytes": max_response_bytes, "attempt_timeout_s": attempt_timeout,
        "allow_plain_http": allow_plain_http,
    }
    request = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
               "n": n, "reasoning": reasoning}
    provider = {"order": _csv(provider_order), "only": _csv(provider_only), "ignore": _csv(provider_ignore),
                "quantizations": _csv(quantizations), "allow_fallbacks": fallbacks}
    from .outdir import run_folder_problem

    why = run_folder_problem(out)  # before any request: a run writes exchanges.jsonl and its store there
    if why is not None:
        _fail(f"--out {why}")
    try:
        settings = _generate_settings(config, prompts, flags, request, provider, dry_run=dry_run)
        _check_generate_outputs(out, summary_json, settings, config)  # now, not after the paid generation
        if dry_run:
            _generate_dry_run(settings, out, summary_json, force_settings=force_settings)
            return
        summary = generate_run(settings, out, force_settings=force_settings)
    except KeyboardInterrupt:  # outside the send loop (loading, writing): nothing half-written is kept
        _fail(f"interrupted; what was stored in {out} is kept: rerun the same command to continue", ExitCode.INTERRUPTED)
    except GenerateError as exc:
        _fail(exc, exc.exit_code)
    except (TokenizerError, DialectError) as exc:
        _fail(exc)
    _echo_totals(summary)
    _echo_run_problems(summary, out, quiet=settings.progress == "none")  # else the progress log showed them
    _say(f"exchanges: {summary.exchanges}"
         + (f" ({summary.left_out} other stored samples left out)" if summary.left_out else ""))
    _write_summary(summary_json, summary.to_dict(), status=summary.exit_code,
                   kept=f"; the run itself is stored in {out}")
    raise typer.Exit(summary.exit_code)


def _generate_settings(config: Path | None, prompts: list[str] | None, flags: Mapping[str, object],
                       request: Mapping[str, object], provider: Mapping[str, object], *,
                       dry_run: bool = False) -> GenerateSettings:
    """The config file's settings (or the defaults) with the given flags over them; the flags
    map onto the config's schema and are checked by it, each problem naming its flag."""
    from .generate import GenerateSettings, load_config, parse_dataset_arg
    from dataclasses import replace

    from .generate.settings import override_settings
    from .schema import Where

    # a dry run sends nothing: a run config's [emulator] is no reason to refuse it
    given = dry_run or flags.get("base_url") is not None
    settings = load_config(config, base_url_given=given) if config else GenerateSettings()
    merged = {**(settings.request.provider or {}), **{k: v for k, v in provider.items() if v is not None}}
    datasets = tuple(parse_dataset_arg(p) for p in prompts) if prompts else None
    cap = flags.get("limit")
    if isinstance(cap, int):  # --limit N: at most N from every dataset, its own limit in the file too
        datasets = tuple(replace(d, limit=cap if d.limit is None else min(d.limit, cap))
                         for d in (datasets or settings.datasets))
    overrides = {**flags, "datasets": datasets, "request": {**request, "provider": merged or None}}
    return override_settings(settings, overrides, Where("command line", flags=_GENERATE_FLAGS))


def _check_generate_outputs(out: Path, summary_json: Path | None, settings: GenerateSettings,
                            config: Path | None) -> None:
    """Neither output may replace an input (the prompt files and folders, the config, a
    local tokenizer): ``--out``'s run rewrites its store, exchanges.jsonl and generate.json,
    and ``--summary-json`` may be none of those nor the run's lock (one line, exit 2). The
    folder itself was checked before the settings were read."""
    from .outdir import existing_inputs, run_inputs_problem

    inputs = existing_inputs(config, _tokenizer_input(settings.tokenizer), *(d.path for d in settings.datasets))
    why = run_inputs_problem(out, inputs)
    if why is not None:
        _fail(f"--out {why}")
    if summary_json is not None:
        _check_output(summary_json, flag="--summary-json", name="summary.json", inputs=inputs, runs=[out],
                      outputs={"--out": out})


def _check_output(path: Path, **how: Any) -> None:
    """:func:`~tokenbridge.outdir.check_output_file` before a command's work, its refusal
    the command's one ``error:`` line (exit 2)."""
    from .outdir import OutputRefused, check_output_file

    try:
        check_output_file(path, **how)
    except OutputRefused as exc:
        _fail(exc, exc.exit_code)


def _generate_dry_run(settings: GenerateSettings, out: Path, summary_json: Path | None, *, force_settings: bool = False) -> None:
    """Count and price what a run would send; exact with a tokenizer (the flag's, the config's
    or ``$TOKENBRIDGE_TOKENIZER``), approximate without one."""
    import dataclasses
    import os

    from .generate import dry_run
    from .tokenizer_source import TOKENIZER_ENV

    if settings.tokenizer is None and os.environ.get(TOKENIZER_ENV, "").strip():
        settings = dataclasses.replace(settings, tokenizer=os.environ[TOKENIZER_ENV])
    report = dry_run(settings, out, force_settings=force_settings)
    for line in report.lines(listed_in=summary_json):
        _say(line)
    _write_summary(summary_json, report.to_dict(), status=report.exit_code)
    raise typer.Exit(report.exit_code)


def _echo_totals(summary: RunSummary) -> None:
    """The run's one-line account: samples, requests, money, time."""
    _say(
        f"{summary.done} done this run ({summary.already_done} before), {summary.failed} failed, "
        f"{summary.pending} pending, {len(summary.bad_rows)} bad rows; {summary.requests} requests, "
        f"${summary.spent_run:.4f} this run (${summary.spent_total:.4f} total"
        + (f", ${summary.spent_possible:.4f} possibly billed" if summary.spent_possible else "")
        + f") in {summary.elapsed_s:.1f}s"
    )


def _echo_run_problems(summary: RunSummary, out: Path, *, quiet: bool) -> None:
    """Bad rows, failures, unusable usage and why the run stopped, on stderr; with ``quiet``
    (no progress log) also the first bad rows and the notes the log would have shown."""
    for row in summary.bad_rows[:5] if quiet else ():
        _say(f"bad row: {row}", err=True)
    if summary.bad_rows and (len(summary.bad_rows) > 5 or not quiet):
        _say(f"{len(summary.bad_rows)} bad rows in all (listed in {out / 'generate.json'})", err=True)
    for f in summary.failures[:10]:
        _say(f"failed: {f['id']}: {f['error_class']}: {f['error']}", err=True)  # API text
    for note in summary.notices if quiet else ():
        if note.startswith(("stopping:", "could not", str(out))):
            _say(f"note: {note}", err=True)
    if summary.bad_usage:
        _say(f"note: {summary.bad_usage} response(s) kept with unusable usage fields, ignored "
             f"(e.g. {summary.bad_usage_examples[0]}; all in {out / 'generate.json'})", err=True)
    if summary.no_finish:
        from .generate.outcome import no_finish_line

        _say(f"note: {no_finish_line(summary)}", err=True)
    if summary.stop_reason:
        _say(f"stopped: {summary.stop_reason}: {summary.already_done + summary.done} of {summary.samples} "
             f"samples kept, {summary.pending} pending (rerun the same command to continue)", err=True)


_GENERATE_FLAGS = {
    "datasets": "PROMPTS", "base_url": "--base-url", "concurrency": "--concurrency", "max_attempts": "--max-attempts",
    "stream": "--stream", "max_cost": "--max-cost", "tokenizer": "--tokenizer", "limit": "--limit",
    "api_key_env": "--api-key-env", "progress": "--progress", "max_response_bytes": "--max-response-bytes",
    "attempt_timeout_s": "--attempt-timeout", "allow_plain_http": "--allow-plain-http", "request.model": "--model",
    "request.max_tokens": "--max-tokens", "request.temperature": "--temperature", "request.top_p": "--top-p",
    "request.seed": "--seed", "request.n": "--n", "request.reasoning": "--reasoning",
    "request.provider": "provider flags", "request.provider.order": "--provider-order",
    "request.provider.only": "--provider-only", "request.provider.ignore": "--provider-ignore",
    "request.provider.quantizations": "--quantizations", "request.provider.allow_fallbacks": "--fallbacks",
}


def _write_summary(path: Path | None, data: Mapping[str, object], flag: str = "--summary-json",
                   point: str = "summary-json", *, status: int = ExitCode.OK, kept: str = "") -> None:
    """Write a command's JSON document where its ``flag`` says (atomic); a failure is the
    command's one error line, naming the flag and the path. A failed write (ENOSPC, EROFS)
    exits 1, as every stage's failed output does (2 is a usage error: the run was fine), or
    with ``status``, the command's own exit status, when that is already another failure;
    ``kept`` says where what the command did is kept."""
    if path is None:
        return
    from .fsio import OutputWriteError, write_text
    from .jsonl import dumps_document

    try:
        write_text(path, dumps_document(data), point=point)
    except OutputWriteError as exc:
        _fail(f"{flag}: {exc}{kept}", getattr(exc, "exit_code", None) or status or ExitCode.INCOMPLETE)
    except OSError as exc:
        _fail(f"{flag} {path}: cannot write ({exc.strerror or exc}){kept}", status or ExitCode.INCOMPLETE)


@app.command()
def probe(
    model: str = typer.Option(..., "--model", "-m", help="Model id, e.g. moonshotai/kimi-k2.5."),
    providers: str = typer.Option(..., "--providers", help="Comma list of providers, e.g. chutes/int4,siliconflow/int4."),
    base_url: str = typer.Option("https://openrouter.ai/api/v1", "--base-url", help="API base URL."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the full results as JSON here."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", "-t", help=_TOKENIZER_HELP),
    max_tokens: int = typer.Option(2048, "--max-tokens", min=1),
    reasoning: str | None = typer.Option(None, "--reasoning", help="Effort (minimal|low|medium|high|xhigh|max|none), or on / off."),
    api_key_env: str = typer.Option("OPENROUTER_API_KEY", "--api-key-env", help="Env variable holding the key."),
    max_response_bytes: int | None = typer.Option(
        None, "--max-response-bytes", min=1024, help="Refuse a response larger than this, as generate does (default 64 MiB)."),
    allow_plain_http: bool = typer.Option(
        False, "--allow-plain-http", help="Send the key over plain http:// to a host that is not this machine."),
) -> None:
    """Pin each provider, send probe prompts, and report what survives reconstruction."""
    from rich.console import Console

    from .generate import GenerateError, probe as _probe, read_api_key, render_table
    from .generate.secrets import scrub
    from .generate.run import is_local_url
    from .generate.settings import MAX_RESPONSE_BYTES, check_base_url, normalize_reasoning, plain_http_problem
    from .outdir import existing_inputs

    if json_out is not None:  # now, not after the (paid) probes
        _check_output(json_out, flag="--json", name="probe.json", inputs=existing_inputs(_tokenizer_input(tokenizer)))
    from .generate.settings import env_name_problem

    if why := env_name_problem(api_key_env):  # never printed: a key pasted here was echoed in "... is not set"
        _fail(f"--api-key-env: {why}")
    try:
        check_base_url(base_url, "--base-url")
        tok = _tokenizer(tokenizer)
        _check_dialect(tok, None)
        key = read_api_key(api_key_env, required=not is_local_url(base_url))
        if key is not None and (why := plain_http_problem(base_url, allow_plain_http)):
            _fail(f"--base-url {why}")
        effort = normalize_reasoning(reasoning, "--reasoning") if reasoning else None
    except GenerateError as exc:
        _fail(exc, exc.exit_code)
    names = list(dict.fromkeys(_csv(providers) or []))  # each once: its profile is named by it
    if not names or not all(names):
        _fail("--providers: give at least one provider, and no empty name")
    try:  # a key that cannot be sent is refused here, before any probe
        reports = _probe(model=model, providers=names, base_url=base_url, key=key, tokenizer=tok,
                         max_tokens=max_tokens, reasoning=effort,
                         max_response_bytes=max_response_bytes or MAX_RESPONSE_BYTES)
    except GenerateError as exc:
        _fail(exc, exc.exit_code)
    from .generate.probe import render_profiles

    Console(highlight=False).print(render_table(reports))
    Console(highlight=False).print(render_profiles(reports))
    if json_out:
        data = {"model": model, "base_url": scrub(base_url, key), "providers": [r.to_dict() for r in reports]}
        _write_summary(json_out, data, "--json", "probe-json")
    # answered nothing, and not because it serves no such endpoint (the table says "none" there)
    silent = [r.provider for r in reports if not any(c.ok for c in r.calls) and r.available is not False]
    if silent:  # a table of dashes is no finding: say so, and exit 1 as generate does for failed samples
        _say(f"probe: {len(silent)} of {len(reports)} provider(s) answered no probe prompt, so nothing is known of "
             f"them: {', '.join(silent)} (their errors are in --json)")
        raise typer.Exit(ExitCode.INCOMPLETE)


# --- emulator --------------------------------------------------------------------------


@app.command()
def emulator(
    port: int = typer.Option(8000, "--port", "-p", min=0, max=65535, help="Port to listen on (0 = any free port)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (keep it loopback)."),
    latency_ms: float | None = typer.Option(None, "--latency-ms", help="Time to first byte, ms, for every provider."),
    fault_rate: float | None = typer.Option(
        None, "--fault-rate", help="Share of requests that get a transport fault (429/5xx/malformed/...)."
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", exists=True, dir_okay=False, help="Emulator config (TOML or YAML)."
    ),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", "-t", help="Tokenizer folder or Hub repo id (default: the config's, else $TOKENBRIDGE_TOKENIZER)."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Seed for outputs, quirks and faults."),
) -> None:
    """Serve a loopback OpenRouter-compatible API backed by a synthetic model (for dry runs)."""
    import dataclasses

    from .emulator import ConfigError, EmulatorConfig, load_emulator_config, serve
    from .emulator.config import emulator_config_problems
    from .schema import Where

    try:
        cfg = load_emulator_config(config) if config else EmulatorConfig()
    except ConfigError as exc:
        _fail(exc)
    overrides: dict[str, object] = {k: v for k, v in {"latency_ms": latency_ms, "fault_rate": fault_rate,
                                                      "seed": seed}.items() if v is not None}
    if latency_ms is not None:  # the flag wins over per-provider latencies too
        overrides["providers"] = tuple(dataclasses.replace(p, latency_ms=None) for p in cfg.providers)
    flags = {"latency_ms": "--latency-ms", "fault_rate": "--fault-rate", "seed": "--seed"}
    checked, problems = emulator_config_problems(overrides, Where("command line", flags=flags), cfg)
    if checked is None:
        _fail(problems)
    cfg = checked
    tok = _tokenizer(tokenizer, cfg.tokenizer, config="the --config file")
    _check_dialect(tok, cfg.dialect)
    try:
        serve(cfg, tok, host=host, port=port, announce=_say)
    except OSError as exc:  # the port in use, an address that does not resolve or is not this machine's
        _fail(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})")



# --- export / vocab / report -----------------------------------------------------------




@app.command()
def export(
    input: Path = typer.Argument(..., exists=True, dir_okay=False, help="Reconstruct output (JSONL, or .parquet)."),
    output: Path = typer.Option(..., "-o", "--output", help="Output folder (replaced only when the export succeeds)."),
    fmt: str = typer.Option(..., "--format", "-f", help="specforge | speculators | parquet | conversations."),
    include_flagged: bool = typer.Option(False, "--include-flagged", help="Also export 'flagged' rows (never 'rejected')."),
    shard_rows: int = typer.Option(200_000, "--shard-rows", min=1, max=MAX_ROWS, help="Parquet: rows per shard at most."),
    row_group_rows: int = typer.Option(1000, "--row-group-rows", min=1, max=MAX_ROWS,
                                       help="Parquet: rows per row group."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty -o folder tokenbridge did not write "
                               "(never a run folder, the input's folder or the current folder)."),
    target_vocab_size: int | None = typer.Option(
        None, "--target-vocab-size", min=1, max=MAX_VOCAB_SIZE,
        help="Refuse rows with an id outside this vocabulary (run passes the tokenizer's; at most 2**24)."),
) -> None:
    """Write validated training rows in a trainer's format."""
    _jsonl_input(input, parquet_ok=True)
    from .export import ExportError, export_file
    from .runconfig import ExportSection
    from .schema import Where, validate

    problems = validate(ExportSection, {"formats": [fmt]}, Where("command line", flags={"formats": "--format"}))[1]
    if problems:
        _fail(problems)
    options = {"shard_rows": shard_rows, "row_group_rows": row_group_rows} if fmt == "parquet" else {}
    try:
        with _writing(output, "export"):
            summary = export_file(input, output, fmt, include_flagged=include_flagged, force=force,
                                  vocab_size=target_vocab_size, **options)
    except ExportError as exc:
        _fail(exc, exc.exit_code)
    skipped = summary.skipped
    _say(
        f"{summary.rows_exported} rows ({summary.tokens} tokens, {summary.completion_tokens} under the loss mask) "
        f"→ {summary.out_dir} [{fmt}]; skipped {skipped['flagged']} flagged, {skipped['rejected']} rejected"
        + (f", {skipped['not_a_chat_turn']} not a chat turn" if "not_a_chat_turn" in skipped else "")
    )


@app.command()
def vocab(
    input: Path = typer.Argument(..., exists=True, dir_okay=False, help="Reconstruct output (JSONL, or .parquet)."),
    draft_vocab_size: int = typer.Option(..., "--draft-vocab-size", "-n", min=1, max=MAX_VOCAB_SIZE,
                                         help="Draft vocabulary size N (at most --target-vocab-size)."),
    output: Path = typer.Option(..., "-o", "--output", help="Output folder for d2t/t2d files and vocab.json."),
    target_vocab_size: int | None = typer.Option(
        None, "--target-vocab-size", min=1, max=MAX_VOCAB_SIZE,
        help="Target model vocab size (the length of t2d; at most 2**24, far above any real vocabulary)."
    ),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", "-t", help="Tokenizer folder or Hub repo id to take the target vocab size from "
        "(default: $TOKENBRIDGE_TOKENIZER)."
    ),
    include_flagged: bool = typer.Option(False, "--include-flagged", help="Also count 'flagged' rows."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty -o folder tokenbridge did not write "
                               "(never a run folder, the input's folder or the current folder)."),
) -> None:
    """Build the draft vocabulary (d2t / t2d) from token frequencies under the loss mask."""
    _jsonl_input(input, parquet_ok=True)
    import os

    from .export import ExportError, build_vocab
    from .export.vocab import target_vocab_size_of
    from .tokenizer_source import TOKENIZER_ENV

    if target_vocab_size is None and tokenizer is None and not os.environ.get(TOKENIZER_ENV, "").strip():
        raise typer.BadParameter(f"give --target-vocab-size or --tokenizer (or set {TOKENIZER_ENV})",
                                 param_hint="--target-vocab-size")
    try:
        with _writing(output, "vocab"):
            from .outdir import check_output_dir, existing_inputs

            # the tokenizer folder it reads is an input too: --force must never replace it (or a parent of it)
            tok_input = existing_inputs(_tokenizer_input(tokenizer)) if target_vocab_size is None else []
            check_output_dir(output, "vocab", inputs=[input, *tok_input], force=force)
            target, source, warning = (target_vocab_size, "given", None) if target_vocab_size is not None else \
                target_vocab_size_of(_tokenizer(tokenizer), None)
            if warning:
                _say(f"warning: {warning}", err=True)
            summary = build_vocab(input, draft_vocab_size, output, target, include_flagged=include_flagged,
                                  force=force, target_vocab_size_from=source)
    except ExportError as exc:
        _fail(exc, exc.exit_code)
    except ValueError as exc:
        _fail(exc)
    _say(
        f"draft vocab {summary.draft_vocab_size} of {summary.target_vocab_size}: coverage {summary.coverage:.2%} of "
        f"{summary.masked_tokens} masked tokens ({summary.distinct_tokens} distinct; {summary.filled_unseen} unseen "
        f"ids filled) → {output}"
    )
    for name, why in summary.skipped_files.items():
        _say(f"not written: {name} ({why})", err=True)


@app.command()
def report(
    run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="Run folder (needs reconstructed.jsonl)."),
    force: bool = typer.Option(False, "--force", help="Replace RUN/report even if tokenbridge did not write it."),
) -> None:
    """Write RUN/report/report.html + report.json and print the same numbers."""
    from rich.console import Console

    from .report import ReportError, build_report, print_summary

    try:
        with _writing(run_dir, "report"):
            html = build_report(run_dir, force=force)
    except ReportError as exc:
        _fail(exc, exc.exit_code)
    from .jsonl import loads_document

    written = html.parent / "report.json"
    try:  # read back, not trusted: it may have been replaced since
        data = loads_document(written.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON, nested too deeply (JsonLineError)
        _fail(f"{written}: cannot read the report just written ({exc}); {html} was written")
    if not isinstance(data, dict):
        _fail(f"{written}: cannot read the report just written (not a JSON object); {html} was written")
    print_summary(data, Console(highlight=False))
    _say(f"report: {html}")


# --- run -------------------------------------------------------------------------------


def _anticipated_errors() -> tuple[type[BaseException], ...]:
    """Errors a stage raises for bad input or settings: shown as one line, not a traceback."""
    from .chat import DialectError, TemplateError
    from .emulator import ConfigError as EmulatorConfigError
    from .export import ExportError
    from .report import ReportError
    from .tokenizer import TokenizerError

    return (DialectError, TemplateError, EmulatorConfigError, ExportError, ReportError, TokenizerError)


@app.command()
def run(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="Pipeline config (TOML)."),
) -> None:
    """Datasets → generate → reconstruct → export → vocab → report, each stage resumable."""
    from .generate import GenerateError
    from .pipeline import PipelineError, incomplete, load_run_config, run_pipeline

    from .fsio import OutputWriteError
    from .interrupt import EXIT_INTERRUPTED, STOPPED, stop_on_signals
    from .outdir import OutputRefused

    try:
        cfg = load_run_config(config)
        with stop_on_signals():
            results = run_pipeline(cfg, echo=_say)
    except KeyboardInterrupt:
        _say(STOPPED, err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except OutputRefused as exc:
        _fail(exc, exc.exit_code)
    except OutputWriteError as exc:
        _fail(exc, ExitCode.INCOMPLETE)
    except PipelineError as exc:
        _fail(exc, exc.code)
    except GenerateError as exc:
        _fail(exc, exc.exit_code)
    except _resource_failures() as exc:
        _fail(_resource_failure(exc, "run"), ExitCode.INCOMPLETE)
    except _anticipated_errors() as exc:  # bad data (a row an export or the report refused) is 1, as alone
        _fail(f"{type(exc).__name__}: {exc}", getattr(exc, "exit_code", ExitCode.CONFIG))
    ran = ", ".join(f"{r.name} {r.status}" for r in results)
    _say(f"done: {ran}")
    made = {"reconstruct": "reconstructed.jsonl", "vocab": "vocab/", "report": "report/report.html"}
    names = [made.get(r.name, f"export/{r.name.partition(':')[2]}/") for r in results
             if r.name != "generate" and r.status in ("ran", "skipped")]  # never an old output as a result
    _say(f"results in {cfg.out} ({', '.join(names) or 'none'})")
    if incomplete(results):  # failed samples, bad prompt rows or refused records: 1, as each stage alone
        raise typer.Exit(ExitCode.INCOMPLETE)


def _stopped_with_a_line(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` with a Ctrl-C/SIGTERM that lands outside its stage's own handling (after
    the outputs were published, while the summary prints) said as everywhere else: typer
    exits 130 without a word there. Every output is published in one step, so the line holds."""
    from .interrupt import EXIT_INTERRUPTED, STOPPED

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            _say(STOPPED, err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return run


for _info in app.registered_commands:
    if _info.callback is not None:
        _info.callback = _stopped_with_a_line(_info.callback)


def main() -> None:
    """The console script: a bug (any exception a command does not turn into an ``error:``
    line) prints its traceback, scrubbed of secrets from the environment, and exits
    :attr:`ExitCode.INTERNAL`, never the bad-input status 1."""
    try:
        app()
    except Exception:  # noqa: BLE001 - the last line of defence: report a bug as a bug
        import traceback

        from .generate.secrets import MIN_MASKED, keys_read, scrub

        text = traceback.format_exc()
        # every key the command read (under whatever variable name), and anything that looks like one
        # and is long enough for scrub to take for a secret (a shorter one it would leave as it is)
        secrets = {*keys_read(), *(value for name, value in os.environ.items() if len(value) >= MIN_MASKED
                                   and any(w in name.upper() for w in ("KEY", "TOKEN", "SECRET", "PASSWORD")))}
        for value in sorted(secrets, key=len, reverse=True):  # a longer secret first: one inside it stays whole
            text = scrub(text, value)
        sys.stderr.write(text)
        _say("error: internal error (a bug in tokenbridge, not in your data): the traceback is above", err=True)
        raise SystemExit(int(ExitCode.INTERNAL)) from None


if __name__ == "__main__":
    main()
