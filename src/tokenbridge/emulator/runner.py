"""Starting and stopping the emulator: in a background thread (tests) or in the foreground (CLI)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager, suppress
from pathlib import Path
from collections.abc import Callable, Iterator

from aiohttp import web

from ..tokenizer import Tokenizer, load_tokenizer
from ..tokenizer_source import choose_tokenizer
from .config import EmulatorConfig
from .server import build_app

__all__ = ["running_emulator", "serve"]

_START_TIMEOUT_S = 30.0
_SHUTDOWN_TIMEOUT_S = 1.0


def _resolve_tokenizer(tokenizer: Tokenizer | str | Path | None, config: EmulatorConfig) -> Tokenizer:
    """The given tokenizer, else the config's, else ``$TOKENBRIDGE_TOKENIZER``
    (:class:`~tokenbridge.tokenizer_source.NoTokenizerError` when none names one)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    return load_tokenizer(choose_tokenizer(tokenizer, config.tokenizer, flag="tokenizer=",
                                           config="the emulator config"))


@contextmanager
def running_emulator(
    config: EmulatorConfig | None = None,
    tokenizer: Tokenizer | str | Path | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
) -> Iterator[str]:
    """Run the emulator on a background thread with its own event loop.

    Yields the base URL (``http://127.0.0.1:PORT/api/v1``); port 0 picks a free port.
    On exit in-flight requests get about a second, then the server and thread stop.
    """
    config = config or EmulatorConfig()
    app = build_app(config, _resolve_tokenizer(tokenizer, config))
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, object] = {}

    async def main() -> None:
        stop = asyncio.Event()
        box["stop"] = stop
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
        try:
            await runner.setup()
            site = web.TCPSite(runner, host, port)
            await site.start()
            box["port"] = runner.addresses[0][1]
        except BaseException as exc:  # reported to the caller's thread
            box["error"] = exc
            started.set()
            await runner.cleanup()
            return
        started.set()
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), name="tokenbridge-emulator", daemon=True)
    thread.start()
    if not started.wait(_START_TIMEOUT_S):
        raise RuntimeError("the emulator did not start in time")
    if "error" in box:
        thread.join(5)
        loop.close()
        error = box["error"]
        raise RuntimeError(f"the emulator could not listen on {host}:{port}: {error}") from error  # type: ignore[misc]  # main() put a BaseException there
    try:
        yield f"http://{host}:{box['port']}/api/v1"
    finally:
        stop = box["stop"]  # main() puts its Event there before it sets `started`
        if isinstance(stop, asyncio.Event):
            loop.call_soon_threadsafe(stop.set)
        thread.join(_SHUTDOWN_TIMEOUT_S + 10)
        if not thread.is_alive():
            loop.close()


def serve(
    config: EmulatorConfig,
    tokenizer: Tokenizer | str | Path | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    announce: Callable[[str], None] = print,
) -> None:
    """Run the emulator in the foreground until interrupted (the CLI's ``emulator`` command)."""
    app = build_app(config, _resolve_tokenizer(tokenizer, config))

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            bound = runner.addresses[0][1]
            announce(f"tokenbridge emulator listening on http://{host}:{bound}/api/v1 (Ctrl-C to stop)")
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with suppress(KeyboardInterrupt):
        asyncio.run(main())
