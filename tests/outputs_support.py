"""Shared helpers for the output-safety, kill and signal tests (no tests here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import tokenbridge
from tokenbridge.fsio import is_temp_name

#: Children import the same tokenbridge as this test process.
SRC = str(Path(tokenbridge.__file__).resolve().parents[1])
#: Names a half-written output used to have (before tokenbridge.fsio) or has now.
_TEMP_HINTS = (".partial", ".tmp", ".tbtmp", ".tbold")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes), to compare byte for byte;
    the run folder's lock file (``.lock``, the holder's pid) is not data and is left out."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"
    }


def leftovers(folder: Path) -> list[str]:
    """Temp files or folders anywhere under ``folder``: ours and the old fixed names."""
    return sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*")
        if is_temp_name(p.name) or any(h in p.name for h in _TEMP_HINTS)
    )


#: Runs the CLI as if torch were not installed (vocab then skips its .pt files): the
#: kill tests need no torch, and importing it costs seconds per child process.
_NO_TORCH = "import sys; sys.modules['torch'] = None; from tokenbridge.cli import main; sys.argv[0] = 'tokenbridge'; main()"


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
        no_torch: bool = False) -> subprocess.CompletedProcess:
    """``python -m tokenbridge.cli ARGS`` in a child process (so it may be killed)."""
    full = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    head = ["-c", _NO_TORCH] if no_torch else ["-m", "tokenbridge.cli"]
    return subprocess.run([sys.executable, *head, *args], capture_output=True, text=True,
                          env=full, cwd=cwd, timeout=300)


def start_cli(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "tokenbridge.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full, **kw)


def wait_stopped(proc: subprocess.Popen, limit_s: float = 120.0) -> None:
    """Wait (bounded) until ``proc`` is stopped by SIGSTOP (state ``T`` in /proc)."""
    deadline = time.monotonic() + limit_s
    stat = Path(f"/proc/{proc.pid}/stat")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before stopping: {proc.stderr.read()}")
        if stat.read_text().rpartition(")")[2].split()[0] == "T":
            return
        time.sleep(0.02)
    raise AssertionError("never stopped at the test point")


def kill_env(point: str, nth: int = 1, sig: str = "SIGKILL") -> dict[str, str]:
    return {"TOKENBRIDGE_TEST_KILL_AT": f"{point}:{nth}", "TOKENBRIDGE_TEST_KILL_SIGNAL": sig}
