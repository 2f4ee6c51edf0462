"""The exit status of every ``tokenbridge`` command, in one place.

A config or usage error is 2 in every command and every config section (``run``,
``generate``, ``emulator``, ``export``...). The others are ``generate``'s documented
codes, which ``tokenbridge run`` passes on when generation stops.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode"]


class ExitCode(IntEnum):
    """What a command's exit status means (``RunSummary.exit_code`` uses the same values)."""

    OK = 0
    INCOMPLETE = 1  # finished, but some samples failed or some rows/records were bad
    USAGE = 2  # a bad flag or config value: nothing was sent or written
    CONFIG = 2  # the same status under the name config errors use
    PAYMENT = 3  # HTTP 402: out of credits
    BUDGET = 4  # --max-cost reached
    UNAUTHORIZED = 5  # repeated HTTP 401
    STORE = 6  # the run state could not be written
    BUSY = 7  # another process holds the run folder
    INTERNAL = 8  # a background task died (a bug); what was committed is kept
    INTERRUPTED = 130  # Ctrl-C / SIGTERM
