"""tokenbridge run: every stage on the built-in emulator, offline; reruns skip what is done."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokenbridge.cli import app
from tokenbridge.pipeline import PipelineError, load_run_config, run_pipeline

ROOT = Path(__file__).resolve().parents[1]


def _config(tmp_path: Path, kimi_dir: Path, extra: str = "") -> Path:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f"""
[run]
out = "out"
tokenizer = "{kimi_dir}"

[emulator]
config = "{ROOT / 'examples' / 'emulator.toml'}"
latency_ms = 0

[generate]
model = "moonshotai/kimi-k2.5"
concurrency = 8
max_tokens = 1024
progress = "none"
extra_body = {{ return_token_ids = true }}
datasets = [
  {{ name = "chat", path = "builtin:prompts/chat.jsonl", limit = 12 }},
  {{ name = "plain", path = "builtin:prompts/plain.jsonl", limit = 4 }},
]

[vocab]
draft_vocab_size = 512
{extra}
""",
        encoding="utf-8",
    )
    return cfg


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_run_end_to_end_then_rerun_skips(tmp_path, kimi_dir):
    cfg = load_run_config(_config(tmp_path, kimi_dir))
    first = {r.name: r.status for r in run_pipeline(cfg, echo=lambda _: None)}
    assert first == {"generate": "ran", "reconstruct": "ran", "export:specforge": "ran", "export:speculators": "ran",
                     "export:parquet": "ran", "export:conversations": "ran", "vocab": "ran", "report": "ran"}
    out = tmp_path / "out"
    exchanges = _lines(out / "exchanges.jsonl")
    assert [e["id"] for e in exchanges][:2] == ["chat-chat-001", "chat-chat-002"] and len(exchanges) == 16
    rows = _lines(out / "reconstructed.jsonl")
    assert len(rows) == 16
    # the emulator returned native ids, so every ok row is proven against ground truth
    for row, ex in zip(rows, exchanges):
        if row["status"] == "ok":
            assert row["completion_ids"] == ex["response"]["choices"][0]["token_ids"]
            assert row["prompt_ids"] == ex["response"]["prompt_token_ids"]
    assert (out / "report" / "report.html").is_file() and (out / "vocab").is_dir()
    before = (out / "reconstructed.jsonl").read_bytes()

    second = {r.name: r.status for r in run_pipeline(cfg, echo=lambda _: None)}
    assert second["reconstruct"] == "skipped" and second["vocab"] == "skipped"
    assert all(second[f"export:{f}"] == "skipped" for f in ("specforge", "speculators", "parquet", "conversations"))
    assert (out / "reconstructed.jsonl").read_bytes() == before

    shutil.rmtree(out / "export" / "parquet")
    third = {r.name: r.status for r in run_pipeline(cfg, echo=lambda _: None)}
    assert third["export:parquet"] == "ran" and third["export:specforge"] == "skipped"


def test_policy_change_reruns_reconstruct(tmp_path, kimi_dir):
    cfg = load_run_config(_config(tmp_path, kimi_dir))
    run_pipeline(cfg, echo=lambda _: None)
    strict = load_run_config(_config(tmp_path, kimi_dir, '[reconstruct]\nseverity = { truncated = "error" }\n'))
    res = {r.name: r.status for r in run_pipeline(strict, echo=lambda _: None)}
    assert res["reconstruct"] == "ran"
    rows = _lines(tmp_path / "out" / "reconstructed.jsonl")
    assert all(r["status"] == "rejected" for r in rows if r["finish_reason"] == "length")


def test_config_errors_name_the_key(tmp_path, kimi_dir):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\ntokenizer = 'x'\n[exprot]\n", encoding="utf-8")
    with pytest.raises(PipelineError, match=r"bad.toml: unknown section\(s\) \['exprot'\]"):
        load_run_config(bad)
    bad.write_text("[run]\nout = 'o'\n", encoding="utf-8")
    with pytest.raises(PipelineError, match=r"\[run\] tokenizer: missing"):
        load_run_config(bad)
    cfg = _config(tmp_path, kimi_dir).read_text().replace("builtin:prompts/plain.jsonl", "builtin:prompts/nope.jsonl")
    bad.write_text(cfg, encoding="utf-8")
    with pytest.raises(PipelineError, match="builtin:prompts/nope.jsonl: no such built-in data"):
        load_run_config(bad)


def test_cli_run_prints_where_results_are(tmp_path, kimi_dir):
    res = CliRunner().invoke(app, ["run", str(_config(tmp_path, kimi_dir))])
    assert res.exit_code == 0, res.output
    assert f"results in {tmp_path / 'out'}" in res.output and "report.html" in res.output
