"""``tokenbridge generate``: clear errors (exit 2) before anything is sent."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tokenbridge.cli import app
from tokenbridge.emulator import EmulatorConfig, running_emulator


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
    assert res.exit_code == 2 and "c.toml:2: concurency: unknown key; did you mean 'concurrency'?" in res.output

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


def _one_line_error(res, code: int) -> str:
    """The run ended with ``code`` and a single ``error:`` line, no traceback."""
    assert res.exit_code == code, res.output
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


def test_a_second_process_on_the_run_folder_fails_fast(tmp_path):
    from tokenbridge.generate import RunFolderBusy, write_exchanges
    from tokenbridge.generate.lock import run_lock

    prompts = tmp_path / "b3.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    hold = ("import sys, time\nfrom tokenbridge.generate.lock import run_lock\n"
            "with run_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        res = _invoke([str(prompts), "--out", str(run), "--model", "m", "--base-url", "http://127.0.0.1:9/v1",
                       "--max-attempts", "1"])
        line = _one_line_error(res, 7)
        assert f"{run}: run folder in use by pid {holder.pid}" in line
        with pytest.raises(RunFolderBusy):
            write_exchanges(run)
    finally:
        holder.kill()
        holder.wait()
    with run_lock(run):  # a dead holder leaves nothing behind that blocks
        pass


def test_anticipated_errors_are_one_line_with_their_exit_code(tmp_path, kimi, monkeypatch):
    prompts = tmp_path / "b3.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"hi {i}"}) + "\n" for i in range(6)), encoding="utf-8")
    out = str(tmp_path / "run")

    line = _one_line_error(_invoke([str(prompts), "--out", out, "--model", "m", "--base-url", "openrouter.ai/api/v1"]), 2)
    assert "needs http:// or https://" in line
    cfg = tmp_path / "c.toml"
    cfg.write_text('model = "m"\n[headers]\nAuthorization = "Bearer sk-x"\n', encoding="utf-8")
    line = _one_line_error(_invoke([str(prompts), "--out", out, "--config", str(cfg)]), 2)
    assert "look like credentials" in line and "sk-x" not in line
    assert not (tmp_path / "run").exists()

    with running_emulator(EmulatorConfig(min_tokens=5, max_tokens=20), tokenizer=kimi) as url:
        args = [str(prompts), "--out", out, "--model", "moonshotai/kimi-k2.5", "--base-url", url, "--progress", "none",
                "--max-tokens", "50"]
        res = _invoke(args)
        assert res.exit_code == 0, res.output
        line = _one_line_error(_invoke([*args[:-1], "60"]), 2)
        assert "6 with another request (max_tokens 50 -> 60, e.g. b3-0)" in line and "--force-settings" in line
        res = _invoke([*args[:-1], "60", "--force-settings", "--limit", "2"])
        assert res.exit_code == 0 and "(4 other stored samples left out)" in res.output, res.output

        from tokenbridge.generate import store as store_mod

        def full(self):
            self._conn.execute("ROLLBACK")
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(store_mod.Store, "finish", full)
        more = tmp_path / "more.jsonl"
        more.write_text(json.dumps({"id": 1, "prompt": "new"}) + "\n", encoding="utf-8")
        res = _invoke([str(more), *args[1:]])
    assert res.exit_code == 6 and "Traceback" not in res.output, res.output
    assert "note: stopping: store write failed: database or disk is full" in res.output
    assert "stopped: store_error" in res.output
