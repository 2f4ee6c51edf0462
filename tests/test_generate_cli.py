"""``tokenbridge generate``: clear errors (exit 2) before anything is sent."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tokenbridge.cli import app


def _invoke(args, env=None):
    return CliRunner().invoke(app, ["generate", *args], env=env or {})


def test_usage_errors_name_the_problem(tmp_path):
    prompts = tmp_path / "b3.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n", encoding="utf-8")
    out = str(tmp_path / "run")

    res = _invoke([str(tmp_path / "nope.jsonl"), "--out", out, "--model", "m", "--base-url", "http://127.0.0.1:9/v1"])
    assert res.exit_code == 2 and "nope.jsonl does not exist" in res.output

    res = _invoke([str(prompts), "--out", out, "--model", "m", "--base-url", "https://openrouter.ai/api/v1",
                   "--api-key-env", "TB_SURELY_UNSET_KEY"], env={"TB_SURELY_UNSET_KEY": ""})
    assert res.exit_code == 2 and "TB_SURELY_UNSET_KEY is not set" in res.output

    res = _invoke([str(prompts), "--out", out, "--base-url", "http://127.0.0.1:9/v1"])
    assert res.exit_code == 2 and "no model given" in res.output

    cfg = tmp_path / "c.toml"
    cfg.write_text('model = "m"\nconcurency = 3\n', encoding="utf-8")
    res = _invoke([str(prompts), "--out", out, "--config", str(cfg)])
    assert res.exit_code == 2 and "unknown key(s) ['concurency']" in res.output

    res = _invoke([str(prompts), "--out", out, "--model", "m", "--reasoning", "high", "--provider-only", "a,b",
                   "--dry-run"])
    assert res.exit_code == 0 and "samples: 1 (0 already done, 1 to send)" in res.output
    assert "approx." in res.output  # no --tokenizer: character estimate, said so

    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "state.sqlite").write_bytes(b"this is not sqlite" * 100)
    res = _invoke([str(prompts), "--out", str(tmp_path / "run2"), "--model", "m", "--base-url",
                   "http://127.0.0.1:9/v1"])
    assert res.exit_code == 2 and "not a usable tokenbridge state file" in res.output
    assert not (tmp_path / "run").exists()
