"""Every value from outside (configs, prompt folders) is checked once, before any request
is paid for: a bad one is one ``error:`` line naming file, line and key (exit 2), never a
traceback, a hang or a run whose every paid record reconstruct then refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import write_run_config
from typer.testing import CliRunner

from tokenbridge.cli import app
from tokenbridge.pipeline import PipelineError, load_run_config, run_pipeline


class _Counter(BaseHTTPRequestHandler):
    """Counts every request; answers 500 (a test that gets this far has already failed)."""

    hits = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        type(self).hits += 1
        self.send_response(500)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@contextmanager
def counting_server() -> Iterator[tuple[str, type[_Counter]]]:
    """A loopback API on 127.0.0.1 that counts the requests it gets; stopped on exit."""
    handler = type("Counter", (_Counter,), {"hits": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n", encoding="utf-8")
    return path


def _lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


# --- extra_body: the request a config sends passes the exchange reader's rules ------------


@pytest.mark.parametrize(("extra", "message"), [
    ("extra_body = 7", "extra_body.extra_body: must be an object or null, got int"),
    ("chat_template_kwargs = 5", "extra_body.chat_template_kwargs: must be an object or null, got int"),
    ('reasoning = { enabled = "false" }', "extra_body.reasoning.enabled: must be true, false or null, got 'false'"),
    ('chat_template_kwargs = { thinking = "false" }',
     "extra_body.chat_template_kwargs.thinking: must be true, false or null, got 'false'"),
], ids=["extra_body-int", "kwargs-int", "reasoning-enabled-quoted", "thinking-quoted"])
def test_a_request_reconstruct_would_refuse_is_refused_at_load(tmp_path, extra, message):
    cfg = tmp_path / "c.toml"
    with counting_server() as (url, counter):
        cfg.write_text(f'model = "m"\nbase_url = "{url}"\nextra_body = {{ return_token_ids = true, {extra} }}\n',
                       encoding="utf-8")
        res = CliRunner().invoke(app, ["generate", str(_prompts(tmp_path)), "--out", str(tmp_path / "run"),
                                       "--config", str(cfg)], env={"OPENROUTER_API_KEY": "k"})
        assert counter.hits == 0
    assert res.exit_code == 2, res.output
    assert _lines(res.output) == [f"error: {cfg}:3: {message}"]
    assert not (tmp_path / "run").exists()


def test_run_refuses_the_request_before_the_emulator_starts(tmp_path, kimi_dir):
    text = write_run_config(tmp_path, kimi_dir).read_text()
    path = tmp_path / "eb.toml"
    path.write_text(text.replace("return_token_ids = true", "return_token_ids = true, extra_body = 7"), encoding="utf-8")
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 2, res.output
    assert _lines(res.output) == [f"error: {path}:15: generate.extra_body.extra_body: must be an object or null, got int"]
    assert not (tmp_path / "out").exists()


def test_run_names_the_records_reconstruct_refused(tmp_path, kimi_dir, monkeypatch):
    """Were a request reconstruct refuses ever sent, run says which records and why, as
    ``reconstruct`` does, not only "0 ok, 0 flagged, 0 rejected" and exit 1."""
    import tokenbridge.generate.request as request

    monkeypatch.setattr(request, "request_problem", lambda _rs: None)  # the load check as it was
    text = write_run_config(tmp_path, kimi_dir).read_text()
    path = tmp_path / "eb.toml"
    path.write_text(text.replace("return_token_ids = true", "return_token_ids = true, extra_body = 7")
                    .replace("limit = 12", "limit = 2").replace("limit = 4", "limit = 1"), encoding="utf-8")
    lines: list[str] = []
    run_pipeline(load_run_config(path), echo=lines.append)
    bad = [line for line in lines if line.startswith("reconstruct: bad record: ")]
    exchanges = tmp_path / "out" / "exchanges.jsonl"
    assert bad == [f"reconstruct: bad record: {exchanges}:{n}: request.extra_body: must be an object or null, got int"
                   for n in (1, 2, 3)]
    assert "reconstruct: 3 bad record(s) skipped (listed in pipeline.json)" in lines
    # the run folder moved: the skipped stage names the records where they are now (a reviewer's)
    import dataclasses

    (tmp_path / "out").rename(tmp_path / "moved")
    lines.clear()
    run_pipeline(dataclasses.replace(load_run_config(path), out=tmp_path / "moved"), echo=lines.append)
    assert any(line.startswith("reconstruct: skipped") for line in lines), lines
    assert [line for line in lines if line.startswith("reconstruct: bad record: ")] == [
        f"reconstruct: bad record: {tmp_path / 'moved' / 'exchanges.jsonl'}:{n}: request.extra_body: must be an object "
        "or null, got int" for n in (1, 2, 3)]


# --- nesting too deep for Python: one line naming the file -------------------------------

_DEEP = "[" * 100_000 + "]" * 100_000


def _generate_dry_run(folder: Path, tmp_path: Path):
    return CliRunner().invoke(app, ["generate", f"d={folder}", "-o", str(tmp_path / "g"), "--dry-run", "-m", "a/b"])


@pytest.mark.parametrize("name", ["state.json", "dataset_dict.json"])
def test_a_deep_save_to_disk_metadata_file_is_one_line(tmp_path, name):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / name).write_text(_DEEP, encoding="utf-8")
    res = _generate_dry_run(folder, tmp_path)
    assert res.exit_code == 2, res.output
    assert _lines(res.output) == [f"error: dataset 'd': {folder / name}: unreadable (nested more than 1024 levels deep)"]


def test_a_deep_run_config_is_one_line(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text(f"x = {_DEEP}\n", encoding="utf-8")
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 2, res.output
    assert _lines(res.output) == [f"error: {path}: invalid TOML: nested too deeply to read"]


def test_a_deep_emulator_config_is_one_line(tmp_path, kimi_dir):
    emulator = tmp_path / "emu.toml"
    emulator.write_text(f"x = {_DEEP}\n", encoding="utf-8")
    res = CliRunner().invoke(app, ["run", str(write_run_config(tmp_path, kimi_dir, emulator=emulator))])
    assert res.exit_code == 2, res.output
    assert _lines(res.output) == [f"error: {emulator}: invalid TOML: nested too deeply to read"]
    assert not (tmp_path / "out" / "exchanges.jsonl").exists()


# --- a FIFO a save_to_disk folder names ---------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_named_by_state_json_is_refused_not_read(tmp_path):
    """Opened, it blocked in pa.memory_map forever; run in a child so a hang fails, not sticks."""
    folder = tmp_path / "hf"
    folder.mkdir()
    os.mkfifo(folder / "f.arrow")
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "f.arrow"}]}), encoding="utf-8")
    code = "from tokenbridge.cli import app; app()"
    proc = subprocess.run([sys.executable, "-c", code, "generate", f"d={folder}", "-o", str(tmp_path / "g"),
                           "--dry-run", "-m", "a/b"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert _lines(proc.stdout + proc.stderr) == [
        f"error: dataset 'd': {folder / 'f.arrow'}: is not a regular file (a folder, FIFO or device)"]


# --- a run that fails before writing anything leaves no folder behind ---------------------


def test_a_run_whose_prompts_cannot_be_read_leaves_no_run_folder(tmp_path, kimi_dir):
    """The run folder is made when its lock is taken, before generate reads the prompts: a
    dataset that failed there left ``out/`` holding only ``.lock``."""
    (tmp_path / "empty").mkdir()
    text = write_run_config(tmp_path, kimi_dir).read_text()
    path = tmp_path / "bad.toml"
    path.write_text(text.replace('path = "builtin:prompts/chat.jsonl"', f'path = "{tmp_path / "empty"}"'),
                    encoding="utf-8")
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 2, res.output
    assert _lines(res.output)[-1] == (f"error: dataset 'chat': {tmp_path / 'empty'} holds no .jsonl/.parquet files "
                                      "and no save_to_disk data")
    assert not (tmp_path / "out").exists()


# --- builtin: names ----------------------------------------------------------------------


def test_a_builtin_path_outside_the_shipped_data_is_refused(tmp_path, kimi_dir):
    text = write_run_config(tmp_path, kimi_dir).read_text()
    path = tmp_path / "trav.toml"
    path.write_text(text.replace("builtin:prompts/chat.jsonl", "builtin:../../../../../etc/passwd"), encoding="utf-8")
    with pytest.raises(PipelineError) as exc:
        load_run_config(path)
    assert str(exc.value) == (
        f"{path}:17: generate.datasets[0].path: no such built-in data 'builtin:../../../../../etc/passwd' "
        "(have: builtin:prompts/chat.jsonl, builtin:prompts/plain.jsonl, builtin:prompts/sharegpt.jsonl)")


# --- a symlink loop given as a path --------------------------------------------------------


def test_a_symlink_loop_given_as_a_path_is_an_error_line_not_a_traceback(tmp_path, kimi_dir):
    """pathlib's resolve() raises RuntimeError on a loop, which no caller expected: a dataset,
    tokenizer or run folder that was one ended in a traceback and exit 8 (a cold tester's)."""
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "loop.jsonl").symlink_to("loop.jsonl")
    gen = tmp_path / "gen.toml"
    gen.write_text(f'model = "moonshotai/kimi-k2.5"\ntokenizer = "{kimi_dir}"\n[[datasets]]\nname = "d"\n'
                   'path = "loop.jsonl"\n')
    text = write_run_config(tmp_path, kimi_dir).read_text()
    run = tmp_path / "loop.toml"
    out_line = next(line for line in text.splitlines() if line.startswith("out = "))
    run.write_text(text.replace(out_line, 'out = "loop"'), encoding="utf-8")
    examples = Path(__file__).resolve().parents[1] / "examples" / "exchanges.jsonl"
    for args in (["generate", "--config", str(gen), "--out", str(tmp_path / "r"), "--dry-run"],
                 ["reconstruct", str(examples), "-o", str(tmp_path / "o.jsonl"), "-t", str(tmp_path / "loop")],
                 ["run", str(run)]):
        res = subprocess.run([sys.executable, "-m", "tokenbridge", *args], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
        assert res.returncode == 2, (args, res.stderr[-3000:])
        assert "Traceback" not in res.stderr and res.stderr.strip().splitlines()[-1].startswith("error: "), res.stderr
