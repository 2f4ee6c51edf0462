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
