"""The command line's own options: --version, -h on the app and on every command."""

from __future__ import annotations

import re
import tomllib

import pytest
from typer.testing import CliRunner

from conftest import ROOT
from tokenbridge import __version__
from tokenbridge.cli import app

COMMANDS = ["reconstruct", "inspect", "generate", "probe", "emulator", "export", "vocab", "report", "run"]


def test_version_prints_the_package_version():
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0
    assert res.output == f"tokenbridge {__version__}\n"
    assert __version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_short_help_on_the_app_lists_every_command():
    res = CliRunner().invoke(app, ["-h"])
    assert res.exit_code == 0
    assert all(re.search(rf"^  {c}\s", res.output, re.M) for c in COMMANDS), res.output


@pytest.mark.parametrize("command", COMMANDS)
def test_short_help_on_each_command(command):
    res = CliRunner().invoke(app, [command, "-h"])
    assert res.exit_code == 0, res.output
    assert f" {command} [OPTIONS]" in res.output


def test_an_interrupt_after_the_outputs_are_published_is_said_in_one_line(stage_inputs, tmp_path, monkeypatch):
    """Ctrl-C landing after a stage's own handling (while its summary prints) exited 130
    without a word (typer's own handling): now the same line as everywhere else."""
    import tokenbridge.cli as cli
    from tokenbridge.interrupt import STOPPED

    said = cli._say

    def interrupted(text, **kw):
        if "→" in text:  # the success line: the export is published by now
            raise KeyboardInterrupt
        return said(text, **kw)

    monkeypatch.setattr(cli, "_say", interrupted)
    out = tmp_path / "sf"
    res = CliRunner().invoke(app, ["export", str(stage_inputs / "reconstructed.jsonl"), "-o", str(out), "-f", "specforge"])
    assert res.exit_code == 130 and res.output.strip().splitlines() == [STOPPED], res.output
    assert (out / "train.jsonl").is_file()  # published whole before the interrupt, and kept


@pytest.mark.parametrize("kind", ["device", "fifo"])
@pytest.mark.parametrize("command", [["export", "-f", "specforge"], ["vocab", "-n", "10", "--target-vocab-size", "1000"]])
def test_a_rows_input_that_is_no_file_is_a_usage_error_saying_what_it_is(tmp_path, kind, command):
    """``export /dev/null`` said "no such file", exit 1 (bad data): the file exists, and the
    argument is what is wrong (a cold tester)."""
    import os

    if kind == "fifo":
        src = tmp_path / "pipe"
        os.mkfifo(src)
        what = "a named pipe (FIFO)"
    else:
        src, what = "/dev/null", "a character device"
    res = CliRunner().invoke(app, [command[0], str(src), "-o", str(tmp_path / "out"), *command[1:]])
    assert res.exit_code == 2, res.output
    assert res.output.splitlines()[-1] == (f"error: {src}: <file>: is {what}, not a regular file: give a reconstruct "
                                           "output (JSONL or .parquet)")
    assert not (tmp_path / "out").exists()


def test_a_ctrl_c_while_the_cli_is_still_importing_is_one_line():
    """The console script imports the CLI (typer, click) before any handler of ours exists:
    a Ctrl-C in that first half second printed a traceback out of importlib (a cold
    tester's). Timing-free: the child sends itself SIGINT when the import reaches typer."""
    import subprocess
    import sys

    from tokenbridge.interrupt import STOPPED

    code = ("import importlib.abc, os, signal, sys\n"
            "class Interrupt(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'typer':\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "        return None\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "sys.argv = ['tokenbridge', '--help']\n"
            "from tokenbridge.__main__ import main\n"
            "main()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (130, "", f"{STOPPED}\n")
    # and the script the package installs is that entry point
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"tokenbridge": "tokenbridge.__main__:main"}
