"""generate against a hostile server: bad usage, bad bodies, echoed keys, endless replies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import zlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import write_prompts
from hostile_server import HostileServer, key_leaks
from tokenbridge.cli import app
from tokenbridge.generate import GenerateSettings, RequestSettings, Store, agenerate_run, write_exchanges
from tokenbridge.generate.run import ExitCode
from tokenbridge.generate.secrets import ApiKey
from tokenbridge.generate.settings import DatasetSpec, Prices

CANARY = "sk-or-v1-canary7f3e9a1b2c4d6e8f0a1b2c3d4e5f6a7b8c9d"
KEY = ApiKey("TB_CANARY", CANARY)
SLASH_KEY = "sk-test/abcdefghijklmnopqrstuvwxyz0123"  # a cold attack's: its '/' echoed as JSON's '\/'


@pytest.fixture
def server():
    with HostileServer() as srv:
        yield srv


def _prompts(tmp_path: Path, n: int) -> DatasetSpec:
    return DatasetSpec("h", write_prompts(tmp_path, n))


def _settings(url: str, spec: DatasetSpec, **kw) -> GenerateSettings:
    base = dict(datasets=(spec,), request=RequestSettings(model="m", max_tokens=16), base_url=url, concurrency=1,
                max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.02, progress="none", timeout_s=10.0)
    base.update(kw)
    return GenerateSettings(**base)


def _run(server: HostileServer, tmp_path: Path, n: int, **kw):
    return asyncio.run(agenerate_run(_settings(server.url, _prompts(tmp_path, n), **kw), tmp_path / "run", key=KEY))


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "run" / "exchanges.jsonl").read_bytes().split(b"\n") if x]


# --- item 1: usage values never kill a background task ------------------------------------


@pytest.mark.parametrize(("raw", "shown"), [('"abc"', '"abc"'), ("[1]", "[1]"), ('{"n": 1}', '{"n":1}'), ("-3", "-3"),
                                            ("true", "true"), ("1e300", "1e+300"), ("2.5", "2.5")])
def test_unusable_completion_tokens_keep_the_response_and_every_later_one(server, tmp_path, raw, shown):
    server.plan["q0"] = [f"usage:completion_tokens={raw}"]
    summary = _run(server, tmp_path, 4)
    assert (summary.done, summary.failed, summary.pending, summary.exit_code) == (4, 0, 0, ExitCode.OK)
    assert [r["id"] for r in _rows(tmp_path)] == ["h-0", "h-1", "h-2", "h-3"]
    assert summary.bad_usage == 1 and summary.bad_usage_examples == [f"h-0: usage.completion_tokens = {shown}"]
    assert summary.completion_tokens == 3 * 3 and summary.prompt_tokens == 4 * 5  # h-0's bad count counted as 0
    assert json.loads(json.dumps(_rows(tmp_path)[0]["response"]["usage"]["completion_tokens"])) == json.loads(raw)
    with Store.open(tmp_path / "run") as store:
        (usage,) = store._conn.execute("SELECT usage FROM responses WHERE sample_id='h-0'").fetchone()
        assert json.loads(usage) == {"prompt_tokens": 5, "cost": 0.0001}  # only what accounting may trust
        assert store.token_totals()[:2] == (20, 9)


def test_a_stored_value_nested_too_deeply_to_read_is_an_unreadable_one(server, tmp_path):
    """Stores of older versions kept usage unchecked: one nested deeper than the stdlib
    reads was a RecursionError out of the totals, where an unreadable one counts as absent."""
    _run(server, tmp_path, 4)
    with Store.open(tmp_path / "run") as store:
        assert store.token_totals()[:2] == (20, 12)
        with store._conn:
            store._conn.execute("UPDATE responses SET usage=? WHERE sample_id='h-0'", ("[" * 100_000,))
            store._conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('exchanges', ?)", ("[" * 100_000,))
        assert store.token_totals()[:2] == (15, 9)
        assert store.exchanges_record() is None


def test_usage_that_is_not_an_object_is_treated_as_absent(server, tmp_path):
    server.plan["q1"] = ["usage_not_object"]
    summary = _run(server, tmp_path, 3)
    assert (summary.done, summary.exit_code, summary.bad_usage) == (3, ExitCode.OK, 1)
    assert summary.bad_usage_examples == ["h-1: usage is a str, not an object"]


@pytest.mark.parametrize("field", ["prompt_tokens=1e400", "cost=1" + "0" * 400])
def test_a_1e400_token_count_is_a_retried_bad_json_attempt(server, tmp_path, field):
    """An integer cost past float's range too (a cold tester's): math.isfinite raised
    OverflowError on it first, an internal error that kept nothing, on every rerun."""
    server.plan["q0"] = [f"usage:{field}", "ok"]
    summary = _run(server, tmp_path, 3)
    assert (summary.done, summary.exit_code, summary.errors) == (3, ExitCode.OK, {"bad_json": 1})
    with Store.open(tmp_path / "run") as store:
        (first, second) = store.attempts("h-0")
    assert first.error_class == "bad_json" and "infinity" in first.message and second.error_class is None


def test_a_dead_store_writer_stops_the_run_with_a_nonzero_exit(server, tmp_path, monkeypatch):
    from tokenbridge.generate import engine

    real_run = engine.StoreWriter.run

    async def dying_run(self):  # the first commit goes through, then the task dies of a bug
        self.failure("h-0", "x", "y", lambda: (_ for _ in ()).throw(RuntimeError("bug in a callback")))
        await real_run(self)

    monkeypatch.setattr(engine.StoreWriter, "run", dying_run)
    summary = _run(server, tmp_path, 3)
    assert summary.exit_code == ExitCode.INTERNAL and summary.stop_reason == "internal_error"
    assert any(n.startswith("stopping: internal error in the store writer (RuntimeError: bug in a callback)")
               for n in summary.notices)


# --- item 2: bodies are kept only if they can be re-emitted -------------------------------


def test_invalid_utf8_in_a_pretty_body_is_refused_at_the_boundary(server, tmp_path):
    server.plan["q0"] = ["bad_utf8_pretty", "pretty"]
    summary = _run(server, tmp_path, 2)
    assert (summary.done, summary.exit_code, summary.errors) == (2, ExitCode.OK, {"bad_json": 1})
    with Store.open(tmp_path / "run") as store:
        first = store.attempts("h-0")[0]
        body, _ = store.response("h-0")
    assert first.message.startswith("body is not valid UTF-8 (byte 0xff at offset ")
    assert b"\n" in body  # stored as received: pretty
    line = (tmp_path / "run" / "exchanges.jsonl").read_bytes().split(b"\n")[0]
    assert b'"response":{   "id": "gen-1",   "object"' in line  # the same bytes, line breaks as spaces
    assert write_exchanges(tmp_path / "run").is_file()  # and again: nothing stored can break it


def test_stored_rows_of_older_versions_that_cannot_be_re_emitted_are_reported_not_fatal(server, tmp_path):
    summary = _run(server, tmp_path, 3)
    assert summary.done == 3
    with Store.open(tmp_path / "run") as store:  # what older versions accepted
        store._conn.execute("UPDATE responses SET body=? WHERE sample_id='h-1'", (b'{\n"t": "caf\xff"\n}',))
        store._conn.execute("UPDATE responses SET body=? WHERE sample_id='h-2'", (b'{"t": "\\ud800"}',))
        store._conn.execute("UPDATE responses SET body=? WHERE sample_id='h-0'", ('{"t": "text"}',))  # TEXT, not BLOB
    with pytest.warns(UserWarning, match=r"2 stored response\(s\) cannot be re-emitted and were left out \(e.g. h-1: "):
        path = write_exchanges(tmp_path / "run")
    rows = [json.loads(x) for x in path.read_bytes().split(b"\n") if x]
    assert [(r["id"], r["response"]) for r in rows] == [("h-0", {"t": "text"})]
    again = _run(server, tmp_path, 3)
    assert (again.exit_code, again.bad_stored, again.requests) == (ExitCode.OK, 2, 0)
    assert any("2 stored response(s) cannot be re-emitted" in n and "h-1: body is not valid UTF-8" in n
               for n in again.notices)


def test_repeated_choice_indexes_are_a_retried_attempt(server, tmp_path):
    server.plan["q0"] = ["repeat_index", "ok"]
    summary = _run(server, tmp_path, 1)
    assert (summary.done, summary.errors) == (1, {"bad_choices": 1})
    assert len(_rows(tmp_path)[0]["response"]["choices"]) == 1


# --- a 200 that is not kept was still paid for: billed, and its bytes stored ------------------

_PRICES = Prices(prompt=1.0, completion=1.0)


@pytest.mark.parametrize(("mode", "error_class"), [("repeat_index:0.25", "bad_choices"), ("nan_field:0.25", "bad_json")])
def test_a_paid_200_that_is_not_kept_is_billed_and_its_bytes_stored(server, tmp_path, mode, error_class):
    server.plan["q0"] = [mode]
    summary = _run(server, tmp_path, 1, prices=_PRICES)
    assert (summary.done, summary.failed, summary.errors) == (0, 1, {error_class: 3})
    assert (summary.spent_total, summary.spent_possible) == (pytest.approx(0.75), 0.0)  # 3 x usage.cost
    with Store.open(tmp_path / "run") as store:
        rows = store.attempts("h-0")
    assert [(a.http_status, a.error_class, a.cost, a.possible_cost) for a in rows] == [(200, error_class, 0.25, None)] * 3
    assert [a.body for a in rows] == server.sent["q0"] and len(set(server.sent["q0"])) == 1


def test_a_paid_200_that_is_not_kept_counts_against_max_cost(server, tmp_path):
    server.plan["q0"] = ["repeat_index:0.25"]
    summary = _run(server, tmp_path, 2, prices=_PRICES, max_cost=0.001)
    assert (summary.stop_reason, summary.exit_code, summary.requests) == ("budget_reached", ExitCode.BUDGET, 1)
    assert summary.spent_total == pytest.approx(0.25)
    again = _run(server, tmp_path, 2, prices=_PRICES, max_cost=0.001)  # a resume starts from what was billed
    assert (again.requests, again.spent_total, again.exit_code) == (0, pytest.approx(0.25), ExitCode.BUDGET)


def test_a_200_that_is_not_json_is_booked_at_its_reservation_and_its_bytes_stored(server, tmp_path):
    from tokenbridge.generate.budget import estimate_prompt_tokens

    server.plan["q0"] = ["cut_json", "ok"]
    summary = _run(server, tmp_path, 1, prices=_PRICES, max_cost=10.0)
    with Store.open(tmp_path / "run") as store:
        (sample,) = store.samples()
        first, second = store.attempts("h-0")
    reservation = _PRICES.cost(estimate_prompt_tokens(sample.request), 16)
    assert (summary.done, summary.errors) == (1, {"bad_json": 1})
    assert (summary.spent_total, summary.spent_possible) == (pytest.approx(0.0001), pytest.approx(reservation))
    assert (first.error_class, first.cost, first.possible_cost) == ("bad_json", None, pytest.approx(reservation))
    assert first.body == server.sent["q0"][0] == json.dumps(_ok_doc()).encode()[:60]
    assert (second.error_class, second.body) == (None, None)  # a kept answer lives in responses only


def _ok_doc() -> dict:
    from hostile_server import _ok

    return _ok()


# --- item 3: the key never lands anywhere, in any encoding ----------------------------------


def _everything_written(root: Path) -> dict[str, bytes]:
    out = {}
    for path in root.rglob("*"):
        if path.is_file():
            out[str(path)] = path.read_bytes()
    for db in root.rglob("state.sqlite"):
        conn = sqlite3.connect(db)
        try:
            for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'"):
                for row in conn.execute(f"SELECT * FROM {table}"):
                    for i, v in enumerate(row):
                        if isinstance(v, bytes):
                            with contextlib.suppress(zlib.error):
                                v = zlib.decompress(v)
                        out[f"{db}:{table}:{i}:{row[0]}"] = v if isinstance(v, bytes) else str(v).encode()
        finally:
            conn.close()
    return out


def _generate_and_downstream(tmp_path: Path, server: HostileServer, kimi_dir: Path, monkeypatch, *extra: str,
                             key: str = CANARY):
    monkeypatch.setenv("TB_CANARY", key)
    run = tmp_path / "run"
    spec = _prompts(tmp_path, 2)
    runner = CliRunner()
    outputs = []
    res = runner.invoke(app, ["generate", f"h={spec.path}", "--out", str(run), "--base-url", server.url, "--model", "m",
                              "--api-key-env", "TB_CANARY", "--progress", "none", "--max-attempts", "1", *extra])
    outputs.append(res.output + res.stderr)
    assert res.exit_code == 1, res.output + res.stderr  # h-0 failed, h-1 done
    res = runner.invoke(app, ["reconstruct", str(run / "exchanges.jsonl"), "-o", str(run / "reconstructed.jsonl"),
                              "-t", str(kimi_dir), "-j", "1"])
    outputs.append(res.output + res.stderr)
    assert (run / "reconstructed.jsonl").is_file(), res.output
    res = runner.invoke(app, ["export", str(run / "reconstructed.jsonl"), "-o", str(run / "export" / "conversations"),
                              "-f", "conversations", "--include-flagged"])
    outputs.append(res.output + res.stderr)
    written = _everything_written(tmp_path)
    written["cli output"] = "\n".join(outputs).encode()
    return written


@pytest.mark.parametrize("form", ["raw", "json_escaped", "url", "base64"])
def test_an_echoed_key_is_masked_in_every_form_everywhere(server, tmp_path, kimi_dir, monkeypatch, form):
    server.plan["q0"] = [f"echo_error:{form}"]  # key at characters 459..500 of a long error message
    server.plan["q1"] = [f"echo_ok:{form}"]  # key in a kept answer, which reconstruct decodes
    written = _generate_and_downstream(tmp_path, server, kimi_dir, monkeypatch)
    leaks = {name: key_leaks(data, CANARY) for name, data in written.items()}
    assert {k: v for k, v in leaks.items() if v} == {}
    rows = [json.loads(x) for x in (tmp_path / "run" / "reconstructed.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["h-1"] and "***" in rows[0]["content"]


#: How a kept answer quoting the key in each form reads after reconstruct.
_SHOWN = {"mime_base64": "QmVhcmVyIH***A==\n",  # "Bearer " and the padding stay
          "json_short": "***", "starred": "*******"}  # starred: the mask, then the server's stars


@pytest.mark.parametrize(("key", "form"), [(CANARY, "mime_base64"), (SLASH_KEY, "json_short"), (CANARY, "starred")])
def test_a_key_echoed_wrapped_escaped_or_starred_is_masked_everywhere(server, tmp_path, kimi_dir, monkeypatch,
                                                                      key, form):
    """A cold attack stored these: MIME base64 of the header (wrapped every 76 characters),
    a key's '/' as JSON's '\\/', and all of a key but its last four characters, in an error
    message and in a kept answer, which reconstruct decodes (the raw key reached
    reconstructed.jsonl)."""
    server.plan["q0"] = [f"echo_error:{form}"]
    server.plan["q1"] = [f"echo_ok:{form}"]
    written = _generate_and_downstream(tmp_path, server, kimi_dir, monkeypatch, key=key)
    assert {name: found for name, data in written.items() if (found := key_leaks(data, key))} == {}
    rows = [json.loads(x) for x in (tmp_path / "run" / "reconstructed.jsonl").read_text().splitlines()]
    assert [(r["id"], r["content"]) for r in rows] == [("h-1", f"your key is {_SHOWN[form]} ok")]


@pytest.mark.parametrize(("how", "why"), [("not_json", "is not JSON"), ("array", "is not an object")])
def test_a_refused_stream_chunk_is_masked_before_it_is_clipped(server, tmp_path, kimi_dir, monkeypatch, how, why):
    """A cold attack placed the key so the quote of a refused chunk (its first 200
    characters) cut it one short: the mask that came after found no key, and 50 of its 51
    characters were stored and printed."""
    server.plan["q0"] = [f"bad_chunk_sse:{how}"]
    written = _generate_and_downstream(tmp_path, server, kimi_dir, monkeypatch, "--stream")
    assert {name: found for name, data in written.items() if (found := key_leaks(data, CANARY))} == {}
    conn = sqlite3.connect(tmp_path / "run" / "state.sqlite")
    try:
        (message,) = conn.execute("SELECT error FROM samples WHERE id = 'h-0'").fetchone()
    finally:
        conn.close()
    assert f"stream chunk {why}" in message and "AAAA***" in message


def test_classify_masks_a_decoded_message_before_clipping_it():
    """A key whose URL-encoding is JSON-escaped (each '%' as \\u0025) is no key in the raw
    body; decoding the JSON makes one, which a clip at 500 characters then cut short."""
    from tokenbridge.generate.classify import classify_response

    spelled = "".join(f"\\u0025{ord(c):02X}" for c in CANARY)
    body = '{"error": {"code": 401, "message": "' + "x" * (500 - 3 * len(CANARY) + 3) + spelled + '"}}'
    out, _ = classify_response(401, {}, body.encode(), key=KEY)
    assert out.message == "x" * (500 - 3 * len(CANARY) + 3) + "***"


def test_a_usage_problem_masks_the_value_before_clipping_it():
    from tokenbridge.generate.body import checked_usage

    problems = checked_usage({"usage": {"prompt_tokens": "n=" + CANARY, "cost": [CANARY]}}, key=KEY).problems
    assert problems == ['usage.prompt_tokens = "n=***"', 'usage.cost = ["***"]']


def test_a_key_split_across_sse_events_is_masked_and_its_raw_stream_not_kept(server, tmp_path, kimi_dir, monkeypatch):
    server.plan["q0"] = ["echo_error:raw"]
    server.plan["q1"] = ["split_key_sse"]
    written = _generate_and_downstream(tmp_path, server, kimi_dir, monkeypatch, "--stream")
    leaks = {name: key_leaks(data, CANARY) for name, data in written.items()}
    assert {k: v for k, v in leaks.items() if v} == {}
    with Store.open(tmp_path / "run") as store:
        body, raw = store.response("h-1")
    assert raw is None and json.loads(body)["choices"][0]["message"]["content"] == "key: *** end"


# --- item 7: limits ------------------------------------------------------------------------


def test_an_endless_body_is_cut_at_max_response_bytes_and_fails_the_sample(server, tmp_path):
    server.plan["q0"] = ["endless"]
    summary = _run(server, tmp_path, 2, max_response_bytes=1 << 20)
    assert (summary.done, summary.failed, summary.exit_code) == (1, 1, ExitCode.INCOMPLETE)
    assert summary.failures == [{"id": "h-0", "error_class": "response_too_large",
                                 "error": "response passed max_response_bytes=1048576 while being read"}]
    assert summary.spent_possible > 0 or summary.spent_total >= 0  # booked as maybe billed, never dropped


def test_an_endless_error_page_is_cut_and_retried_by_its_status(server, tmp_path):
    server.plan["q0"] = ["endless:503", "ok"]
    summary = _run(server, tmp_path, 1, max_response_bytes=1 << 20)
    assert (summary.done, summary.errors) == (1, {"http_503": 1})
    with Store.open(tmp_path / "run") as store:
        assert store.attempts("h-0")[0].message == "HTTP 503: response passed max_response_bytes=1048576 while being read"


def test_a_stream_of_keepalive_comments_only_ends_at_attempt_timeout(server, tmp_path):
    server.plan["q0"] = ["keepalive_only"]
    summary = _run(server, tmp_path, 1, stream=True, attempt_timeout_s=0.5, read_timeout_s=30.0, max_attempts=2)
    assert (summary.done, summary.failed, summary.errors) == (0, 1, {"timeout": 2})
    assert summary.failures[0]["error"] == "gave up after 2 attempts: attempt took longer than attempt_timeout_s=0.5 s in all"
    assert summary.elapsed_s < 20


def test_limits_are_validated():
    from tokenbridge.generate.settings import ConfigError, settings_from_mapping

    assert GenerateSettings().attempt_timeout_s == 900.0 and GenerateSettings().max_response_bytes == 64 * 1024 * 1024
    for bad in ({"attempt_timeout_s": 0}, {"max_response_bytes": 10}, {"max_response_bytes": 1.5}):
        with pytest.raises(ConfigError):
            settings_from_mapping(bad)
    with pytest.raises(ConfigError):
        GenerateSettings(attempt_timeout_s=float("nan"))


# --- item 10: implausible usage.cost never lifts --max-cost -------------------------------


@pytest.mark.parametrize(("raw", "shown"), [("-5", "-5"), ('"NaN"', '"NaN"'), ("1e300", "1e+300"), ("true", "true")])
def test_an_implausible_cost_is_ignored_for_prices_and_reported(server, tmp_path, raw, shown):
    server.plan["q0"] = [f"usage:cost={raw}"]
    prices = Prices(prompt=1.0, completion=1.0)  # USD per million tokens: 8 tokens = $0.000008
    summary = _run(server, tmp_path, 3, max_cost=10.0, prices=prices)
    assert (summary.done, summary.exit_code, summary.bad_usage) == (3, ExitCode.OK, 1)
    assert summary.bad_usage_examples == [f"h-0: usage.cost = {shown}"]
    assert summary.spent_total == pytest.approx(0.000008 + 2 * 0.0001)


def test_a_negative_cost_cannot_switch_max_cost_off(server, tmp_path):
    for i in range(6):
        server.plan[f"q{i}"] = ["usage:cost=-1000"]
    prices = Prices(prompt=0.0, completion=1e4)  # a response (3 tokens) costs $0.03, the worst case (16) $0.16
    summary = _run(server, tmp_path, 6, max_cost=0.235, prices=prices)
    assert (summary.exit_code, summary.done, summary.pending) == (ExitCode.BUDGET, 3, 3)
    assert summary.spent_total == pytest.approx(0.09) and summary.bad_usage == 3


def test_without_prices_a_negative_cost_stops_a_capped_run_instead_of_lifting_the_cap(server, tmp_path):
    for i in range(4):
        server.plan[f"q{i}"] = ["usage:cost=-1000"]
    summary = _run(server, tmp_path, 4, max_cost=1.0)
    assert summary.exit_code == ExitCode.BUDGET and summary.done == 1 and summary.spent_total == 0


def test_cli_flags_set_both_limits(server, tmp_path):
    server.plan["q0"] = ["endless"]
    server.plan["q1"] = ["hang"]
    spec = _prompts(tmp_path, 2)
    res = CliRunner().invoke(app, ["generate", f"h={spec.path}", "--out", str(tmp_path / "run"), "--base-url", server.url,
                                   "--model", "m", "--progress", "none", "--max-attempts", "1",
                                   "--max-response-bytes", "4096", "--attempt-timeout", "0.3"])
    assert res.exit_code == ExitCode.INCOMPLETE, res.output + res.stderr
    assert "failed: h-0: response_too_large: response passed max_response_bytes=4096 while being read" in res.stderr
    assert "failed: h-1: timeout: gave up after 1 attempts: attempt took longer than attempt_timeout_s=0.3 s" in res.stderr


@pytest.mark.parametrize("encoded", [
    CANARY,
    "".join(f"\\u{ord(c):04X}" if i % 3 else c for i, c in enumerate(CANARY)),  # upper-case hex
    "".join(f"\\\\u{ord(c):04x}" for c in CANARY),  # escaped twice (a JSON string inside a JSON string)
    "".join(f"%{ord(c):02x}" for c in CANARY),  # lower-case percent-encoding
    __import__("base64").urlsafe_b64encode(b"xy" + CANARY.encode()).decode(),
    __import__("base64").b64encode(CANARY.encode() + b"\n").decode(),
])
def test_scrub_masks_each_encoding_of_the_key(encoded):
    from tokenbridge.generate.secrets import scrub, scrub_bytes

    text = f"before {encoded} after"
    assert key_leaks(scrub(text, KEY).encode(), CANARY) == []
    assert key_leaks(scrub_bytes(text.encode(), KEY), CANARY) == []
    assert key_leaks(text.encode(), CANARY) != []  # the oracle does see it unmasked
    assert scrub("sk-or-v1-other-key", KEY) == "sk-or-v1-other-key"


@pytest.mark.parametrize(("chunk", "why"), [
    ('{"choices": [{"index": "0", "delta": {"content": "x"}}]}', "choice index '0', not a non-negative integer"),
    ('{"choices": [{"index": 0, "delta": ["x"]}]}', "choice delta that is a list, not an object"),
    ('{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": [1]}]}}]}', "tool call index [1], not an integer"),
    ('{"choices": [{"index": 0, "delta": {"content": "x"}}], "usage": {"cost": NaN}}', "not JSON"),
    ('{"choices": [{"index": 0, "delta": {"content": "\\ud800"}}]}', "not JSON"),
])
def test_a_hostile_stream_chunk_is_a_stream_error(chunk, why):
    from tokenbridge.generate.sse import SSEEvent, StreamAssembler, StreamError

    with pytest.raises(StreamError, match=why.replace("[", r"\[").replace("]", r"\]")):
        StreamAssembler().add_event(SSEEvent(chunk))


def test_a_billed_error_reply_still_counts_against_the_budget(server, tmp_path):
    server.plan["q0"] = ["choice_error_billed:0.25", "ok"]
    summary = _run(server, tmp_path, 1)
    assert (summary.done, summary.errors) == (1, {"choice_error": 1})
    assert summary.spent_total == pytest.approx(0.25 + 0.0001)


def test_answers_without_finish_reason_are_bounded_kept_and_said(server, tmp_path):
    """A provider that never sends finish_reason is paid max_attempts (3) times a prompt: the
    retries stop there, every paid body stays in its attempt row, and the summary says how
    many prompts it happened to, in words, not only inside choice_error's count."""
    server.plan["q0"] = ["finish:missing"]
    server.plan["q1"] = ["finish:empty", "finish:null", "ok"]
    summary = _run(server, tmp_path, 3)
    assert (summary.done, summary.failed, summary.exit_code) == (2, 1, ExitCode.INCOMPLETE)
    assert (server.attempts["q0"], server.attempts["q1"], server.attempts["q2"]) == (3, 3, 1)
    assert summary.errors == {"choice_error": 5}
    assert (summary.no_finish, summary.no_finish_attempts, summary.no_finish_failed) == (2, 5, 1)
    assert summary.no_finish_examples == ["h-0", "h-1"]
    assert summary.no_finish_cost == pytest.approx(5 * 0.0001)
    assert summary.spent_total == pytest.approx(7 * 0.0001)  # every attempt booked
    assert summary.failures == [{"id": "h-0", "error_class": "choice_error",
                                 "error": "gave up after 3 attempts: a choice came without finish_reason: it did not finish"}]
    with Store.open(tmp_path / "run") as store:
        for sid, prompt, n in (("h-0", "q0", 3), ("h-1", "q1", 2)):
            kept = [(a.error_class, a.cost, a.body) for a in store.attempts(sid)][:n]
            assert kept == [("choice_error", 0.0001, body) for body in server.sent[prompt][:n]]
    assert [r["id"] for r in _rows(tmp_path)] == ["h-1", "h-2"]
    assert any(n.startswith("some answers come without finish_reason (e.g. h-0): each is sent again, up to "
                            "max_attempts=3 per prompt") for n in summary.notices)
    from tokenbridge.generate.outcome import describe_run, no_finish_line
    assert no_finish_line(summary) == (
        "2 prompts got answers without finish_reason: 5 attempts, paid for ($0.0005 reported) and sent again up to "
        "max_attempts; 1 of those prompts failed, never answered with one (e.g. h-0, h-1); the answers are kept in "
        "the attempt rows of state.sqlite, not in exchanges.jsonl")
    assert describe_run(summary).endswith("; 2 prompts got answers without finish_reason (5 billed attempts).")


def test_generate_prints_how_many_prompts_got_answers_without_finish_reason(server, tmp_path):
    server.plan["q0"] = ["finish:missing"]
    spec = _prompts(tmp_path, 2)
    res = CliRunner().invoke(app, ["generate", f"h={spec.path}", "--out", str(tmp_path / "run"), "--base-url", server.url,
                                   "--model", "m", "--progress", "none", "--max-attempts", "2"])
    assert res.exit_code == ExitCode.INCOMPLETE, res.output + res.stderr
    assert ("note: 1 prompt got answers without finish_reason: 2 attempts, paid for ($0.0002 reported) and sent again "
            "up to max_attempts; 1 of those prompts failed, never answered with one (e.g. h-0); the answers are kept "
            "in the attempt rows of state.sqlite, not in exchanges.jsonl\n") in res.stderr


def test_the_budget_stop_notice_prints_small_amounts_with_their_digits(server, tmp_path):
    """The cap's stop line, as the engine prints it (``Budget.stop_message``, whose other cases
    tests/test_generate_units.py holds): ``$0.00`` hid a $0.001 cap and a $0.00037 request."""
    server.plan["q0"] = ["repeat_index:0.25"]
    summary = _run(server, tmp_path, 2, prices=_PRICES, max_cost=0.001)
    assert summary.stop_reason == "budget_reached"
    # the $0.25 answer cost more than the $0.00037 [prices] reserved: the table is dropped, and
    # the next request is priced by that answer (a loose bound, $17.70)
    assert [n for n in summary.notices if n.startswith(("stopping:", "budget:"))] == [
        "budget: an answer cost $0.25, more than the $0.00037 [prices] reserved for it (prices below the provider's, "
        "or more completion tokens than max_tokens reserved): [prices] no longer prices requests in this run; they go "
        "one at a time until answers bear a price out",
        "stopping: budget $0.001 reached (spent $0.25; the next request's worst case, $17.70, does not fit); one "
        "request's worst case alone is above the cap (raise --max-cost or lower max_tokens)"]


@pytest.mark.parametrize("how", ["hang", "slow:1.0"])
def test_without_prices_a_possibly_billed_timeout_stops_a_capped_run(server, tmp_path, how):
    """A cold tester's server billed each request and answered after the client gave up: with
    nothing priced the timeouts booked nothing and stopped nothing ($4.80 against a $1 cap).
    A request that may have been billed and got no answer is of unknown cost like an answer
    without one: the capped run stops at the first (one request in flight until something is
    priced), exit 4, saying so."""
    for i in range(4):
        server.plan[f"q{i}"] = [how] * 3
    summary = _run(server, tmp_path, 4, max_cost=1.0, attempt_timeout_s=0.3)
    assert (summary.exit_code, summary.done) == (ExitCode.BUDGET, 0)
    assert sum(server.attempts.values()) == 1
    assert any("a request that may have been billed got no HTTP answer" in n for n in summary.notices), summary.notices
    # a price learned that cannot bound the next request (an answer of no completion tokens): a
    # learning send, reserved 0, is of unknown cost the same (a reviewer's: 22 sent, $8.80 vs $1)
    server.attempts.clear()
    server.plan["q0"] = ["usage_only:prompt_tokens=5,completion_tokens=0,cost=0.4"]
    for i in range(1, 4):
        server.plan[f"q{i}"] = [how] * 3
    (tmp_path / "learning").mkdir()
    summary = _run(server, tmp_path / "learning", 4, max_cost=1.0, attempt_timeout_s=0.3)
    assert (summary.exit_code, summary.done, sum(server.attempts.values())) == (ExitCode.BUDGET, 1, 2)
    # an HTTP error reply that counts tokens is an answer (retried as before), not a lost request
    server.attempts.clear()
    server.plan["q0"] = ["error_usage:503", "ok"]
    for i in range(1, 4):
        server.plan[f"q{i}"] = ["ok"]
    (tmp_path / "error").mkdir()
    summary = _run(server, tmp_path / "error", 4, max_cost=1.0)
    assert (summary.exit_code, summary.done, summary.errors) == (ExitCode.OK, 4, {"http_503": 1})
    # zero prices (a free model) price every request: timeouts then book $0 and retry as before
    for i in range(4):
        server.plan[f"q{i}"] = [how] * 3
    (tmp_path / "free").mkdir()
    summary = _run(server, tmp_path / "free", 4, max_cost=1.0, attempt_timeout_s=0.3, prices=Prices(prompt=0.0, completion=0.0),
                   max_attempts=1)
    assert (summary.exit_code, summary.errors) == (ExitCode.INCOMPLETE, {"timeout": 4})


def test_a_stop_for_a_request_no_price_bounds_says_what_it_was_and_why_no_price_held():
    """A reviewer's: the stop messages said "nothing is priced yet (no [prices] ...)" when
    prices had been learned, or [prices] given and proven too low; and a request that went out
    and met an internal error booked nothing and stopped nothing."""
    from tokenbridge.generate.budget import Budget

    fresh = Budget(max_cost=1.0, prices=None)
    fresh.settle(fresh.admit(1000, 500) or 0.0, None, possible=True, lost=True)
    assert fresh.exhausted and "nothing is priced yet" in fresh.stop_message(1000, 500, default_reserve=False)
    learned = Budget(max_cost=1.0, prices=None)
    learned.observe("P", 0, 100, 0.01)  # a price that cannot bound a request with prompt tokens
    learned.settle(0.0, None, possible=True, unread=True)
    text = learned.stop_message(1000, 500, default_reserve=False)
    assert learned.exhausted and "what answers cost so far cannot bound" in text and "could not be read whole" in text
    overrun = Budget(max_cost=1.0, prices=Prices(prompt=0.01, completion=0.01))
    overrun.overrun = (0.5, 0.001)
    overrun.settle(0.0, None, possible=True, answered=True)
    text = overrun.stop_message(1000, 500, default_reserve=False)
    assert "[prices] proved too low" in text and "raise [prices]" in text and "carried no usage.cost" in text
