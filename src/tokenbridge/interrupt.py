"""Ctrl-C and SIGTERM outside ``generate``: stop at once, keep nothing partial, say so in one line.

The stages write every output to a temp name and move it into place only when complete
(:mod:`tokenbridge.fsio`), so stopping is just unwinding: :func:`stop_on_signals` turns
the first SIGINT or SIGTERM into ``KeyboardInterrupt`` (and ignores further ones so the
clean-up that unwinding runs is not cut short); the CLI prints :data:`STOPPED` and exits
with :data:`EXIT_INTERRUPTED`.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Any, NoReturn
from collections.abc import Iterator

__all__ = ["EXIT_INTERRUPTED", "STOPPED", "install", "kept_handlers", "stop_on_signals"]

STOPPED = "stopped; nothing partial was kept; run the same command to continue"
EXIT_INTERRUPTED = 130
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _on_signal(signum: int, frame: FrameType | None) -> NoReturn:
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def install() -> None:
    """(Re)install the handlers, e.g. after ``generate`` restored the defaults (main
    thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _SIGNALS:
        signal.signal(sig, _on_signal)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT/SIGTERM raise ``KeyboardInterrupt`` while inside; the old handlers after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old: list[Any] = [signal.getsignal(sig) for sig in _SIGNALS]
    install()
    try:
        yield
    finally:
        for sig, handler in zip(_SIGNALS, old):
            signal.signal(sig, handler)


@contextmanager
def kept_handlers() -> Iterator[None]:
    """Put back the SIGINT/SIGTERM handlers of before (``generate`` resets them to the
    defaults when it ends, which would turn a later SIGTERM into a silent kill)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old: list[Any] = [signal.getsignal(sig) for sig in _SIGNALS]
    try:
        yield
    finally:
        for sig, handler in zip(_SIGNALS, old):
            if handler is not None:
                signal.signal(sig, handler)
