"""The console script (``tokenbridge``) and ``python -m tokenbridge``.

Why a module of its own: the script's first step is importing the CLI (typer, click: a
few hundred milliseconds), and a Ctrl-C then, before any handler of ours exists, printed
a traceback out of ``importlib``. Here the import itself is inside the handling: the
interrupt is one line, as everywhere else, and nothing was written yet to keep or lose.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> None:
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        from .interrupt import EXIT_INTERRUPTED, STOPPED

        sys.stderr.write(f"{STOPPED}\n")
        raise SystemExit(EXIT_INTERRUPTED) from None
    cli_main()


if __name__ == "__main__":
    main()
