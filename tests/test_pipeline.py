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
    assert [e["id"] for e in exchanges][:2] == ["chat-001", "chat-002"] and len(exchanges) == 16
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
    assert second["reconstruct"] == "skipped" and second["vocab"] == "skipped" and second["report"] == "skipped"
    assert all(second[f"export:{f}"] == "skipped" for f in ("specforge", "speculators", "parquet", "conversations"))
    assert (out / "reconstructed.jsonl").read_bytes() == before

    shutil.rmtree(out / "export" / "parquet")
    third = {r.name: r.status for r in run_pipeline(cfg, echo=lambda _: None)}
    assert third["export:parquet"] == "ran" and third["export:specforge"] == "skipped" and third["report"] == "skipped"


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
    with pytest.raises(PipelineError, match=r"bad.toml:3: exprot: unknown key; did you mean 'export'\?"):
        load_run_config(bad)
    bad.write_text("[run]\nout = 'o'\n", encoding="utf-8")
    with pytest.raises(PipelineError, match=r"bad.toml:1: run.tokenizer: missing"):
        load_run_config(bad)
    cfg = _config(tmp_path, kimi_dir).read_text().replace("builtin:prompts/plain.jsonl", "builtin:prompts/nope.jsonl")
    bad.write_text(cfg, encoding="utf-8")
    with pytest.raises(PipelineError, match=r"generate.datasets\[1\].path: no such built-in data 'builtin:prompts/nope.jsonl'"):
        load_run_config(bad)


def test_cli_run_prints_where_results_are(tmp_path, kimi_dir):
    res = CliRunner().invoke(app, ["run", str(_config(tmp_path, kimi_dir))])
    assert res.exit_code == 0, res.output
    assert f"results in {tmp_path / 'out'}" in res.output and "report.html" in res.output


def test_emulator_section_without_config_uses_defaults_and_checks_keys(tmp_path, kimi_dir):
    text = _config(tmp_path, kimi_dir).read_text()
    no_cfg = text.replace(f'config = "{ROOT / "examples" / "emulator.toml"}"\n', "")
    path = tmp_path / "nocfg.toml"
    path.write_text(no_cfg, encoding="utf-8")
    results = {r.name: r.status for r in run_pipeline(load_run_config(path), echo=lambda _: None)}
    assert results["reconstruct"] == "ran"
    path.write_text(no_cfg.replace("latency_ms = 0", "latency_ms = 0\nlatencyms = 3"), encoding="utf-8")
    with pytest.raises(PipelineError, match=r"nocfg.toml:8: emulator.latencyms: unknown key; did you mean 'latency_ms'\?"):
        run_pipeline(load_run_config(path), echo=lambda _: None)


def test_no_usable_rows_skips_exports_but_still_reports(tmp_path, kimi_dir):
    emu = tmp_path / "leaky.toml"
    emu.write_text('models = ["moonshotai/kimi-k2.5"]\n[[providers]]\nname = "leaky/int4"\nquantization = "int4"\n'
                   "[providers.quirks]\nend_marker_leak = 1.0\n", encoding="utf-8")
    text = _config(tmp_path, kimi_dir).read_text().replace(str(ROOT / "examples" / "emulator.toml"), str(emu))
    path = tmp_path / "leaky-run.toml"
    path.write_text(text, encoding="utf-8")
    results = {r.name: r.status for r in run_pipeline(load_run_config(path), echo=lambda _: None)}
    rows = _lines(tmp_path / "out" / "reconstructed.jsonl")
    # every stopped sample leaked its end marker; the others were cut by max_tokens (flagged, not exported)
    assert rows and all(r["status"] != "ok" for r in rows)
    assert all("eos_in_text" in [f["code"] for f in r["findings"]] for r in rows if r["finish_reason"] != "length")
    assert results["export:specforge"] == "empty" and results["vocab"] == "empty" and results["report"] == "ran"


def test_cli_run_bad_generate_key_is_one_line(tmp_path, kimi_dir):
    text = _config(tmp_path, kimi_dir).read_text().replace("concurrency = 8", "concurency = 8")
    path = tmp_path / "typo.toml"
    path.write_text(text, encoding="utf-8")
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 2
    assert "typo.toml:12: generate.concurency: unknown key; did you mean 'concurrency'?" in res.output
    assert "Traceback" not in res.output


def test_tokenizer_files_are_part_of_the_fingerprint(tmp_path, kimi_dir):
    from tokenbridge.pipeline import _tokenizer_identity

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tiktoken.model").symlink_to(kimi_dir / "tiktoken.model")
    (folder / "tokenizer_config.json").write_text((kimi_dir / "tokenizer_config.json").read_text())
    before = _tokenizer_identity(str(folder))
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    assert _tokenizer_identity(str(folder)) != before


def test_run_prints_sentences_and_a_resumed_run_says_already_done(tmp_path, kimi_dir):
    cfg = load_run_config(_config(tmp_path, kimi_dir))
    lines: list[str] = []
    run_pipeline(cfg, echo=lines.append)
    first = [x for x in lines if x.startswith("generate: 16")]
    summary = json.loads((tmp_path / "out" / "generate.json").read_text())
    spent, requests = summary["spent_total"], summary["requests"]
    assert requests >= 16
    assert first == [f"generate: 16 samples: 16 done now; {requests} requests, ${spent:.4f} this run, ${spent:.4f} in all."]
    rows = _lines(tmp_path / "out" / "reconstructed.jsonl")
    n = {s: sum(r["status"] == s for r in rows) for s in ("ok", "flagged", "rejected")}
    assert f"reconstruct: ran → {tmp_path / 'out' / 'reconstructed.jsonl'}: {n['ok']} ok, {n['flagged']} flagged, " \
           f"{n['rejected']} rejected" in lines
    lines.clear()
    run_pipeline(cfg, echo=lines.append)
    assert [x for x in lines if x.startswith("generate: 16")] == [
        f"generate: 16 samples: 16 already done; nothing sent, ${spent:.4f} spent in all."]

