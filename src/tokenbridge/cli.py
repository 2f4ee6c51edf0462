"""The ``tokenbridge`` command line: thin wrappers over the library."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Exact-token training data for speculative-decoding drafts from text-only APIs.",
)


# --- reconstruct / inspect -------------------------------------------------------------


def _policy(usage_tolerance: int, warn: list[str], error: list[str], off: list[str]):
    from .checks import Policy

    severities = {**{c: "warning" for c in warn}, **{c: "error" for c in error}, **{c: "off" for c in off}}
    try:
        return Policy(severities=severities, usage_tolerance=usage_tolerance)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def reconstruct(
    input: Path = typer.Argument(..., exists=True, dir_okay=False, help="Exchange records (JSONL)."),
    output: Path = typer.Option(..., "-o", "--output", help="Output JSONL, or Parquet when it ends .parquet."),
    tokenizer: str = typer.Option(..., "--tokenizer", "-t", help="Tokenizer folder or Hub repo id."),
    dialect: Optional[str] = typer.Option(None, "--dialect", help="Chat format (default: from the tokenizer)."),
    workers: int = typer.Option(0, "--workers", "-j", help="Worker processes (0 = all cores)."),
    usage_tolerance: int = typer.Option(0, "--usage-tolerance", help="Allowed |ours - usage| token delta."),
    warn: list[str] = typer.Option([], "--warn", help="Treat this finding code as a warning (repeatable)."),
    error: list[str] = typer.Option([], "--error", help="Treat this finding code as an error (repeatable)."),
    off: list[str] = typer.Option([], "--off", help="Do not report this finding code (repeatable)."),
    summary_json: Optional[Path] = typer.Option(None, "--summary-json", help="Also write the summary as JSON."),
) -> None:
    """Rebuild exact token ids from API text and gate every sample."""
    from rich.console import Console

    from .chat import DialectError, resolve_dialect
    from .reconstruct import reconstruct_file
    from .view import summary_table
    from .tokenizer import TokenizerError, load_tokenizer

    policy = _policy(usage_tolerance, warn, error, off)
    try:
        tok = load_tokenizer(tokenizer)
        resolve_dialect(tok, dialect)
    except (TokenizerError, DialectError) as exc:
        _fail(str(exc))
    summary = reconstruct_file(input, output, tok, dialect=dialect, policy=policy, workers=workers or None)
    console = Console(stderr=False)
    console.print(summary_table(summary, title=f"{input} → {output}"))
    for bad in summary.bad_lines:
        typer.echo(f"bad record: {bad}", err=True)
    if summary_json:
        summary_json.write_text(json.dumps(summary.to_dict(), indent=2) + "\n", encoding="utf-8")
    if summary.bad_lines:
        typer.echo(f"{len(summary.bad_lines)} bad record(s) skipped; the others were written.", err=True)
        raise typer.Exit(1)


@app.command()
def inspect(
    input: Path = typer.Argument(..., exists=True, dir_okay=False, help="Reconstructed or exchange JSONL."),
    tokenizer: str = typer.Option(..., "--tokenizer", "-t", help="Tokenizer folder or Hub repo id."),
    sample_id: Optional[str] = typer.Option(None, "--id", help="Sample id (default: the first record)."),
    choice: int = typer.Option(0, "--choice", help="Choice index."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Also list tokens A:B (positions; ':' for all)."),
    dialect: Optional[str] = typer.Option(None, "--dialect", help="Chat format, for exchange records."),
) -> None:
    """Show one sample's tokens with their ids and segment kinds."""
    from rich.console import Console

    from .view import find_row, render_row
    from .tokenizer import TokenizerError, load_tokenizer

    try:
        tok = load_tokenizer(tokenizer)
    except TokenizerError as exc:
        _fail(str(exc))
    try:
        row = find_row(input, tok, sample_id, choice, dialect)
    except LookupError as exc:
        _fail(str(exc.args[0]))
    Console(highlight=False).print(render_row(row, tok, tokens))


# --- generate / probe ------------------------------------------------------------------


# --- emulator --------------------------------------------------------------------------


# --- export / vocab / report -----------------------------------------------------------


# --- run -------------------------------------------------------------------------------


def main() -> None:
    app()


if __name__ == "__main__":
    main()
