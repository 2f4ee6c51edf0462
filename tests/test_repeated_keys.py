"""An object that gives a key twice (``{"content": "a", "content": "b"}``) is read one way
by orjson and the stdlib (the last value) and another by other readers (the first): which
value the sender meant no reader can tell. Every JSON line from outside is refused so,
naming the object by its path: exchange records (reconstruct, inspect), reconstructed rows
(export), response bodies and stream chunks (generate, a billed and retried attempt)."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import KIMI_DIR
from tokenbridge import jsonl
from tokenbridge.exchanges import RecordError, keys_once, loads_line
from tokenbridge.generate import Store
from tokenbridge.generate.classify import classify_response
from tokenbridge.generate.run import _exchange_line
from tokenbridge.reconstruct import reconstruct_file
from tokenbridge.rows import RowError, iter_rows

TWICE = "appears twice in one object: which value is meant is unclear (readers keep the first or the last)"


# --- the reader: refused exactly when some object repeats a key, at any formatting ----------

@pytest.mark.parametrize(("line", "field", "key"), [
    (b'{"a":1,"a":2}', "", "a"),
    (b'{"a": 1, "b": {"c": 1}, "a": 1}', "", "a"),  # equal values are no excuse
    (b'{"x":{"b":[{"c":1},{"c":1,"d":2,"c":3}]}}', "x.b[1]", "c"),
    (b'{"r":{"m":1,"m":{"k":1}}}', "r", "m"),
    (b'[{"a":1},{"b":2,"b":3}]', "[1]", "b"),
    (b'{"s":"\\ud800","t":{"u":1,"u":2}}', "t", "u"),  # a lone surrogate: the stdlib's path
    (b'\xef\xbb\xbf{"a":1,"a":2}', "", "a"),  # after a byte order mark
])
def test_a_repeated_key_is_refused_naming_its_object(line, field, key):
    for given_as in (line, line.decode("utf-8")):
        with pytest.raises(jsonl.JsonLineError) as refused:
            jsonl.loads_line(given_as)
        assert (refused.value.field, refused.value.detail) == (field, f"the key {key!r} {TWICE}")


@pytest.mark.parametrize("line", [
    b'{"a":1,"b":[{"a":1},{"a":2}]}',  # the same key in different objects
    b'{"a": 1, "b": [1.5, "x"]}',  # the stdlib's separators
    b'{"u":"\\u00e9\\/","f":1e-05,"g":1.0E2,"h":-0.0}',  # escapes and numbers orjson writes otherwise
    b'  {"a":1}\r\n',
    b'{"a":"\\ud800"}',
])
def test_a_line_without_a_repeated_key_reads_as_before(line):
    assert jsonl.loads_line(line) == json.loads(line)


@pytest.mark.parametrize("compact", [True, False])
def test_a_repeated_key_as_deep_as_orjson_reads_is_found(compact):
    """The stdlib, which sees every pair, recurses per level and stops short of the 1024
    levels orjson reads: such a line is still checked, not refused as unreadable."""
    sep = "," if compact else ", "
    inner = "{" + sep.join(['"k":1', '"j":2'] + (['"k":2'] if not compact else [])) + "}"
    line = '{"a":' + "[" * 1020 + inner + "]" * 1020 + "}"
    if compact:
        assert jsonl.loads_line(line).keys() == {"a"}  # (== on 1020 levels would recurse too deep)
        return
    with pytest.raises(jsonl.JsonLineError) as refused:
        jsonl.loads_line(line)
    path = "a" + "[0]" * 1020  # kept at its end, 200 characters
    assert (refused.value.field, refused.value.detail) == ("…" + path[-200:], f"the key 'k' {TWICE}")


def _objects(children: st.SearchStrategy) -> st.SearchStrategy:
    """An object as its list of pairs, keys drawn from few names so that some repeat."""
    return st.lists(st.tuples(_KEYS, children), max_size=4).map(_Pairs)


#: Keys that repeat often, and that end (or are) what a key end looks like from inside a
#: string: a quote, a colon, a backslash.
_KEYS = st.sampled_from(["a", "b", "é", "\\", '"', ":", " :", "a\\", '\\"', '":'])


class _Pairs(list):
    pass


_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
                       | st.text(alphabet='ab":\\ \té', max_size=6), lambda kids: st.lists(kids, max_size=3) | _objects(kids), max_leaves=12)


def _text(value, compact: bool) -> str:
    comma, colon = (",", ":") if compact else (", ", ": ")
    if isinstance(value, _Pairs):
        return "{" + comma.join(json.dumps(k) + colon + _text(v, compact) for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + comma.join(_text(v, compact) for v in value) + "]"
    return json.dumps(value, ensure_ascii=not compact)


def _repeats(value) -> bool:
    if isinstance(value, _Pairs):
        keys = [k for k, _ in value]
        return len(set(keys)) != len(keys) or any(_repeats(v) for _, v in value)
    return isinstance(value, list) and any(_repeats(v) for v in value)


@settings(max_examples=500, deadline=None)
@given(value=_objects(_VALUES), compact=st.booleans())
def test_a_line_is_refused_exactly_when_an_object_in_it_repeats_a_key(value, compact):
    line = _text(value, compact)
    if _repeats(value):
        with pytest.raises(jsonl.JsonLineError, match=TWICE.replace("(", r"\(").replace(")", r"\)")):
            jsonl.loads_line(line)
        with pytest.raises(RecordError):
            keys_once(orjson.loads(line), memoryview(line.encode()))
    else:
        assert jsonl.loads_line(line) == json.loads(line)
        assert keys_once(orjson.loads(line), line.encode()) == json.loads(line)


# --- reconstruct: a bad line naming the object; every other record is written --------------

def _record(rid: str) -> dict:
    return {"id": rid, "request": {"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
            "response": {"choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "reasoning_content": "Add.", "content": "4"}}]}}


@pytest.mark.parametrize("compact", [True, False])
def test_reconstruct_refuses_a_record_that_repeats_a_key_and_writes_the_rest(tmp_path, compact):
    def line(rid: str) -> str:
        return orjson.dumps(_record(rid)).decode() if compact else json.dumps(_record(rid))

    twice = line("b").replace('"content":"4"' if compact else '"content": "4"',
                              '"content":"4","content":"5"' if compact else '"content": "4", "content": "5"')
    in_request = line("c").replace('"role":"user"' if compact else '"role": "user"',
                                   '"role":"user","role":"system"' if compact else '"role": "user", "role": "system"')
    assert twice != line("b") and in_request != line("c")
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([line("a"), twice, in_request, line("d")]) + "\n", encoding="utf-8")
    summary = reconstruct_file(src, tmp_path / "out.jsonl", KIMI_DIR, workers=1)
    assert [(b.line, b.field, b.message) for b in summary.bad_lines] == [
        (2, "response.choices[0].message", f"the key 'content' {TWICE}"),
        (3, "request.messages[0]", f"the key 'role' {TWICE}"),
    ]
    rows = [json.loads(r) for r in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in rows] == ["a", "d"]


def test_inspect_reads_records_through_the_same_check():
    with pytest.raises(RecordError) as refused:
        loads_line('{"id": "x", "request": {}, "response": {"choices": [], "choices": []}}')
    assert (refused.value.field, refused.value.detail) == ("response", f"the key 'choices' {TWICE}")
    with pytest.raises(RecordError) as refused:
        loads_line('{"id": "x", "request": {}, "id": "y"}')
    assert (refused.value.field, refused.value.detail) == ("<line>", f"the key 'id' {TWICE}")


def test_a_row_file_that_repeats_a_key_names_file_line_and_object(tmp_path):
    path = tmp_path / "rows.jsonl"
    row = b'{"id":"x","status":"ok","completion_ids":[1],"completion_ids":[2]}'
    path.write_bytes(b"\n" + row + b"\n")
    with pytest.raises(RowError) as refused:
        list(iter_rows(path))
    assert str(refused.value) == f"{path}:2: <line>: the key 'completion_ids' {TWICE}"


# --- generate: a body or a chunk that repeats a key is a billed, retried attempt -------------

def test_a_200_body_that_repeats_a_key_is_a_billed_bad_json_with_the_key_masked():
    from test_generate_engine import KEY

    usage = '"usage":{"prompt_tokens":3,"completion_tokens":2,"cost":0.25}'
    body = ('{"choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"4","content":"5"}}],'
            + usage + "}")
    out, parsed = classify_response(200, {}, body)
    assert (out.kind, out.error_class, out.maybe_billed) == ("retry", "bad_json", True)
    assert out.message == f"body at choices[0].message: the key 'content' {TWICE}"
    assert parsed is not None and parsed["usage"]["cost"] == 0.25  # read leniently: its cost is booked
    hostile = body.replace('"content":"5"', f'"{KEY.value}":"5","{KEY.value}":"6"')
    out, _ = classify_response(200, {}, hostile, key=KEY)
    assert KEY.value not in out.message and "appears twice" in out.message


def test_a_stream_chunk_that_repeats_a_key_is_a_billed_bad_stream(tmp_path):
    from aiohttp import web

    from test_generate_engine import Script, _chunk, _run, _sse
    from tokenbridge.generate.settings import Prices

    usage = {"prompt_tokens": 10, "completion_tokens": 5, "cost": 0.5}
    twice = b'{"choices":[{"index":0,"delta":{"content":"a","content":"b"},"finish_reason":null}]}'
    stream = _sse([_chunk({"role": "assistant", "content": "hello"}), twice, _chunk({}, "stop"),
                   _chunk({}, None, usage=usage) | {"choices": []}], comments=False)

    async def reply(prompt, attempt, body, request):
        good = _sse([_chunk({"content": "ok"}, "stop", usage=usage | {"cost": 0.001})])
        return web.Response(body=stream if attempt == 1 else good, headers={"Content-Type": "text/event-stream"})

    summary = _run(Script(reply), tmp_path, 1, stream=True, max_cost=10.0, prices=Prices(prompt=1.0, completion=1.0))
    assert (summary.done, summary.errors) == (1, {"bad_stream": 1})
    assert summary.spent_total == pytest.approx(0.501)  # the refused stream's usage chunk is booked
    with Store.open(tmp_path / "run") as store:
        first = store.attempts("b3-0")[0]
    assert first.message == f"stream chunk at choices[0].delta: the key 'content' {TWICE}: {twice.decode()!r}"


def test_a_stored_body_that_repeats_a_key_is_written_out_as_it_is():
    """A body stored before keys were checked is the user's paid answer: exchanges.jsonl
    carries it verbatim, and reconstruct names the key."""
    body = b'{"choices":[{"message":{"content":"4","content":"5"},"finish_reason":"stop"}]}'
    line = _exchange_line("s", "d", '{"messages":[]}', body, {})
    assert body in line
    with pytest.raises(RecordError) as refused:
        loads_line(line.decode())
    assert refused.value.field == "response.choices[0].message"


def _raw_keys(value) -> int:
    if isinstance(value, _Pairs):
        return len(value) + sum(_raw_keys(v) for _, v in value)
    return sum(_raw_keys(v) for v in value) if isinstance(value, list) else 0


@settings(max_examples=500, deadline=None)
@given(value=_objects(_VALUES), compact=st.booleans())
def test_the_counted_key_ends_never_fall_short_of_the_keys_a_line_has(value, compact):
    """The cheap step's soundness: the count is -1 (a long backslash run: unsure) or at least
    every key written, repeats included, so equal to the keys read means none was repeated."""
    from tokenbridge.jsonl import _key_ends

    ends = _key_ends(_text(value, compact).encode())
    assert ends == -1 or ends >= _raw_keys(value)


@pytest.mark.parametrize(("line", "keys"), [
    (rb'{"a\\": 1, "b": 2}', 2),  # a key that ends with an escaped backslash ends there
    (rb'{"a": "x\": 1", "b": 2}', 2),  # an escaped quote before a colon, in a string
    (rb'{"a": "x\\\": 1", "b": 2}', 2),  # an escaped backslash, then an escaped quote
    (rb'{"a\\\\": 1, "a\\": 2, "b": 3}', 3),  # two backslashes, then one: different keys
])
def test_a_quote_is_escaped_by_an_odd_run_of_backslashes(line, keys):
    """The backslashes before a quote are counted, so a key ending in a backslash is
    counted on the cheap step (it went to the stdlib's five-times-slower parse)."""
    from tokenbridge.jsonl import _key_ends

    value = orjson.loads(line)
    assert _key_ends(line) == keys == sum(1 for _ in value)
    jsonl.repeated_key(value, line)  # none repeats
    twice = line.replace(b'"b"', line[1 : line.index(b":")])  # the first key again, for "b"
    with pytest.raises(jsonl.JsonLineError, match="twice"):
        jsonl.repeated_key(orjson.loads(twice), twice)


def test_a_long_backslash_run_goes_to_the_stdlib_parse_not_a_walk_per_byte():
    """Each run before a key end was walked a byte at a time (about 100 ns a backslash: 0.4 s
    for a crafted 4 MB line, where the stdlib's parse takes 11 ms, a cold reviewer's); past
    64 the line is the stdlib's to read, exact either way."""
    import time

    from tokenbridge.jsonl import _key_ends

    line = b'{"' + b"\\\\" * (1 << 20) + b'": 1, "b": 2}'  # a key of a million escaped backslashes
    assert _key_ends(line) == -1
    t = time.process_time()
    jsonl.repeated_key(orjson.loads(line), line)
    assert time.process_time() - t < 0.1  # 0.1 s: the walk took 0.11 s per MB
    twice = line.replace(b'"b"', line[1 : line.index(b":")])  # that key again, for "b"
    with pytest.raises(jsonl.JsonLineError, match="twice"):
        jsonl.repeated_key(orjson.loads(twice), twice)


# --- a cold review's findings: cost, paths, events of other types ------------------------------

def test_the_slow_path_costs_memory_in_proportion_to_the_line():
    """A long key above a long list: each element's path was written out in full (key length
    times list length: 2 GB for a 140 KB line); only the found object's path is now."""
    import tracemalloc

    line = json.dumps({"k" * 100_000: [0] * 20_000, "s": '":'}, separators=(",", ":")).replace('"s":', '"s": ')
    tracemalloc.start()
    try:
        value = jsonl.loads_line(line)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert value["s"] == '":' and peak < 40 * len(line)
    twice = line[:-1] + ',"t":{"u":1,"u":2}}'
    with pytest.raises(jsonl.JsonLineError) as refused:
        jsonl.loads_line(twice)
    assert refused.value.field == "t"


@pytest.mark.parametrize(("line", "field"), [
    ('{"": {"c": 1, "c": 2}}', '[""]'),
    ('{"": [{"c": 1, "c": 2}]}', '[""][0]'),
    ('{"a": {"": {"c": 1, "c": 2}}}', 'a[""]'),
    ('{"a.b": {"c": 1, "c": 2}}', '["a.b"]'),
    ('{"a": {"b[0]": {"c": 1, "c": 2}}}', 'a["b[0]"]'),
    ('{"q\\"": {"c": 1, "c": 2}}', '["q\\""]'),
])
def test_a_path_through_an_odd_key_says_which_key(line, field):
    with pytest.raises(jsonl.JsonLineError) as refused:
        jsonl.loads_line(line)
    assert refused.value.field == field


def test_a_path_and_a_key_from_outside_are_clipped():
    long = "x" * 1_000_000
    with pytest.raises(jsonl.JsonLineError) as refused:
        jsonl.loads_line(f'{{"{long}": {{"{long}": 1, "{long}": 2}}}}')
    assert refused.value.field == "x" * 40 + "…"
    assert f"the key {'x' * 40 + '…'!r} appears twice" in refused.value.detail
    deep = "".join(f'{{"{i}{long[:60]}": ' for i in range(10)) + '{"c": 1, "c": 2}' + "}" * 10
    with pytest.raises(jsonl.JsonLineError) as refused:
        jsonl.loads_line(deep)
    assert len(refused.value.field) == 201 and refused.value.field.startswith("…")


def test_a_parquet_json_text_column_that_repeats_a_key_names_the_column_and_object(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenbridge import rows
    from tokenbridge.reconstruct import reconstruct_record
    from tokenbridge.tokenizer import load_tokenizer

    row, = reconstruct_record(_record("p"), load_tokenizer(KIMI_DIR))
    schema = rows.arrow_schema()
    record = rows.to_arrow_record(rows.with_derived(row), schema.names)
    record["messages"] = '[{"role": "user", "role": "system", "content": "x"}]'
    pq.write_table(pa.Table.from_pylist([record], schema=schema), tmp_path / "r.parquet")
    with pytest.raises(RowError) as refused:
        list(iter_rows(tmp_path / "r.parquet"))
    assert str(refused.value) == f"{tmp_path / 'r.parquet'}:1: messages[0]: the key 'role' {TWICE}"


def _assembler():
    from tokenbridge.generate.sse import SSEEvent, StreamAssembler

    asm = StreamAssembler()
    asm.add_event(SSEEvent('{"choices":[{"index":0,"delta":{"role":"assistant","content":"hello"}}]}', "message"))
    return asm, SSEEvent


@pytest.mark.parametrize(("data", "why"), [
    ('{"choices":[{"index":0,"delta":{"content":" more"}}],"x":1,"x":2}', "carries choices"),
    ('{"error":{"message":"upstream died","code":502},"x":1,"x":2}', "the key 'x' appears twice"),
    ('{"usage":{"prompt_tokens":3,"completion_tokens":2,"cost":0.1,"cost":9.0}}', "stream chunk at usage: the key 'cost'"),
])
def test_an_event_of_another_type_that_repeats_a_key_refuses_the_stream(data, why):
    """Such an event was passed over as a ping, losing the text, the error or the cost it carried."""
    from tokenbridge.generate.sse import StreamError

    asm, event = _assembler()
    with pytest.raises(StreamError, match=why):
        asm.add_event(event(data, "status"))


def test_a_late_usage_chunk_that_repeats_a_key_is_not_booked():
    asm, event = _assembler()
    asm.add_event(event("[DONE]", "message"))
    asm.add_late(event('{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"cost":0.001,"cost":9.0}}',
                       "message"))
    assert asm.top.get("usage") is None  # unknown, as for no chunk: its reservation is booked
    asm.add_late(event('{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"cost":0.001}}', "message"))
    assert asm.top["usage"]["cost"] == 0.001
