"""The key in places a run writes without reading them as answers: the base URL's path."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from typer.testing import CliRunner

from conftest import write_prompts
from tokenbridge.cli import app
from tokenbridge.generate import GenerateSettings, RequestSettings, SettingsChanged, agenerate_run
from tokenbridge.generate.secrets import ApiKey
from tokenbridge.generate.settings import DatasetSpec

SECRET = "sk-or-v1-" + "0123456789abcdef" * 4
KEY = ApiKey("TB_LEAK", SECRET)
Reply = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _ok(_: web.Request | None = None) -> web.Response:
    return web.json_response({
        "id": "gen-l", "object": "chat.completion", "created": 1, "model": "m", "provider": "p",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "cost": 0.0001}})


async def _answer_ok(request: web.Request) -> web.StreamResponse:
    return _ok(request)


def _run(tmp_path: Path, n: int, reply: Reply, path: str = "/api/v1", *, runs: tuple[str, ...] | None = None, **kw):
    """A generate run against a server answering every path by ``reply``; one run per path
    in ``runs`` when given (the same folder: a resume), each result (or exception) in order."""
    paths = runs or (path,)

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        return await reply(request)

    async def main() -> list[object]:
        app_ = web.Application()
        app_.router.add_route("POST", "/{tail:.*}", handle)
        runner = web.AppRunner(app_, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        root = f"http://127.0.0.1:{runner.addresses[0][1]}"
        out: list[object] = []
        try:
            for p in paths:
                settings = dict(datasets=(DatasetSpec("l", write_prompts(tmp_path, n)),), base_url=root + p,
                                request=RequestSettings(model="m", max_tokens=16), max_attempts=1, progress="none",
                                timeout_s=10.0)
                settings.update(kw)
                try:
                    out.append(await agenerate_run(GenerateSettings(**settings), tmp_path / "run", key=KEY))
                except SettingsChanged as exc:
                    out.append(exc)
        finally:
            await runner.cleanup()
        return [root, *out]

    return asyncio.run(main())


def _every_stored_byte(run: Path) -> bytes:
    """Every file of the run folder, and every zlib blob in its store, as one haystack."""
    data = b"".join(f.read_bytes() for f in sorted(run.rglob("*")) if f.is_file())
    con = sqlite3.connect(run / "state.sqlite")
    for table, col in (("attempts", "body"), ("responses", "raw_stream")):
        data += b"".join(zlib.decompress(b) for (b,) in con.execute(f"SELECT {col} FROM {table} WHERE {col} IS NOT NULL"))
    return data


# --- the key in base_url's path -----------------------------------------------------------


def test_a_key_in_the_base_urls_path_is_masked_where_the_url_is_stored(tmp_path):
    root, first, again = _run(tmp_path, 2, _answer_ok, runs=(f"/gw/{SECRET}/v1",) * 2)
    masked = f"{root}/gw/***/v1"
    assert first.done == 2
    assert not isinstance(again, SettingsChanged) and again.pending == 0  # a resume compares the URLs as stored
    rows = [json.loads(x) for x in (tmp_path / "run" / "exchanges.jsonl").read_text().splitlines()]
    assert [r["meta"]["base_url"] for r in rows] == [masked, masked]
    con = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    assert con.execute("SELECT DISTINCT base_url FROM responses").fetchall() == [(masked,)]
    assert [json.loads(s)["base_url"] for (s,) in con.execute("SELECT settings FROM runs")] == [masked, masked]
    assert SECRET[9:25].encode() not in _every_stored_byte(tmp_path / "run")


def test_a_folder_that_stored_the_url_unmasked_resumes(tmp_path):
    root, first = _run(tmp_path, 2, _answer_ok, f"/gw/{SECRET}/v1", limit=1)
    with sqlite3.connect(tmp_path / "run" / "state.sqlite") as con:  # as versions before the mask stored it
        con.execute("UPDATE responses SET base_url=?", (f"{root}/gw/{SECRET}/v1",))
    _, again = _run(tmp_path, 2, _answer_ok, f"/gw/{SECRET}/v1")  # another port: loopback compares without it
    assert first.done == 1 and not isinstance(again, SettingsChanged) and again.done == 1 and again.pending == 0


def test_a_refused_resume_names_the_base_urls_masked(tmp_path):
    _, first, moved = _run(tmp_path, 1, _answer_ok, runs=(f"/gw/{SECRET}/v1", f"/other/{SECRET}/v1"))
    assert first.done == 1 and isinstance(moved, SettingsChanged)
    assert "1 answered by http://127.0.0.1:" in str(moved) and SECRET[9:25] not in str(moved)
    assert "/gw/***/v1 (now http://127.0.0.1:" in str(moved) and "/other/***/v1, e.g. l-0)" in str(moved)


def test_probe_json_masks_a_key_in_the_base_url(tmp_path, kimi_dir):
    out = tmp_path / "probe.json"
    res = CliRunner().invoke(app, ["probe", "--model", "m", "--providers", "a/fp8", "--base-url",
                                   f"http://127.0.0.1:9/gw/{SECRET}/v1", "--json", str(out), "--tokenizer", str(kimi_dir)],
                             env={"OPENROUTER_API_KEY": SECRET, "COLUMNS": "200"})
    assert res.exit_code == 1, res.output  # a closed port: nothing reached
    assert json.loads(out.read_text(encoding="utf-8"))["base_url"] == "http://127.0.0.1:9/gw/***/v1"
    assert SECRET[9:25] not in out.read_text(encoding="utf-8") and SECRET[9:25] not in res.output


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
