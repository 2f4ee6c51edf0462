"""The errors a ``generate`` call raises before (or instead of) running, each with its exit code.

Every anticipated failure is a :class:`GenerateError`: callers (the CLI, ``tokenbridge
run``) catch that one class, print ``str(exc)`` (one line, no secret) and exit with
``exc.exit_code``. Problems found *during* a run never raise: they end up in
:class:`~.run.RunSummary` (``exit_code``, ``stop_reason``, ``notices``).
"""

from __future__ import annotations

from ..exit_codes import ExitCode

__all__ = ["AlreadyAnswered", "GenerateError", "RunFolderBusy", "SettingsChanged"]


class GenerateError(Exception):
    """Base of every anticipated ``generate`` error; ``exit_code`` says how the CLI exits."""

    exit_code: int = ExitCode.USAGE

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class RunFolderBusy(GenerateError):
    """Another process holds the run folder's lock (``RUN/.lock``)."""

    exit_code = ExitCode.BUSY


class SettingsChanged(GenerateError):
    """Done samples in the run folder were generated with other settings (model, request
    fields, base_url) than this invocation's; ``force_settings`` accepts the mix. The
    message ends with what to do about it from ``generate``; ``what`` is the rest, for a
    caller (``run``) whose ways out are others."""

    exit_code = ExitCode.USAGE

    def __init__(self, what: str):
        self.what = what
        super().__init__(f"{what}. Use a new --out, or --force-settings to keep those answers and send only the rest "
                         "with these settings")


class AlreadyAnswered(GenerateError):
    """New samples send requests, byte for byte, that the run folder already holds answers
    to under other sample ids (a dataset renamed: ids are ``<dataset>-<row id>``): sending
    them would pay for the same answers again. Nothing was sent or stored."""

    exit_code = ExitCode.USAGE
