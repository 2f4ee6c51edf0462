"""Which tokenizer a command uses when it needs one: never a path guessed from the cwd.

The tokenizer is named by the command's flag, else by its config file, else by the
environment variable ``TOKENBRIDGE_TOKENIZER`` (a folder or a Hub repo id, as the flag
takes). Library code used to fall back to a Kimi folder beside the checkout, relative to
the working directory: it worked in one checkout layout and loaded the wrong folder, or
failed with a traceback, anywhere else.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from .tokenizer import TokenizerError

__all__ = ["TOKENIZER_ENV", "NoTokenizerError", "choose_tokenizer"]

#: The environment variable read when neither a flag nor a config names the tokenizer.
TOKENIZER_ENV: Final = "TOKENBRIDGE_TOKENIZER"


class NoTokenizerError(TokenizerError):
    """No tokenizer was named anywhere; the message lists the ways to name one."""


def choose_tokenizer(flag_value: str | Path | None, config_value: str | Path | None = None, *,
                     flag: str = "--tokenizer", config: str | None = None) -> str | Path:
    """The flag's value, else the config's, else ``$TOKENBRIDGE_TOKENIZER``.

    ``flag`` and ``config`` say, for the error, how this caller names a tokenizer
    (``config`` None: the caller has no config file). An empty value counts as none.
    """
    for value in (flag_value, config_value, os.environ.get(TOKENIZER_ENV)):
        if value is not None and str(value).strip():
            return value
    ways = [f"pass {flag} (a tokenizer folder or Hub repo id)"]
    if config is not None:
        ways.append(f"set tokenizer in {config}")
    ways.append(f"set the environment variable {TOKENIZER_ENV}")
    last = ", or " if len(ways) > 2 else " or "
    raise NoTokenizerError("no tokenizer given: " + ", ".join(ways[:-1]) + last + ways[-1])
