"""The README's examples run as written (the binary path, port and output folder swapped)."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys

import pytest

from conftest import ROOT

# finds a free port, then starts the README's server on it: run alone, after the rest of the
# suite runs on every core (`make test`), so no other test's server takes the port in between
pytestmark = pytest.mark.serial


def _commands(section: str) -> list[list[str]]:
    """The ``.venv/bin/tokenbridge`` commands of the first bash block after ``section``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text[text.index(section):], flags=re.S).group(1)
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split("#")[0].strip() for line in joined.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith(".venv/bin/tokenbridge ")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_emulator_example_generates_the_bundled_prompts(tmp_path, kimi_dir):
    serve, generate = _commands("## The emulator")
    port = str(_free_port())
    cli = [sys.executable, "-m", "tokenbridge.cli"]

    def swap(args: list[str]) -> list[str]:
        out = [a.replace("8000", port) for a in args[1:]]
        return cli + [str(tmp_path / "dry") if a == "runs/dry" else a for a in out]

    server = subprocess.Popen(swap(serve), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = server.stdout.readline()  # blocks until it listens (or exits)
        assert f"listening on http://127.0.0.1:{port}/api/v1" in first, first
        res = subprocess.run(swap(generate) + ["--progress", "none"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    ids = [json.loads(x)["id"] for x in (tmp_path / "dry" / "exchanges.jsonl").read_text().splitlines()]
    rows = (ROOT / "src/tokenbridge/data/prompts/chat.jsonl").read_text().splitlines()
    assert ids == [json.loads(r)["id"] for r in rows]


def test_every_finding_code_is_in_the_readmes_table_with_its_severity():
    """A code the gate raises but the README never explains leaves a user guessing (a cold
    tester found ``end_token_mismatch`` missing)."""
    from tokenbridge.checks import CODES

    table = {}
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if line.startswith("| `") and len(cells) >= 3:
            for code in re.findall(r"`([a-z_]+)`", cells[0]):
                table[code] = cells[1]
    assert {code: table.get(code) for code in CODES} == {code: sev for code, (sev, _) in CODES.items()}
