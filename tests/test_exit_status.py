"""Exit statuses as ``tokenbridge.exit_codes`` defines them: a bad row is bad data (1), not a usage error (2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from test_export_support import make_run, write_jsonl
from tokenbridge.cli import app
from tokenbridge.exit_codes import ExitCode
from tokenbridge.export import ExportError, export_file

ROOT = Path(__file__).resolve().parents[1]


def _break_first_ok_row(path: Path) -> int:
    """Give the first ok row a warning (its status then contradicts its findings); returns its line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        row = json.loads(line)
        if row["status"] == "ok":
            row["findings"] = [{"code": "truncated", "severity": "warning", "message": "planted"}]
            lines[n - 1] = json.dumps(row)
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            return n
    raise AssertionError("no ok row")


def test_a_bad_row_carries_exit_status_1(kimi, tmp_path):
    src = tmp_path / "rows.jsonl"
    write_jsonl(src, make_run(kimi, 6)[1])
    line = _break_first_ok_row(src)
    with pytest.raises(ExportError, match=rf"rows.jsonl:{line}: status: ") as info:
        export_file(src, tmp_path / "out", "specforge")
    assert info.value.exit_code == ExitCode.INCOMPLETE == 1
    assert not (tmp_path / "out").exists()


def test_export_command_exits_1_on_a_bad_row(kimi, tmp_path):
    src = tmp_path / "rows.jsonl"
    write_jsonl(src, make_run(kimi, 6)[1])
    line = _break_first_ok_row(src)
    res = CliRunner().invoke(app, ["export", str(src), "-o", str(tmp_path / "out"), "--format", "specforge"])
    assert f"rows.jsonl:{line}: status: " in res.output and "Traceback" not in res.output
    assert res.exit_code == 1


def test_run_exits_1_on_a_bad_row(tmp_path, kimi_dir):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
[run]
out = "out"
tokenizer = "{kimi_dir}"

[emulator]
config = "{ROOT / 'examples' / 'emulator.toml'}"
latency_ms = 0

[generate]
model = "moonshotai/kimi-k2.5"
concurrency = 4
max_tokens = 256
progress = "none"
datasets = [{{ name = "chat", path = "builtin:prompts/chat.jsonl", limit = 6 }}]

[export]
formats = ["specforge"]
""", encoding="utf-8")
    first = CliRunner().invoke(app, ["run", str(cfg)])
    assert first.exit_code == 0, first.output
    line = _break_first_ok_row(tmp_path / "out" / "reconstructed.jsonl")
    res = CliRunner().invoke(app, ["run", str(cfg)])
    errors = [x for x in res.output.splitlines() if x.startswith("error: ")]
    assert errors == [next(x for x in errors if f"reconstructed.jsonl:{line}: status: " in x)], res.output
    assert res.exit_code == 1 and "Traceback" not in res.output
