"""The API key echoed back by a hostile server never lands anywhere ``tokenbridge run``
writes or prints: run folder (state.sqlite, generate.json, exchanges, reconstructed,
pipeline.json), every export format, vocab, the report, and the command's output.

test_hostile_api.py checks generate, reconstruct and the conversations export one CLI
call at a time; this walks the whole pipeline, as a user runs it, for each form of the
key (raw, JSON-escaped, URL-encoded, base64, and split across SSE events).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hostile_server import HostileServer, key_leaks
from test_hostile_api import CANARY, _everything_written
from tokenbridge.cli import app


def _config(tmp_path: Path, kimi_dir: Path, url: str, stream: bool) -> Path:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"q{i}"}) + "\n" for i in range(3)), encoding="utf-8")
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
[run]
out = "out"
tokenizer = "{kimi_dir}"

[generate]
base_url = "{url}"
api_key_env = "TB_CANARY"
model = "m"
max_tokens = 16
max_attempts = 1
progress = "none"
stream = {str(stream).lower()}
datasets = [{{ name = "h", path = "{prompts}" }}]

[reconstruct]
severity = {{ usage_prompt_mismatch = "off", usage_completion_mismatch = "off", reasoning_missing = "warning" }}

[export]
formats = ["specforge", "speculators", "parquet", "conversations"]
include_flagged = true

[vocab]
draft_vocab_size = 64

[report]
enabled = true
""", encoding="utf-8")
    return cfg


@pytest.mark.parametrize("form", ["raw", "json_escaped", "url", "base64", "split_sse"])
def test_the_key_is_in_nothing_run_writes_or_prints(tmp_path, kimi_dir, monkeypatch, form):
    monkeypatch.setenv("TB_CANARY", CANARY)
    with HostileServer() as srv:
        srv.plan["q0"] = [f"echo_error:{'raw' if form == 'split_sse' else form}"]  # a failed sample's error text
        srv.plan["q1"] = ["split_key_sse" if form == "split_sse" else f"echo_ok:{form}"]  # a kept answer
        res = CliRunner().invoke(app, ["run", str(_config(tmp_path, kimi_dir, srv.url, form == "split_sse"))])
    out = tmp_path / "out"
    written = _everything_written(tmp_path)
    written["run output"] = (res.output + res.stderr).encode()
    # the pipeline went all the way: the leak search covers every stage's output
    for name in ("state.sqlite", "generate.json", "exchanges.jsonl", "reconstructed.jsonl", "pipeline.json",
                 "export/specforge/train.jsonl", "export/conversations", "export/parquet", "export/speculators",
                 "vocab/d2t.npy", "report/report.html", "report/report.json"):
        assert (out / name).exists(), (name, res.output + res.stderr)
    rows = [json.loads(x) for x in (out / "reconstructed.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["h-1", "h-2"] and "***" in rows[0]["content"]
    leaks = {name: key_leaks(data, CANARY) for name, data in written.items()}
    assert {k: v for k, v in leaks.items() if v} == {}
    assert sum(CANARY[:12] in data.decode("utf-8", "replace") for data in written.values()) == 0
