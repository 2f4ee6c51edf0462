"""Done-when tests against the emulator: kill -9 + resume, 30% faults, 402 + rerun,
streamed == non-streamed, the fake key found nowhere, and the dry-run estimate."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from typer.testing import CliRunner

from conftest import ROOT
from tokenbridge.cli import app
from tokenbridge.emulator import EmulatorConfig, running_emulator, sample_key
from tokenbridge.generate import GenerateSettings, RequestSettings, Store, generate_run
from tokenbridge.generate.classify import classify_response
from tokenbridge.generate.run import ExitCode
from tokenbridge.generate.secrets import ApiKey
from tokenbridge.generate.settings import DatasetSpec

# asserts on the wall clock or on timings (sleeps, rates, deadlines): run alone, after the
# rest of the suite runs on every core (`make test`), so a busy machine cannot fail them
pytestmark = pytest.mark.serial

FAKE_KEY = "sk-or-v1-TOKENBRIDGE-FAKE-KEY-5f3a9c1e7b2d4086"
MODEL = "moonshotai/kimi-k2.5"
# Fields that legitimately differ between two runs of the same prompts: the provider's
# generation id and timestamp, and our own timing / transport notes.
VOLATILE_RESPONSE = ("id", "created")
VOLATILE_META = ("latency_s", "started_at", "finished_at", "stream", "attempts")


def _emu(**kw) -> EmulatorConfig:
    base = dict(min_tokens=20, max_tokens=120, retry_after_s=0, slow_s=0.05)
    base.update(kw)
    return EmulatorConfig(**base)


def _write_prompts(path: Path, n: int) -> Path:
    tools = json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}])
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            if i % 5 == 0:
                row = {"id": f"t{i}", "messages": [
                    {"role": "system", "content": f"You can call these tools:\n{tools}"},
                    {"role": "user", "content": f"Weather in city {i}?"}]}
            elif i % 5 == 1:
                row = {"conversations": [{"from": "human", "value": f"第{i}个问题：长城有多长？"},
                                         {"from": "gpt", "value": "很长。"},
                                         {"from": "human", "value": "具体一点。"}]}
            else:
                row = {"id": i, "prompt": f"Explain idea number {i} briefly.", "system": "Be concise."}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def _exchanges(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "exchanges.jsonl").read_text(encoding="utf-8").splitlines()]


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/api/v1") + "/stats", timeout=10) as r:
        return json.loads(r.read())


def _admin(url: str, path: str, body: dict) -> None:
    req = urllib.request.Request(url.removesuffix("/api/v1") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=10).read()


def _done_count(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            return con.execute("SELECT COUNT(*) FROM samples WHERE status='done'").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def _expected_ids(prompts: Path) -> list[str]:
    from tokenbridge.generate.prompts import load_prompts

    return [s.id for s in load_prompts([DatasetSpec("b3", prompts)]).samples]


async def _fresh_responses(url: str, requests: list[dict]) -> list[dict]:
    """Ask the emulator again for each stored request (it is deterministic per request)."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {FAKE_KEY}"}) as s:
        sem = asyncio.Semaphore(16)

        async def one(req):
            async with sem:
                for _ in range(50):
                    async with s.post(url + "/chat/completions", json=req) as r:
                        outcome, body = classify_response(r.status, r.headers, await r.read())
                    if outcome.kind == "ok":
                        return body

        return await asyncio.gather(*(one(r) for r in requests))


def _strip(resp: dict) -> dict:
    return {k: v for k, v in resp.items() if k not in VOLATILE_RESPONSE}


def _grep_key(folder: Path, *texts: str) -> list[str]:
    hits = [str(p) for p in folder.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    return hits + [f"text[{i}]" for i, t in enumerate(texts) if FAKE_KEY in t]


def test_kill_9_at_any_moment_then_rerun_gives_every_prompt_exactly_once(tmp_path, kimi):
    prompts = _write_prompts(tmp_path / "b3.jsonl", 300)
    run = tmp_path / "run"
    db = run / "state.sqlite"
    with running_emulator(_emu(latency_ms=40, fault_rate=0.1, api_key=FAKE_KEY), tokenizer=kimi) as url:
        cmd = [sys.executable, "-m", "tokenbridge.cli", "generate", f"b3={prompts}", "--out", str(run),
               "--base-url", url, "--model", MODEL, "--concurrency", "8", "--max-attempts", "8",
               "--max-tokens", "200", "--progress", "plain"]
        env = {**os.environ, "OPENROUTER_API_KEY": FAKE_KEY, "PYTHONPATH": str(ROOT / "src")}
        outputs = []

        def start():
            return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        # kill 1: at a random early moment (maybe before the store exists, maybe mid-commit)
        p = start()
        time.sleep(random.uniform(0.3, 1.5))
        p.send_signal(signal.SIGKILL)
        outputs += p.communicate(timeout=30)
        # kill 2: certainly mid-run, with responses committed and requests in flight
        p = start()
        deadline = time.monotonic() + 60
        while _done_count(db) < 120 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.02)
        assert p.poll() is None, "the run finished before it could be killed"
        p.send_signal(signal.SIGKILL)
        outputs += p.communicate(timeout=30)
        killed_at = _done_count(db)
        assert 0 < killed_at < 300
        with Store.open(run) as store:
            stored = {s.id: json.loads(s.request)["messages"] for s in store.samples(status="done")}
        sent_before = _stats(url)["by_key"]
        # rerun the same command to completion
        p = start()
        out, err = p.communicate(timeout=120)
        outputs += [out, err]
        assert p.returncode == 0, err
        assert "resuming:" in err
        assert out.splitlines()[0].startswith("[generate] ") and " req/s, " in out  # plain lines: not a TTY

        sent_after = _stats(url)["by_key"]
        for messages in stored.values():  # stored before the kill: never sent again
            assert sent_after[sample_key(messages)] == sent_before[sample_key(messages)]
        rows = _exchanges(run)
        ids = [r["id"] for r in rows]
        assert ids == _expected_ids(prompts)  # every prompt exactly once, in input order
        with Store.open(run) as store:
            for r in rows:
                body, _ = store.response(r["id"])
                assert json.loads(body) == r["response"]  # exchanges carry the stored body
        # ...and the stored body is what the emulator sends for that request
        fresh = asyncio.run(_fresh_responses(url, [r["request"] for r in rows]))
        for r, f in zip(rows, fresh):
            assert _strip(r["response"]) == _strip(f), r["id"]
        ok = _stats(url)["ok_by_key"]
        paid_twice = sum(v - 1 for v in ok.values() if v > 1) - len(rows)  # the re-asks above count once each
        # paid twice = in flight (or received, not yet committed) at the two kills
        assert paid_twice <= 2 * (8 + 2)
        print(f"killed at {killed_at} done; responses paid twice: {paid_twice}")
    assert _grep_key(run, *outputs) == []


@pytest.mark.parametrize("stream", [False, True])
def test_30_percent_faults_every_sample_done_or_failed_with_reason(tmp_path, kimi, stream):
    prompts = _write_prompts(tmp_path / "b3.jsonl", 200)
    with running_emulator(_emu(fault_rate=0.3), tokenizer=kimi) as url:
        settings = GenerateSettings(
            datasets=(DatasetSpec("b3", prompts),), request=RequestSettings(model=MODEL, max_tokens=200),
            base_url=url, concurrency=32, max_attempts=2, stream=stream, backoff_base_s=0.01, backoff_max_s=0.02,
            progress="none",
        )
        summary = generate_run(settings, tmp_path / "run", key=ApiKey("X", FAKE_KEY))
    assert summary.done + summary.failed == 200 and summary.pending == 0
    assert summary.failed > 0 and summary.exit_code == ExitCode.INCOMPLETE  # 2 attempts: ~9% fail twice
    assert sum(summary.errors.values()) >= 60
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    failed = con.execute("SELECT id, error_class, error, attempts FROM samples WHERE status='failed'").fetchall()
    assert len(failed) == summary.failed
    for sid, cls, err, attempts in failed:
        assert cls and err.startswith("gave up after 2 attempts: ") and attempts == 2
        classes = [c for (c,) in con.execute("SELECT error_class FROM attempts WHERE sample_id=? ORDER BY n", (sid,))]
        assert len(classes) == 2 and all(classes)
    rows = _exchanges(tmp_path / "run")
    assert len(rows) == summary.done and len({r["id"] for r in rows}) == summary.done
    assert all(c["finish_reason"] != "error" for r in rows for c in r["response"]["choices"])


def test_402_stops_cleanly_with_its_exit_code_and_a_rerun_finishes(tmp_path, kimi):
    prompts = _write_prompts(tmp_path / "b3.jsonl", 120)
    run = tmp_path / "run"
    with running_emulator(_emu(credits_usd=0.004, api_key=FAKE_KEY), tokenizer=kimi) as url:
        args = ["generate", f"b3={prompts}", "--out", str(run), "--base-url", url, "--model", MODEL,
                "--concurrency", "4", "--max-tokens", "200", "--progress", "none"]
        env = {"OPENROUTER_API_KEY": FAKE_KEY}
        res = CliRunner().invoke(app, args, env=env)
        assert res.exit_code == ExitCode.PAYMENT, res.output
        assert "stopped: payment_required" in res.output
        first = _exchanges(run)
        assert 0 < len(first) < 120
        with Store.open(run) as store:
            counts = store.status_counts()
        assert counts == {"done": len(first), "pending": 120 - len(first)}  # nothing marked failed

        _admin(url, "/admin/credits", {"credits_usd": None})
        _admin(url, "/admin/reset", {})
        res = CliRunner().invoke(app, args, env=env)
        assert res.exit_code == ExitCode.OK, res.output
        rows = _exchanges(run)
        assert [r["id"] for r in rows] == _expected_ids(prompts)
        final = {r["id"]: r for r in rows}
        assert all(final[r["id"]] == r for r in first)  # what the first run stored is kept as it was
        sent_again = _stats(url)["by_key"]
        assert sum(sent_again.values()) == 120 - len(first)  # the done ones were not sent again
    assert _grep_key(run, res.output) == []


def test_streamed_and_non_streamed_runs_give_identical_exchanges(tmp_path, kimi):
    prompts = _write_prompts(tmp_path / "b3.jsonl", 60)
    runs = {}
    with running_emulator(_emu(), tokenizer=kimi) as url:
        for stream in (False, True):
            settings = GenerateSettings(
                datasets=(DatasetSpec("b3", prompts),),
                request=RequestSettings(model=MODEL, max_tokens=200, n=2, seed=11,
                                        extra_body={"return_token_ids": True}),
                base_url=url, concurrency=16, stream=stream, progress="none",
            )
            summary = generate_run(settings, tmp_path / f"run-{stream}", key=ApiKey("X", FAKE_KEY))
            assert summary.exit_code == ExitCode.OK
            runs[stream] = _exchanges(tmp_path / f"run-{stream}")
    plain, streamed = runs[False], runs[True]
    assert len(plain) == len(streamed) == 60
    raw_tool_calls = 0
    for a, b in zip(plain, streamed):
        assert a["meta"]["stream"] is False and b["meta"]["stream"] is True
        for rec in (a, b):
            for k in VOLATILE_RESPONSE:
                rec["response"].pop(k)
            for k in VOLATILE_META:
                rec["meta"].pop(k)
        assert a == b, a["id"]
        assert len(a["response"]["choices"]) == 2 and a["response"]["choices"][0]["token_ids"]
        raw_tool_calls += any("<|tool_calls_section_begin|>" in (c["message"]["content"] or "")
                              for c in a["response"]["choices"])
    assert raw_tool_calls > 0  # tools described in the system text came back as raw marker text


def test_dry_run_counts_prompt_tokens_like_the_server(tmp_path, kimi, kimi_dir):
    prompts = _write_prompts(tmp_path / "b3.jsonl", 40)
    cfg = tmp_path / "gen.toml"
    cfg.write_text(f'model = "{MODEL}"\n[request]\nmax_tokens = 1000\n[prices]\nprompt = 0.6\ncompletion = 2.5\n',
                   encoding="utf-8")
    res = CliRunner().invoke(app, ["generate", f"b3={prompts}", "--out", str(tmp_path / "run"), "--config", str(cfg),
                                   "--dry-run", "--tokenizer", str(kimi_dir),
                                   "--summary-json", str(tmp_path / "dry.json")])
    assert res.exit_code == 0, res.output
    dry = json.loads((tmp_path / "dry.json").read_text())
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    with running_emulator(_emu(), tokenizer=kimi) as url:
        settings = GenerateSettings(datasets=(DatasetSpec("b3", prompts),), request=RequestSettings(model=MODEL),
                                    base_url=url, progress="none")
        summary = generate_run(settings, tmp_path / "run", key=None)
    assert dry["approximate"] is False and dry["to_send"] == 40
    assert dry["prompt_tokens"] == summary.prompt_tokens  # our render+encode == the server's usage
    assert dry["cost_prompt"] == pytest.approx(summary.prompt_tokens * 0.6 / 1e6)
    assert dry["cost_max"] == pytest.approx(dry["cost_prompt"] + 40 * 1000 * 2.5 / 1e6)
    assert "prompt tokens to send:" in res.output


def test_sigterm_stops_sending_keeps_what_arrived_and_exits_130(tmp_path, kimi):
    prompts = _write_prompts(tmp_path / "b3.jsonl", 200)
    run = tmp_path / "run"
    with running_emulator(_emu(latency_ms=60, api_key=FAKE_KEY), tokenizer=kimi) as url:
        cmd = [sys.executable, "-m", "tokenbridge.cli", "generate", f"b3={prompts}", "--out", str(run),
               "--base-url", url, "--model", MODEL, "--concurrency", "4", "--api-key-env", "TB_OTHER_KEY_VAR",
               "--progress", "none"]
        env = {**os.environ, "TB_OTHER_KEY_VAR": FAKE_KEY, "PYTHONPATH": str(ROOT / "src")}
        env.pop("OPENROUTER_API_KEY", None)
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while _done_count(run / "state.sqlite") < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
        sent = _stats(url)["total"]
    assert p.returncode == ExitCode.INTERRUPTED, err
    assert "stopped: interrupted" in err
    rows = _exchanges(run)
    with Store.open(run) as store:
        counts = store.status_counts()
    assert counts["done"] == len(rows) and counts["pending"] == 200 - len(rows)
    assert 20 <= len(rows) <= sent <= len(rows) + 4  # what was in flight finished and was stored
    assert _grep_key(run, out, err) == []


def test_folder_made_with_doubled_ids_resumes_without_sending_again(tmp_path, kimi, monkeypatch):
    """Folders from before the prefix fix hold ``b3-b3-1``: resuming one re-sends (and bills) nothing."""
    from tokenbridge.generate import prompts as prompts_module

    path = tmp_path / "b3.jsonl"
    path.write_text("".join(json.dumps({"id": f"b3-{i}", "prompt": f"Question {i}?"}) + "\n" for i in range(6)))
    with running_emulator(_emu(), tokenizer=kimi) as url:
        settings = GenerateSettings(datasets=(DatasetSpec("b3", path),), request=RequestSettings(model=MODEL),
                                    base_url=url, progress="none")
        with monkeypatch.context() as m:  # the id rule before the fix
            m.setattr(prompts_module, "sample_id", lambda dataset, rid: f"{dataset}-{rid}")
            first = generate_run(settings, tmp_path / "old", key=None)
        again = generate_run(settings, tmp_path / "old", key=None)
        fresh = generate_run(settings, tmp_path / "new", key=None)
    assert first.done == 6 and [e["id"] for e in _exchanges(tmp_path / "old")][0] == "b3-b3-0"
    assert (again.requests, again.already_done, again.left_out) == (0, 6, 0)
    assert [e["id"] for e in _exchanges(tmp_path / "old")] == [f"b3-b3-{i}" for i in range(6)]
    assert [e["id"] for e in _exchanges(tmp_path / "new")] == [f"b3-{i}" for i in range(6)] and fresh.done == 6


def test_exchanges_have_the_output_mode_whatever_the_umask(tmp_path, kimi):
    """exchanges.jsonl holds the same data as reconstructed.jsonl: the same mode (0644)."""
    from tokenbridge.fsio import FILE_MODE

    prompts = _write_prompts(tmp_path / "b3.jsonl", 3)
    old = os.umask(0o077)
    try:
        with running_emulator(_emu(), tokenizer=kimi) as url:
            settings = GenerateSettings(datasets=(DatasetSpec("b3", prompts),), request=RequestSettings(model=MODEL),
                                        base_url=url, concurrency=2, progress="none")
            assert generate_run(settings, tmp_path / "run", key=ApiKey("X", FAKE_KEY)).exit_code == ExitCode.OK
    finally:
        os.umask(old)
    assert (tmp_path / "run" / "exchanges.jsonl").stat().st_mode & 0o777 == FILE_MODE


def test_sending_raises_the_collectors_thresholds_and_puts_them_back(tmp_path, kimi, monkeypatch):
    """While requests are in flight the cyclic collector runs at raised thresholds (each at
    least the engine's, a user's higher one kept); after the run, and after a run that
    fails, they are what they were."""
    import gc

    from tokenbridge.generate import engine as engine_mod
    from tokenbridge.generate import run as run_mod

    seen = []
    real_run = engine_mod.Engine.run

    async def noting(self, items):
        seen.append(gc.get_threshold())
        return await real_run(self, items)

    monkeypatch.setattr(engine_mod.Engine, "run", noting)
    before = gc.get_threshold()
    prompts = _write_prompts(tmp_path / "p.jsonl", 12)
    try:
        gc.set_threshold(700, 10, 500)  # a user's own gen-2 threshold, above the engine's
        with running_emulator(_emu(), tokenizer=kimi) as url:
            settings = GenerateSettings(datasets=(DatasetSpec("p", prompts),), request=RequestSettings(model=MODEL),
                                        base_url=url, concurrency=4, progress="none")
            summary = generate_run(settings, tmp_path / "run", key=ApiKey("X", FAKE_KEY))
            assert summary.done == 12
            assert seen == [(run_mod._SENDING_GC[0], run_mod._SENDING_GC[1], 500)]
            assert gc.get_threshold() == (700, 10, 500)

            async def broken(self, items):
                seen.append(gc.get_threshold())
                raise RuntimeError("engine bug")

            monkeypatch.setattr(engine_mod.Engine, "run", broken)
            with pytest.raises(RuntimeError, match="engine bug"):
                generate_run(settings, tmp_path / "run2", key=ApiKey("X", FAKE_KEY))
            assert seen[-1][0] == run_mod._SENDING_GC[0] and gc.get_threshold() == (700, 10, 500)
    finally:
        gc.set_threshold(*before)


def test_a_zero_threshold_keeps_automatic_collection_off_while_sending():
    """gc.set_threshold(0) turns automatic collection off; raising the thresholds for the
    send loop must not turn it back on."""
    import gc

    from tokenbridge.generate.run import _fewer_collections

    before = gc.get_threshold()
    try:
        gc.set_threshold(0, 10, 10)
        with _fewer_collections():
            assert gc.get_threshold() == (0, 10, 10)
        gc.set_threshold(700, 10, 10)
        with _fewer_collections():
            with _fewer_collections():  # a second run beside the first: the outermost puts them back
                assert gc.get_threshold()[0] == 50_000
            assert gc.get_threshold()[0] == 50_000
        assert gc.get_threshold() == (700, 10, 10)
        with _fewer_collections():
            gc.set_threshold(1234, 5, 5)  # the caller's own setting, made while a run sends
        assert gc.get_threshold() == (1234, 5, 5)
    finally:
        gc.set_threshold(*before)
