"""Hostile prompt rows: each is one bad-row report (file:line:field), never a crash of generate."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hostile_server import HostileServer
from tokenbridge.generate import GenerateSettings, RequestSettings, agenerate_run
from tokenbridge.generate.prompts import MAX_DEPTH, load_prompts
from tokenbridge.generate.run import ExitCode
from tokenbridge.generate.settings import DatasetSpec

DEEP = "[" * 100_000 + "]" * 100_000


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


BAD_LINES = [  # (JSONL line, expected "line N: field 'F': message" tail)
    ('{"messages": [{"role": ["user"], "content": "hi"}]}', "field 'messages[0].role': unknown role ['user'] "
     "(expected one of ['assistant', 'developer', 'system', 'tool', 'user'])"),
    ('{"messages": [{"role": "user", "content": ' + DEEP + "}]}", "field '<line>': not valid JSON: nested too deep"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "deep": ' + _nested(MAX_DEPTH + 5)
     + "}]}]}", "field 'messages[0].content[0].deep" + "[0]" * (MAX_DEPTH - 3) + "': nested more than 64 levels deep"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "field 'messages[0].content[0].text': must be a string, got int"),
    ('{"messages": [{"role": "user", "content": [{"type": 7, "text": "x"}]}]}',
     "field 'messages[0].content[0]': must be a content part object with a string 'type'"),
    ('{"messages": [{"role": "user", "content": "x", "name": {"a": 1}}]}',
     "field 'messages[0].name': must be a string, got dict"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "f": ' + _nested(200) + "}]}",
     "field 'tools[0].f" + "[0]" * (MAX_DEPTH - 1) + "': nested more than 64 levels deep"),
    ('{"conversations": [{"from": ' + _nested(5000) + ', "value": "x"}]}', None),
]


def _write(tmp_path: Path) -> Path:
    f = tmp_path / "rows.jsonl"
    lines = [line for line, _ in BAD_LINES] + ['{"id": "good", "prompt": "q-good"}']
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f


def test_each_hostile_row_is_one_bad_row_report(tmp_path):
    f = _write(tmp_path)
    loaded = load_prompts([DatasetSpec("r", f)])
    assert [s.id for s in loaded.samples] == ["r-good"]
    got = [str(e) for e in loaded.errors]
    assert len(got) == len(BAD_LINES)
    for i, (want, (_, tail)) in enumerate(zip(got, BAD_LINES), start=1):
        assert want.startswith(f"{f}: line {i}: field '"), want
        if tail is not None:
            assert want == f"{f}: line {i}: {tail}"


@pytest.mark.parametrize("depth", [MAX_DEPTH - 5])  # messages[0].content[0].meta is 4 levels down
def test_nesting_within_the_limit_is_sent(tmp_path, depth):
    f = tmp_path / "ok.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "meta": json.loads(_nested(depth))}]}]}) + "\n", encoding="utf-8")
    loaded = load_prompts([DatasetSpec("r", f)])
    assert loaded.errors == [] and len(loaded.samples) == 1


def test_generate_reports_hostile_rows_and_sends_the_good_one(tmp_path):
    f = _write(tmp_path)
    with HostileServer() as srv:
        settings = GenerateSettings(datasets=(DatasetSpec("r", f),), request=RequestSettings(model="m", max_tokens=8),
                                    base_url=srv.url, concurrency=1, progress="none")
        summary = asyncio.run(agenerate_run(settings, tmp_path / "run"))
        assert dict(srv.attempts) == {"q-good": 1}
    assert (summary.done, summary.exit_code, len(summary.bad_rows)) == (1, ExitCode.INCOMPLETE, len(BAD_LINES))
    saved = json.loads((tmp_path / "run" / "generate.json").read_text())
    assert saved["bad_rows"] == summary.bad_rows
