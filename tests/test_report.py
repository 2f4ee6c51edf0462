"""Report: numbers equal to the run files, a self-contained page that renders in Chromium.

The page check drives headless Chromium (Debian ``chromium``) over the DevTools protocol:
it collects console errors, uncaught exceptions, log errors and every network request,
waits until each figure has decoded, and reads the sections from the live DOM. A control
page with a deliberate error proves the check sees what it should. Without Chromium the
browser tests skip locally and FAIL in CI (``CI=true``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from html import escape
from pathlib import Path

import pytest
from typer.testing import CliRunner

from test_export_support import make_run, write_jsonl
from tokenbridge.cli import app
from tokenbridge.report import ReportError, build_report, collect_run
from tokenbridge.report.html import SECTIONS

N = 40


@pytest.fixture(scope="module")
def runs(kimi, tmp_path_factory):
    """A full run folder, one with only reconstructed.jsonl, and their rows / exchanges."""
    exchanges, rows = make_run(kimi, N, seed=3)
    full = tmp_path_factory.mktemp("full")
    write_jsonl(full / "exchanges.jsonl", exchanges)
    write_jsonl(full / "reconstructed.jsonl", rows)
    bare = tmp_path_factory.mktemp("bare")
    write_jsonl(bare / "reconstructed.jsonl", [dict(r, usage=None) for r in rows])
    return {"full": full, "bare": bare, "rows": rows, "exchanges": exchanges}


# --- numbers ------------------------------------------------------------------------------


def test_counts_match_the_rows(runs):
    rows = runs["rows"]
    data = collect_run(runs["full"])
    assert data["rows"]["total"] == len(rows)
    assert data["rows"]["status"] == {s: sum(r["status"] == s for r in rows) for s in ("ok", "flagged", "rejected")}
    assert data["findings"] == dict(Counter(f["code"] for r in rows for f in r["findings"]))
    for key, field in (("by_provider", "provider"), ("by_dataset", "dataset")):
        for name, g in data[key].items():
            mine = [r for r in rows if r[field] == name]
            assert g["rows"] == len(mine)
            assert g["findings"] == dict(Counter(f["code"] for r in mine for f in r["findings"]))
    kept = [r for r in rows if r["status"] != "rejected"]
    assert data["lengths"]["prompt"]["total"] == sum(len(r["prompt_ids"]) for r in kept)
    assert data["lengths"]["completion"]["max"] == max(len(r["completion_ids"]) for r in kept)
    assert sum(data["lengths"]["completion_hist"]["counts"]) == len(kept)


def test_usage_parity_per_exchange(runs):
    rows = runs["rows"]
    parity = collect_run(runs["full"])["usage_parity"]
    by_id: dict[str, list] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    expected = Counter()
    for group in by_id.values():
        usage = group[0]["usage"]
        if usage:
            expected[usage["completion_tokens"] - sum(len(r["completion_ids"]) for r in group)] += 1
    assert parity["completion_values"] == {str(k): v for k, v in sorted(expected.items())}
    assert 3 in expected and 0 in expected  # the bad_usage exchanges are off by 3; the 2-choice one is exact
    assert parity["prompt"]["exact"] == parity["prompt"]["count"] == sum(expected.values())


def test_cost_and_throughput_from_exchanges(runs):
    ex = runs["exchanges"]
    data = collect_run(runs["full"])["exchanges"]
    assert data["count"] == len(ex)
    assert data["cost_total"] == pytest.approx(sum(e["meta"]["cost"] for e in ex))
    t0 = min(e["meta"]["started_at"] for e in ex)
    assert data["duration_s"] == pytest.approx(max(e["meta"]["finished_at"] for e in ex) - t0)
    tl = data["timeline"]
    assert sum(b["requests"] for b in tl["bins"]) == len(ex)
    tokens = sum(e["response"].get("usage", {}).get("completion_tokens", 0) for e in ex)
    assert sum(b["completion_tokens"] for b in tl["bins"]) == tokens
    assert tl["cumulative_cost"][-1][1] == pytest.approx(data["cost_total"])
    assert data["completion_tokens_per_s"] == pytest.approx(tokens / data["duration_s"])


def test_only_reconstructed_says_what_is_missing(runs):
    html = build_report(runs["bare"])
    data = json.loads((html.parent / "report.json").read_text())
    assert data["exchanges"] is None and data["usage_parity"] is None
    text = html.read_text()
    for sid in ("parity", "cost", "throughput"):
        assert re.search(rf'<section id="{sid}" data-has-data="false"><h2>[^<]+</h2><p class="empty">No data: ', text)


@pytest.mark.parametrize("kind", ["missing", "fifo", "folder"])
def test_the_report_says_why_it_read_no_exchanges(runs, tmp_path, kind):
    """A FIFO or a folder named exchanges.jsonl was reported as "not found" (a cold tester's):
    the user went looking for a missing file. Neither is read (a FIFO would block)."""
    import os
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(runs["bare"] / "reconstructed.jsonl", run / "reconstructed.jsonl")
    if kind == "fifo":
        os.mkfifo(run / "exchanges.jsonl")
    elif kind == "folder":
        (run / "exchanges.jsonl").mkdir()
    why = {"missing": "exchanges.jsonl is not in the run folder",
           "fifo": "exchanges.jsonl is a named pipe (FIFO), not a regular file: not read",
           "folder": "exchanges.jsonl is a folder, not a regular file: not read"}[kind]
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    assert f"Cost and throughput: no data ({why})" in " ".join(res.output.split())
    assert f"No data: {why}" in (run / "report" / "report.html").read_text()


def test_unreadable_exchange_lines_are_left_out_and_named_not_the_whole_report(runs, tmp_path):
    """One line of exchanges.jsonl that is no record (``null``, text, a number past a double)
    stopped the report with an error and no report at all, where reconstruct had skipped it
    as a bad line (a cold tester's). The rest are reported, the lines left out named."""
    import html
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(runs["full"] / "reconstructed.jsonl", run / "reconstructed.jsonl")
    lines = (runs["full"] / "exchanges.jsonl").read_text(encoding="utf-8").splitlines()
    # and records reconstruct refuses (a cold tester's: a line repeated counted its cost twice)
    first = json.loads(lines[0])
    refused = [lines[0], json.dumps({**first, "id": "no-request", "request": None}), '{"garbage": 1}']
    (run / "exchanges.jsonl").write_text("\n".join([lines[0], "null", "not json", *lines[1:], '{"x": 1e999}', *refused])
                                         + "\n", encoding="utf-8")
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    data = json.loads((run / "report" / "report.json").read_text())
    assert data["exchanges"]["count"] == len(runs["exchanges"])
    assert data["exchanges"]["cost_total"] == pytest.approx(sum(e["meta"]["cost"] for e in runs["exchanges"]))
    note = ("6 lines of exchanges.jsonl are no record (not JSON, not an object, or refused by reconstruct too): left out "
            "of cost and throughput; the first: line 2: <line>: must be a JSON object, got NoneType")
    assert data["exchanges"]["unreadable"] == {"lines": 6, "first": "line 2: <line>: must be a JSON object, got NoneType"}
    assert f"note: {note}" in " ".join(res.output.split())
    assert html.escape(note, quote=False) in (run / "report" / "report.html").read_text()


@pytest.mark.parametrize("kind", ["garbage", "folder"])
def test_the_summary_says_a_store_it_could_not_read(runs, tmp_path, kind):
    """A store that is no database said so only in report.json and the page; one that is a
    folder was taken for no store at all (a cold tester's)."""
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(runs["bare"] / "reconstructed.jsonl", run / "reconstructed.jsonl")
    if kind == "garbage":
        (run / "state.sqlite").write_bytes(b"not a database " * 400)
    else:
        (run / "state.sqlite").mkdir()
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    data = json.loads((run / "report" / "report.json").read_text())
    assert data["generation"] is None and data["generation_error"]
    if kind == "folder":
        assert data["generation_error"] == f"{run / 'state.sqlite'}: not a readable file (a folder, a link to nothing, ...)"
    said = f"Generation: not read ({data['generation_error']})"
    assert "".join(said.split()) in "".join(res.output.split())  # rich wraps a long path anywhere


def test_sample_ids_per_finding_code_and_per_status(runs):
    rows = runs["rows"]
    data = collect_run(runs["full"])
    for code in data["findings"]:
        mine = [[r["id"], r["choice"]] for r in rows if code in {f["code"] for f in r["findings"]}]
        assert data["samples_by_finding"][code] == mine[:50], code
    for st in ("ok", "flagged", "rejected"):
        assert data["samples_by_status"][st] == [[r["id"], r["choice"]] for r in rows if r["status"] == st][:50]
    assert any(choice for ids in data["samples_by_status"].values() for _, choice in ids)  # a 2-choice exchange


def test_listed_sample_id_pastes_into_inspect(runs, kimi_dir):
    data = collect_run(runs["full"])
    sid, choice = data["samples_by_finding"]["usage_completion_mismatch"][0]
    res = CliRunner().invoke(app, ["inspect", str(runs["full"] / "reconstructed.jsonl"), "-t", str(kimi_dir),
                                   "--id", sid, "--choice", str(choice)])
    assert res.exit_code == 0, res.output
    assert f"{sid} choice {choice}: rejected" in res.output and "usage_completion_mismatch" in res.output


def test_page_lists_ids_and_explains_every_code(runs):
    from tokenbridge.checks import CODES

    html = build_report(runs["full"]).read_text()
    data = json.loads((runs["full"] / "report" / "report.json").read_text())
    section = html[html.index('<section id="samples"'):html.index('<section id="glossary"')]
    for code, ids in data["samples_by_finding"].items():
        cell = " ".join(f"<code>{sid}</code>" if not c else f"<code>{sid} (choice {c})</code>" for sid, c in ids)
        assert f"<tr><td>{code}</td><td>{data['findings'][code]:,}</td><td class=\"ids\">{cell}" in section
    glossary = html[html.index('<section id="glossary"'):]
    for code, (severity, meaning) in CODES.items():
        n = data["findings"].get(code, 0)
        assert f"<tr><td>{code}</td><td>{severity}</td><td>{escape(meaning)}</td><td>{n:,}</td></tr>" in glossary


def test_no_reconstructed_file_is_an_error(tmp_path):
    with pytest.raises(ReportError, match="no reconstructed.jsonl"):
        build_report(tmp_path)


def test_page_is_self_contained(runs):
    text = build_report(runs["full"]).read_text()
    assert "<script" not in text and "@import" not in text and "url(" not in text
    assert not re.findall(r'(?:src|href)="(?!data:|#)', text)
    svgs = re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', text)
    assert len(svgs) == 7
    for svg in svgs:
        body = base64.b64decode(svg).decode()
        assert "<svg" in body and not re.findall(r'href="(?!#)', body)  # only links inside the SVG itself
        assert "<text" not in body  # glyphs are paths: no font needed


def test_cli_report_prints_the_summary(runs):
    res = CliRunner().invoke(app, ["report", str(runs["full"])])
    assert res.exit_code == 0, res.output
    st = collect_run(runs["full"])["rows"]["status"]
    text = " ".join(res.output.split())  # rich wraps at the terminal width
    assert f"{len(runs['rows'])} rows ({st['ok']} ok, {st['flagged']} flagged, {st['rejected']} rejected)" in text
    assert "usage_completion_mismatch" in text and "Usage parity" in text
    assert (runs["full"] / "report" / "report.json").is_file()


def test_cli_report_that_cannot_read_its_report_json_back_says_so(tmp_path, monkeypatch):
    """The summary is printed from report.json read back: a file nested deeper than the
    stdlib reads was a RecursionError and exit 8 (internal error)."""
    import tokenbridge.report as report

    html = tmp_path / "run" / "report" / "report.html"
    html.parent.mkdir(parents=True)
    html.write_text("<html></html>")
    (html.parent / "report.json").write_text("[" * 100_000)
    monkeypatch.setattr(report, "build_report", lambda run_dir, force=False: html)
    res = CliRunner().invoke(app, ["report", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    assert res.output == (f"error: {html.parent / 'report.json'}: cannot read the report just written "
                          f"(nested too deeply to read); {html} was written\n")


# --- Chromium -----------------------------------------------------------------------------

_PAGE_JS = """(async () => {
  await Promise.all([...document.images].map(i => i.decode().then(() => true, () => false)));
  return {
    title: document.title,
    sections: [...document.querySelectorAll('main > section')].map(s => ({
      id: s.id, title: s.querySelector('h2') && s.querySelector('h2').textContent,
      hasData: s.dataset.hasData, empty: s.querySelector('p.empty') && s.querySelector('p.empty').textContent,
      figures: [...s.querySelectorAll('img.fig')].map(i => ({name: i.dataset.figure, w: i.naturalWidth,
        shown: i.getBoundingClientRect().width})),
      tables: s.querySelectorAll('table').length})),
  };
})()"""


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        msg = "chromium not installed (apt-get install -y chromium)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


class _Cdp:
    """The few DevTools-protocol calls the check needs, over one browser websocket."""

    def __init__(self, ws):
        self.ws, self.next_id, self.pending, self.events = ws, 0, {}, []
        self.changed = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    async def _read(self):
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data and data["id"] in self.pending:
                self.pending.pop(data["id"]).set_result(data)
            else:
                self.events.append(data)
                self.changed.set()

    async def call(self, method, session=None, **params):
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = fut
        msg = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        await self.ws.send_str(json.dumps(msg))
        reply = await fut
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def wait(self, method, session):
        while not any(e.get("method") == method and e.get("sessionId") == session for e in self.events):
            self.changed.clear()
            await self.changed.wait()


async def _inspect(exe: str, urls: list[str], profile: Path) -> list[dict]:
    import aiohttp

    proc = await asyncio.create_subprocess_exec(
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-extensions", f"--user-data-dir={profile}", "--remote-debugging-port=0",
        "about:blank", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        ws_url = None
        while ws_url is None:
            line = await proc.stderr.readline()
            if not line:
                raise RuntimeError(f"chromium exited ({await proc.wait()}) before DevTools came up")
            m = re.search(rb"DevTools listening on (ws://\S+)", line)
            ws_url = m and m.group(1).decode()
        drain = asyncio.create_task(proc.stderr.read())  # keep the pipe from filling
        results = []
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url, max_msg_size=0) as ws:
            cdp = _Cdp(ws)
            for url in urls:
                target = await cdp.call("Target.createTarget", url="about:blank")
                sess = (await cdp.call("Target.attachToTarget", targetId=target["targetId"], flatten=True))["sessionId"]
                for method in ("Runtime.enable", "Log.enable", "Network.enable", "Page.enable"):
                    await cdp.call(method, session=sess)
                await cdp.call("Page.navigate", session=sess, url=url)
                await cdp.wait("Page.loadEventFired", sess)
                page = await cdp.call("Runtime.evaluate", session=sess, expression=_PAGE_JS, returnByValue=True,
                                      awaitPromise=True)
                shot = await cdp.call("Page.captureScreenshot", session=sess, format="png", captureBeyondViewport=True)
                await asyncio.sleep(0.2)  # late console / log events
                mine = [e for e in cdp.events if e.get("sessionId") == sess]
                results.append({"page": page["result"]["value"], "png": base64.b64decode(shot["data"]),
                                "errors": _errors(mine), "requests": _requests(mine)})
            await cdp.call("Browser.close")
            cdp.reader.cancel()
        drain.cancel()
        return results
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def _errors(events: list[dict]) -> list[str]:
    out = []
    for e in events:
        p = e.get("params", {})
        if e.get("method") == "Runtime.exceptionThrown":
            out.append("exception: " + p["exceptionDetails"].get("exception", {}).get("description", p["exceptionDetails"]["text"]))
        elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
        elif e.get("method") == "Log.entryAdded" and p["entry"].get("level") == "error":
            out.append("log: " + p["entry"].get("text", ""))
    return out


def _requests(events: list[dict]) -> list[str]:
    return [e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"]


@pytest.fixture(scope="module")
def browsed(runs, tmp_path_factory):
    exe = _chromium()
    root = tmp_path_factory.mktemp("browser")
    control = root / "control.html"
    control.write_text('<!DOCTYPE html><html><body><h1>control</h1><img src="http://127.0.0.1:9/x.png">'
                       '<script>console.error("boom"); throw new Error("kaboom")</script></body></html>')
    pages = {"full": build_report(runs["full"]), "bare": build_report(runs["bare"]), "control": control}
    results = asyncio.run(asyncio.wait_for(_inspect(exe, [p.as_uri() for p in pages.values()], root / "profile"), 120))
    out = dict(zip(pages, results))
    for name, r in out.items():
        (root / f"{name}.png").write_bytes(r["png"])
    return pages, out


def test_check_catches_errors_on_a_broken_page(browsed):
    r = browsed[1]["control"]
    assert any("kaboom" in e for e in r["errors"]) and any("boom" in e for e in r["errors"])
    assert "http://127.0.0.1:9/x.png" in r["requests"]


@pytest.mark.parametrize("which", ["full", "bare"])
def test_report_renders_in_chromium_without_errors(browsed, which):
    pages, results = browsed
    r = results[which]
    assert r["errors"] == []
    # the page itself, then only its own data: figures: nothing from the network or disk
    assert r["requests"][0] == pages[which].as_uri()
    assert all(u.startswith("data:image/svg+xml;base64,") for u in r["requests"][1:])
    page = r["page"]
    assert [(s["id"], s["title"]) for s in page["sections"]] == list(SECTIONS)
    assert r["png"][:8] == b"\x89PNG\r\n\x1a\n"
    by_id = {s["id"]: s for s in page["sections"]}
    expect_data = {"overview", "status", "findings", "samples", "glossary", "lengths"} | (
        {"parity", "cost", "throughput"} if which == "full" else set())
    for sid, s in by_id.items():
        assert (s["hasData"] == "true") == (sid in expect_data), sid
        if sid in expect_data:
            assert s["empty"] is None
            assert all(f["w"] > 0 and f["shown"] > 100 for f in s["figures"]), s  # every figure decoded and laid out
        else:
            assert s["empty"].startswith("No data: ") and not s["figures"]
    figures = [f["name"] for s in page["sections"] for f in s["figures"]]
    want = ["status_provider", "status_dataset", "findings", "lengths"]
    assert figures == (want + ["parity", "cost", "throughput"] if which == "full" else want)


def test_cli_report_without_rows_fails_clearly(tmp_path):
    res = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2
    assert f"error: {tmp_path}: no reconstructed.jsonl or reconstructed.parquet to report on" in " ".join(res.output.split())


def test_generation_numbers_agree_with_generate(tmp_path, kimi):
    """Requests, failed attempts per class, samples and cost: what generate said, read back from its store."""
    from tokenbridge.emulator import EmulatorConfig, running_emulator
    from tokenbridge.generate import GenerateSettings, RequestSettings, generate_run
    from tokenbridge.generate.settings import DatasetSpec
    from tokenbridge.reconstruct import reconstruct_file

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"Question {i}?"}) + "\n" for i in range(30)))
    run = tmp_path / "run"
    emu = EmulatorConfig(min_tokens=10, max_tokens=60, retry_after_s=0, slow_s=0.05, fault_rate=0.3, seed=5)
    with running_emulator(emu, tokenizer=kimi) as url:
        settings = GenerateSettings(datasets=(DatasetSpec("d", prompts),), request=RequestSettings(model="moonshotai/kimi-k2.5"),
                                    base_url=url, progress="none", max_attempts=8)
        summary = generate_run(settings, run, key=None)
    reconstruct_file(run / "exchanges.jsonl", run / "reconstructed.jsonl", kimi)
    data = collect_run(run)
    gen = data["generation"]
    assert summary.errors and summary.requests > summary.done  # the faults made retries
    assert gen["requests"] == summary.requests and gen["errors"] == summary.errors
    assert gen["samples"] == {"done": summary.done, "failed": summary.failed, "pending": summary.pending}
    assert gen["cost_total"] == pytest.approx(summary.spent_total) and gen["runs"] == 1
    exchanges = [json.loads(x) for x in (run / "exchanges.jsonl").read_text().splitlines()]
    assert summary.failed == 0  # so every attempt belongs to a sample in exchanges.jsonl
    assert data["exchanges"]["attempts"] == sum(e["meta"]["attempts"] for e in exchanges) == summary.requests


def _store_run(runs, tmp_path: Path) -> Path:
    """A run folder with rows and a generate store holding one run (WAL mode, closed)."""
    from tokenbridge.generate.store import Store

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(runs["full"] / "reconstructed.jsonl", run / "reconstructed.jsonl")
    with Store.open(run) as store:
        store.begin_run({"seed": 1})
    return run


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir()}


def test_report_reads_a_closed_store_without_creating_files(runs, tmp_path):
    """A read-only open must not leave state.sqlite-wal / -shm behind (SQLite's mode=ro alone does)."""
    run = _store_run(runs, tmp_path)
    before = _files(run)
    assert before == {"reconstructed.jsonl", "state.sqlite"}
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    assert _files(run) - before == {".lock", "report/report.html", "report/report.json", "report/.tokenbridge-output"}
    assert json.loads((run / "report" / "report.json").read_text())["generation"]["runs"] == 1


def test_report_reads_what_a_killed_generate_left_in_the_wal(runs, tmp_path):
    """A store whose writer died holds its last commits in -wal only: they are read, and no file is added."""
    import sys

    run = _store_run(runs, tmp_path)
    code = ("import os, sys; from tokenbridge.generate.store import Store; s = Store.open(sys.argv[1]); "
            "s.begin_run({'seed': 2}); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(run)], check=True, env={**os.environ, "PYTHONPATH": "src"})
    before = _files(run)
    assert {"state.sqlite-wal", "state.sqlite-shm"} <= before
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    assert _files(run) - before == {".lock", "report/report.html", "report/report.json", "report/.tokenbridge-output"}
    assert json.loads((run / "report" / "report.json").read_text())["generation"]["runs"] == 2


def _edited(rows, k, edit):
    out = [json.loads(json.dumps(r)) for r in rows]
    edit(out[k])
    return out


@pytest.mark.parametrize(("edit", "field", "message"), [
    (lambda r: r["input_ids"].__setitem__(3, -7), "input_ids", "has a negative id at position 3"),
    (lambda r: r.__setitem__("loss_mask", r["loss_mask"][:-5]), "loss_mask", "entries but input_ids has"),
    (lambda r: r.update(status="ok", findings=[{"code": "truncated", "severity": "warning", "message": "x"}]),
     "status", "is 'ok' but the row carries 1 finding(s), so it is 'flagged'"),
    (lambda r: r.update(id=""), "id", "must be a non-empty string"),
])
def test_report_refuses_rows_export_refuses(runs, tmp_path, edit, field, message):
    """A report counts what it can vouch for: a rows file edited by hand fails it as it fails
    export, naming file, line and field (it counted them as they were before)."""
    k = next(k for k, r in enumerate(runs["rows"]) if r["status"] == "ok" and k > 2)  # ok rows must be trainable
    write_jsonl(tmp_path / "reconstructed.jsonl", _edited(runs["rows"], k, edit))
    with pytest.raises(ReportError) as caught:
        collect_run(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / 'reconstructed.jsonl'}:{k + 1}: {field}: ")
    assert message in str(caught.value)
    res = CliRunner().invoke(app, ["report", str(tmp_path)])  # bad data: 1, as export and inspect say it
    assert res.exit_code == 1 and res.output.strip().splitlines() == [f"error: {caught.value}"], res.output


def test_report_refuses_a_sample_listed_twice(runs, tmp_path):
    rows = runs["rows"]
    write_jsonl(tmp_path / "reconstructed.jsonl", [*rows, rows[2]])
    with pytest.raises(ReportError, match=rf":{len(rows) + 1}: id: .* is also on line 3"):
        collect_run(tmp_path)


def test_report_counts_a_rejected_row_with_no_completion(tmp_path):
    """Only an ``ok`` row must be trainable: reconstruct writes a rejected (or truncated) row
    with no completion token, and the report counts it (a cold review caught the report
    refusing such a file after the contract check came in)."""
    from conftest import KIMI_DIR

    TOKENIZERS = KIMI_DIR.parent
    from tokenbridge.reconstruct import reconstruct_file

    def record(rid, content, finish):
        return {"id": rid, "request": {"messages": [{"role": "user", "content": "Hi"}],
                                       "chat_template_kwargs": {"enable_thinking": False}},
                "response": {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": finish}]}}

    write_jsonl(tmp_path / "ex.jsonl", [record("ok1", "Hello.", "stop"), record("cut", "", "length")])
    run = tmp_path / "run"
    run.mkdir()
    reconstruct_file(tmp_path / "ex.jsonl", run / "reconstructed.jsonl", TOKENIZERS / "qwen3", workers=1)
    cut = json.loads((run / "reconstructed.jsonl").read_text(encoding="utf-8").splitlines()[1])
    assert cut["completion_ids"] == [] and cut["status"] != "ok"
    data = collect_run(run)
    assert data["rows"]["total"] == 2 and sum(data["rows"]["status"].values()) == 2


# --- numbers from outside that no statistic can take ----------------------------------------


def _edited_run(kimi, folder: Path, edits: list[tuple[dict, dict]]) -> Path:
    """A run folder of one exchange per ``(meta, usage)`` edit (exchange k: ``make_exchange(k)``
    with its usage matching, then ``meta`` and ``response.usage`` updated) and its rows."""
    from test_export_support import make_exchange, reconstruct
    from tokenbridge.reconstruct import reconstruct_record

    exchanges, rows = [], []
    for k, (meta, usage) in enumerate(edits):
        ex = make_exchange(k)
        reconstruct(ex, kimi)
        ex["meta"].update(meta)
        ex["response"]["usage"].update(usage)
        exchanges.append(ex)
        rows.extend(reconstruct_record(ex, kimi))
    write_jsonl(folder / "exchanges.jsonl", exchanges)
    write_jsonl(folder / "reconstructed.jsonl", rows)
    return folder


def _strict_json(path: Path):
    """``path`` read as JSON that has no NaN or Infinity (Python's json writes them unless told not to)."""
    def refuse(name):
        raise AssertionError(f"{path} holds {name}: not JSON")
    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


_TOKENS = "not a token count (an integer from 0 to 1,000,000,000)"


@pytest.mark.parametrize(("edits", "left_out", "notes"), [
    ([({}, {"prompt_tokens": 18446744073709551615})],
     {"rows": {"usage.prompt_tokens": 1}, "exchanges": {"response.usage.prompt_tokens": 1}},
     [f"usage.prompt_tokens of 1 sample in the rows: {_TOKENS}",
      f"response.usage.prompt_tokens of 1 exchange: {_TOKENS}"]),
    ([({}, {"completion_tokens": 1e20})],
     {"rows": {"usage.completion_tokens": 1}, "exchanges": {"response.usage.completion_tokens": 1}},
     [f"usage.completion_tokens of 1 sample in the rows: {_TOKENS}",
      f"response.usage.completion_tokens of 1 exchange: {_TOKENS}"]),
    ([({"started_at": -1e308, "finished_at": 1e308}, {})],
     {"exchanges": {"meta.finished_at": 1, "meta.started_at": 1}},
     ["meta.finished_at of 1 exchange: not a unix time from 0 to the year 9999",
      "meta.started_at of 1 exchange: not a unix time from 0 to the year 9999"]),
    ([({"cost": 1.5e308}, {"cost": 1.5e308})] * 2,
     {"exchanges": {"meta.cost": 2, "response.usage.cost": 2}},
     ["meta.cost of 2 exchanges: not a cost from 0 to 1000 USD",
      "response.usage.cost of 2 exchanges: not a cost from 0 to 1000 USD"]),
    ([({"latency_s": 1.5e308}, {})] * 2,
     {"exchanges": {"meta.latency_s": 2}},
     ["meta.latency_s of 2 exchanges: not a duration from 0 s to 8,000 years"]),
    ([({"attempts": 10**30}, {})],
     {"exchanges": {"meta.attempts": 1}},
     ["meta.attempts of 1 exchange: not an attempt count (an integer from 1 to 1,000,000,000)"]),
], ids=["prompt_tokens_2**64", "completion_tokens_1e20", "times_1e308", "cost_1.5e308", "latency_1.5e308",
        "attempts_1e30"])
def test_unusable_numbers_are_left_out_and_said(kimi, tmp_path, edits, left_out, notes):
    """A number from the API or ``meta`` that no statistic can take (an int past 64 bits, a
    float that sums to infinity) is left out and said, never a crash (exit 8) or an
    ``Infinity`` in report.json (a cold tester's five cases)."""
    run = _edited_run(kimi, tmp_path, edits)
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # rich wraps at the terminal width
    tail = text[text.index("left out of the statistics: "):text.index(" report: ")]
    assert tail == " ".join(f"left out of the statistics: {n}" for n in notes)
    data = _strict_json(run / "report" / "report.json")
    assert data["left_out"] == left_out
    html = (run / "report" / "report.html").read_text(encoding="utf-8")
    assert (f'<p class="note" id="left-out">Left out of these statistics (unusable numbers): '
            f'{escape("; ".join(notes))}.</p>') in html
    assert data["exchanges"]["count"] == len(edits)


def test_a_row_statistic_takes_a_usage_count_past_64_bits(kimi, tmp_path):
    """``run``'s one pass feeds :class:`RowStats` row by row: a usage count no C long holds
    crashed it there (``_Parity.close``), and every export of the pass with it."""
    from tokenbridge.export import ExportJob, run_pass
    from tokenbridge.report import RowStats

    run = _edited_run(kimi, tmp_path, [({}, {"prompt_tokens": 2**64 - 1}), ({}, {})])
    stats = RowStats()
    result = run_pass(run / "reconstructed.jsonl", exports=[ExportJob("specforge", tmp_path / "sf", allow_empty=True)],
                      stats=stats)
    assert result.rows_read == 2 and (tmp_path / "sf" / "train.jsonl").is_file()
    data = collect_run(run, stats)
    assert data["left_out"] == {"rows": {"usage.prompt_tokens": 1},
                                "exchanges": {"response.usage.prompt_tokens": 1}}
    assert data["usage_parity"]["prompt"]["count"] == 1 and data["usage_parity"]["completion"]["count"] == 2


def test_report_limits_are_generates():
    """The report takes from ``usage`` what generate books (its limits, not imported there:
    the report must not load the generate package)."""
    from tokenbridge.generate.body import MAX_PLAUSIBLE_COST, MAX_PLAUSIBLE_TOKENS
    from tokenbridge.report import collect

    assert (collect.MAX_TOKENS, collect.MAX_COST) == (MAX_PLAUSIBLE_TOKENS, MAX_PLAUSIBLE_COST)


def test_a_summed_store_cost_that_is_not_finite_is_left_out(runs, tmp_path):
    """The store is a file on disk too: two attempts whose costs (edited by hand) sum past a
    double gave ``"cost_total": Infinity``, which is not JSON."""
    import sqlite3

    run = _store_run(runs, tmp_path)
    con = sqlite3.connect(run / "state.sqlite")
    con.executemany("INSERT INTO attempts (sample_id, n, started_at, cost) VALUES (?, ?, 0, 1.5e308)",
                    [("s", 1), ("s", 2)])
    con.commit()
    con.close()
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    assert "left out of the statistics: attempts.cost (summed) of the store: not a finite number" in " ".join(
        res.output.split())
    data = _strict_json(run / "report" / "report.json")
    assert data["generation"]["cost_total"] is None and data["generation"]["requests"] == 2
    assert data["left_out"] == {"store": {"attempts.cost (summed)": 1}}


def test_a_folder_with_both_rows_files_reports_on_the_newer_and_says_so(runs, tmp_path, kimi_dir):
    """``reconstruct -o RUN/reconstructed.parquet`` after a run left the run's JSONL beside
    it: the report read the old JSONL without a word."""
    from tokenbridge.reconstruct import reconstruct_file

    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "exchanges.jsonl", runs["exchanges"][:5])
    reconstruct_file(run / "exchanges.jsonl", run / "reconstructed.parquet", kimi_dir, workers=1)
    write_jsonl(run / "reconstructed.jsonl", runs["rows"])  # all N rows, and older than the parquet
    jsonl, parquet = run / "reconstructed.jsonl", run / "reconstructed.parquet"
    os.utime(jsonl, ns=(parquet.stat().st_mtime_ns - 10**9,) * 2)
    res = CliRunner().invoke(app, ["report", str(run)], env={"COLUMNS": "1000"})  # long paths unwrapped
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert f"{run.name}: 5 rows (" in text
    assert f"note: rows read from {parquet}; {jsonl} is also there and was not read" in text
    page = (run / "report" / "report.html").read_text()
    assert escape(f"rows read from {parquet}; {jsonl} is also there and was not read") in page
    assert json.loads((run / "report" / "report.json").read_text())["sources"]["not_read"] == str(jsonl)

    os.utime(jsonl)  # now the JSONL is the newer one
    data = collect_run(run)
    assert (data["rows"]["total"], data["sources"]["not_read"]) == (len(runs["rows"]), str(parquet))


def test_a_folder_with_one_rows_file_has_no_source_note(runs):
    res = CliRunner().invoke(app, ["report", str(runs["full"])])
    assert res.exit_code == 0 and "also there" not in res.output
    assert collect_run(runs["full"])["sources"]["not_read"] is None
