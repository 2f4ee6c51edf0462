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
"""

from importlib.metadata import PackageNotFoundError, version

from .chat import Dialect, resolve_dialect, thinking_enabled
from .checks import CODES, Finding, Policy
from .exchanges import RecordError
from .reconstruct import ReconstructSummary, reconstruct_file, reconstruct_record
from .tokenizer import Tokenizer, TokenizerError, load_tokenizer

try:
    __version__ = version("tokenbridge")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+unknown"

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
