"""Ctrl-C / SIGTERM and a full disk outside generate: one line, no traceback, nothing partial.

Timing-free: the child stops itself with SIGSTOP at a named point
(``TOKENBRIDGE_TEST_KILL_SIGNAL=SIGSTOP``); the test then queues the signal and resumes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from outputs_support import kill_env, leftovers, start_cli, wait_stopped

from tokenbridge.interrupt import STOPPED


def _interrupt(proc: subprocess.Popen, sig: int, group: bool = False) -> tuple[int, str]:
    """Send ``sig`` to the stopped child (or its whole process group, as a terminal's
    Ctrl-C does), resume it, and return (exit status, stderr)."""
    wait_stopped(proc)
    if group:
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _stopped_cleanly(code: int, err: str) -> None:
    assert code == 130, err
    assert err.strip().splitlines() == [STOPPED], err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_reconstruct_with_a_worker_pool_stops_in_one_line(stage_inputs, kimi_dir, tmp_path, sig):
    out = tmp_path / "r.jsonl"
    proc = start_cli("reconstruct", str(stage_inputs / "exchanges.jsonl"), "-o", str(out), "-t", str(kimi_dir), "-j", "2",
                     env=kill_env("reconstruct:record", 2, "SIGSTOP"), start_new_session=True)
    code, err = _interrupt(proc, sig, group=sig == signal.SIGINT)  # Ctrl-C reaches the workers too
    _stopped_cleanly(code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == [] and leftovers(tmp_path) == []


def test_export_sigterm_keeps_the_previous_export(stage_inputs, tmp_path):
    from outputs_support import snapshot

    from tokenbridge.export import export_file

    out = tmp_path / "sf"
    export_file(stage_inputs / "reconstructed.jsonl", out, "specforge")
    before = snapshot(out)
    proc = start_cli("export", str(stage_inputs / "reconstructed.jsonl"), "-o", str(out), "-f", "parquet", "--force",
                     env=kill_env("export:row", 1, "SIGSTOP"))  # another format: replaced only with --force
    _stopped_cleanly(*_interrupt(proc, signal.SIGTERM))
    assert snapshot(out) == before and leftovers(tmp_path) == []


# --- disk full -----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, nearly full (skipped where this process may not mount one)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        st = os.statvfs(mnt)
        (mnt / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 16 * 1024))
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _one_error_line(res: subprocess.CompletedProcess | tuple[int, str], target: Path) -> None:
    code, err = res
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == f"error: {target}: cannot write (No space left on device); nothing partial was kept"


def _run(*args: str) -> tuple[int, str]:
    proc = start_cli(*args)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def test_reconstruct_on_a_full_disk(stage_inputs, kimi_dir, small_disk):
    out = small_disk / "r.jsonl"
    _one_error_line(_run("reconstruct", str(stage_inputs / "exchanges.jsonl"), "-o", str(out), "-t", str(kimi_dir)), out)
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_export_on_a_full_disk(stage_inputs, small_disk):
    out = small_disk / "sf"
    _one_error_line(_run("export", str(stage_inputs / "reconstructed.jsonl"), "-o", str(out), "-f", "specforge"), out)
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]
