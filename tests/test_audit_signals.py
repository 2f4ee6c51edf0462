"""Ctrl-C in ``vocab`` and ``report`` (issue 12: one line at every stage; test_stage_signals
covers reconstruct and export): exit 130, exactly the one stop line, the previous output
kept byte for byte, no temp file. Timing-free: the child stops itself (SIGSTOP) at its
commit point, then gets the signal."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from outputs_support import kill_env, leftovers, snapshot, start_cli, wait_stopped
from test_export_support import make_run, write_jsonl
from tokenbridge.export import build_vocab
from tokenbridge.interrupt import STOPPED
from tokenbridge.report import build_report


@pytest.fixture(scope="module")
def rows_file(kimi, tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("sig") / "reconstructed.jsonl", make_run(kimi, 8)[1])


def _stop(proc, sig: int) -> tuple[int, str]:
    wait_stopped(proc)
    os.kill(proc.pid, sig)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_vocab_stopped_keeps_the_previous_vocab(rows_file, tmp_path, sig):
    out = tmp_path / "vocab"
    build_vocab(rows_file, 64, out, 163840)
    before = snapshot(out)
    proc = start_cli("vocab", str(rows_file), "-n", "256", "-o", str(out), "--target-vocab-size", "163840",
                     env=kill_env("vocab:written", 1, "SIGSTOP"))
    code, err = _stop(proc, sig)
    assert (code, err.strip().splitlines()) == (130, [STOPPED]), err
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_report_stopped_keeps_the_previous_report(rows_file, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(rows_file, run / "reconstructed.jsonl")
    build_report(run)
    before = snapshot(run / "report")
    proc = start_cli("report", str(run), env=kill_env("report:written", 1, "SIGSTOP"))
    code, err = _stop(proc, signal.SIGINT)
    assert (code, err.strip().splitlines()) == (130, [STOPPED]), err
    assert snapshot(run / "report") == before and leftovers(tmp_path) == []
