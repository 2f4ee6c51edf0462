"""tokenbridge: exact-token training data for speculative-decoding drafts from text APIs.

The pipeline, one module (or package) per stage::

    tokenizer    load a tokenizer folder or Hub id, encode exactly as the model does
    chat         dialects: render the prompt, assemble the completion
    reconstruct  exchange records -> ids per choice, run through the gate (checks)
    generate     prompt datasets -> OpenRouter / OpenAI-compatible API -> exchanges.jsonl
    emulator     a loopback OpenRouter-compatible server for tests and dry runs
    export       SpecForge / speculators / Parquet / conversations, draft vocabulary
    report       HTML + JSON + terminal report of a run
    pipeline     `tokenbridge run CONFIG`: all of the above, resumable

The public names below are imported on first use, not with the package: the CLI
imports only what a command needs, and ``import tokenbridge`` alone must not pull
jinja2, multiprocessing or orjson in (``tokenbridge --help`` starts in a tenth of
a second).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from .chat import Dialect, resolve_dialect, thinking_enabled
    from .checks import CODES, Finding, Policy
    from .exchanges import RecordError
    from .reconstruct import ReconstructSummary, reconstruct_file, reconstruct_record
    from .tokenizer import Tokenizer, TokenizerError, load_tokenizer

    __version__: str

__all__ = [
    "CODES",
    "Dialect",
    "Finding",
    "Policy",
    "ReconstructSummary",
    "RecordError",
    "Tokenizer",
    "TokenizerError",
    "__version__",
    "load_tokenizer",
    "reconstruct_file",
    "reconstruct_record",
    "resolve_dialect",
    "thinking_enabled",
]

#: Each public name -> the submodule that defines it.
_HOMES: dict[str, str] = {
    "Dialect": "chat", "resolve_dialect": "chat", "thinking_enabled": "chat",
    "CODES": "checks", "Finding": "checks", "Policy": "checks",
    "RecordError": "exchanges",
    "ReconstructSummary": "reconstruct", "reconstruct_file": "reconstruct", "reconstruct_record": "reconstruct",
    "Tokenizer": "tokenizer", "TokenizerError": "tokenizer", "load_tokenizer": "tokenizer",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # ~60 ms: only when asked

    try:
        return version("tokenbridge")
    except PackageNotFoundError:  # running from a source tree without installing
        return "0+unknown"


def __getattr__(name: str) -> object:
    """Import a public name's submodule on first use, then keep the name here."""
    if name == "__version__":
        value: object = _version()
    elif name in _HOMES:
        value = getattr(import_module(f".{_HOMES[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
