"""tokenbridge.jsonl (the one JSON-lines pair, the JSON-number checks) and tokenbridge.content."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbridge import exchanges, fsio, jsonl, rows
from tokenbridge.content import content_text, is_text_parts


def test_every_module_uses_the_one_pair():
    """fsio, exchanges and rows hand out jsonl's functions, not copies with their own fallback."""
    assert fsio.loads_line is jsonl.loads_line and fsio.dumps_line is jsonl.dumps_line
    assert fsio.JsonLineError is jsonl.JsonLineError and exchanges.iter_lines is jsonl.iter_lines
    assert rows.dumps_line is jsonl.dumps_line and rows.json_text is jsonl.json_text


def test_json_text_is_compact_and_escapes_a_lone_surrogate():
    assert jsonl.json_text({"a": [1, "東京"]}) == '{"a":[1,"東京"]}'
    assert jsonl.json_text(["\udc80"]) == '["\\udc80"]'


def test_iter_lines_numbers_lines_skips_blank_ones_and_keeps_bad_bytes(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n\n  \n{"b": "\xff"}\n')
    assert list(jsonl.iter_lines(path)) == [(1, '{"a": 1}\n'), (4, '{"b": "\udcff"}\n')]


@pytest.mark.parametrize(("value", "is_int", "is_count"), [
    (0, True, True), (7, True, True), (-1, True, False), (True, False, False), (False, False, False),
    (1.0, False, False), ("3", False, False), (None, False, False), (2**70, True, True),
])
def test_int_and_count_exclude_bools(value, is_int, is_count):
    assert (jsonl.is_int(value), jsonl.is_count(value)) == (is_int, is_count)


@pytest.mark.parametrize(("content", "text"), [
    ("plain", "plain"),
    (None, ""),
    ([], ""),
    ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}], "ab"),
    ([{"type": "text"}, "not a part", {"type": "text", "text": 5}], ""),
    ({"type": "text", "text": "not a list"}, ""),
])
def test_content_text(content, text):
    assert content_text(content) == text


def test_is_text_parts():
    assert is_text_parts([{"type": "text", "text": "a"}]) and is_text_parts([])
    assert not is_text_parts([{"type": "text", "text": "a"}, {"type": "image_url"}])
    assert not is_text_parts("a") and not is_text_parts(None)


# --- value_key: a cache key that tells JSON values apart -------------------------------

_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
            | st.floats(allow_nan=True, allow_infinity=True)
            | st.text(st.characters(codec=None, exclude_categories=()), max_size=6)
            | st.sampled_from(["null", "NaN", "a null here", "1", "1.0", "true"]))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=12)


def _strict(value):
    """The value with every type spelled out and objects' keys sorted: equal exactly when
    two values must share a key."""
    if isinstance(value, dict):
        return ("object", tuple((k, _strict(value[k])) for k in sorted(value)))
    if isinstance(value, list | tuple):
        return ("array", tuple(_strict(v) for v in value))
    return (type(value).__name__, repr(value))


@given(_JSON, _JSON)
@settings(max_examples=400, deadline=None)
def test_value_key_is_equal_exactly_for_equal_values(a, b):
    assert (jsonl.value_key(a) == jsonl.value_key(b)) == (_strict(a) == _strict(b))


@given(st.dictionaries(st.text(max_size=4), _SCALARS, min_size=2, max_size=6))
@settings(max_examples=100, deadline=None)
def test_value_key_ignores_key_order_at_every_depth(obj):
    reordered = dict(reversed(list(obj.items())))
    assert jsonl.value_key([{"x": obj}]) == jsonl.value_key([{"x": reordered}])


@pytest.mark.parametrize(("a", "b"), [
    (float("nan"), None), (float("inf"), None), (float("-inf"), float("inf")), (1, 1.0), (1, True), (0, False),
    (0.0, -0.0), ("\ud800", "\ufffd"), (2**64, 2**64 + 1), ({"a": None}, {"a": float("nan")}), ([1], [[1]]),
])
def test_value_key_keeps_apart_what_a_fast_dump_would_merge(a, b):
    assert jsonl.value_key(a) != jsonl.value_key(b)
    assert jsonl.value_key([a]) == jsonl.value_key((a,))  # a tuple is the array it is sent as


def test_value_key_is_none_for_what_is_not_json():
    assert jsonl.value_key({1: "a"}) is None  # the stdlib would write it as {"1": "a"}
    assert jsonl.value_key([None, {"b": {2: "a"}}]) is None
    assert jsonl.value_key({"a": {1, 2}}) is None
    cycle: list = []
    cycle.append(cycle)
    assert jsonl.value_key(cycle) is None


@pytest.mark.parametrize(("line", "detail"), [
    ('{"usage": {"cost": NaN}}', "not valid JSON (NaN at usage.cost: JSON has no NaN or infinity)"),
    ('{"a": [1, {"b": -Infinity}]}', "not valid JSON (-Infinity at a[1].b: JSON has no NaN or infinity)"),
    ('{"n": 1e400}', "not valid JSON (1e400 at n: JSON has no NaN or infinity)"),
    ('{"s": "\\ud800", "n": Infinity}', "not valid JSON (Infinity at n: JSON has no NaN or infinity)"),
    ("NaN", "not valid JSON (NaN: JSON has no NaN or infinity)"),
])
def test_a_number_json_cannot_spell_is_a_bad_line_naming_its_field(line, detail):
    """The stdlib fallback reads NaN, Infinity and 1e400, which every writer then turns into
    null or a literal no reader takes; orjson refuses them, and so does the fallback now."""
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(line)
    with pytest.raises(jsonl.JsonLineError) as err:
        jsonl.loads_line(line)
    assert err.value.detail == detail


def test_finite_numbers_and_lone_surrogates_still_read():
    assert jsonl.loads_line('{"s": "\\ud800", "n": 1.5e308, "t": 1e-400}') == {"s": "\ud800", "n": 1.5e308, "t": 0.0}


@pytest.mark.parametrize("line,field,detail", [
    (b'{"a": {"b": ["x", "y\xff"]}}', "a.b[1]", "not valid UTF-8 (byte 0xff at byte 20: invalid start byte)"),
    (b'[{"k\xc3(": 1}]', "[0] (a key)", "not valid UTF-8 (byte 0xc3 at byte 4: invalid continuation byte)"),
    # a lone surrogate the sender escaped is JSON: with one such escape in the line, no field is named
    (b'{"a": "\\udcff", "b": "\xe2\x82"}', None, "not valid UTF-8 (byte 0xe2 at byte 22: invalid continuation byte)"),
    (b'{"a": "\xff" x', None, "not valid UTF-8 (byte 0xff at byte 7: invalid start byte)"),  # no JSON either
])
def test_a_line_with_bytes_that_are_no_utf8_is_refused_naming_the_field(line, field, detail):
    """Read as bytes, the line was refused (no field named); read from a file as text (bytes
    kept as surrogate escapes), it was read, and the gate rejected its sample as a round trip
    that failed. Either way it is no JSON text: one error, naming the field where it can."""
    for read_as in (line, line.decode("utf-8", "surrogateescape")):
        with pytest.raises(jsonl.JsonLineError) as err:
            jsonl.loads_line(read_as)
        assert (err.value.field, err.value.detail) == (field, detail)


def test_a_row_file_with_nan_names_file_line_and_field(tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_text('\n{"id": "b", "usage": {"cost": NaN}}\n')
    with pytest.raises(rows.RowError) as err:
        list(rows.iter_rows(src))
    assert str(err.value) == f"{src}:2: <line>: not valid JSON (NaN at usage.cost: JSON has no NaN or infinity)"


def test_an_exchange_line_with_infinity_is_a_bad_record_naming_its_field():
    with pytest.raises(exchanges.RecordError) as err:
        exchanges.loads_line('{"id": "a", "response": {"usage": {"cost": Infinity}}}')
    assert err.value.field == "<line>" and "Infinity at response.usage.cost" in str(err.value)


def test_prompt_loading_and_the_row_check_share_one_set_of_message_rules(tmp_path):
    """content.ROLES and content_fault are what check_row lets into an export; prompt
    loading sends by the same rules (one copy), and refuses NaN / Infinity / 1e400 as the
    row and exchange readers do, in a line and in a messages field stored as JSON text."""
    import json

    from tokenbridge.content import ROLES
    from tokenbridge.generate.prompts import load_prompts
    from tokenbridge.generate.settings import DatasetSpec

    rows = [
        {"id": "ok", "messages": [{"role": role, "content": "hi"} for role in sorted(ROLES - {"assistant", "tool"})]
         + [{"role": "user", "content": "go"}]},
        {"id": "role", "messages": [{"role": "function", "content": "hi"}]},
        {"id": "part", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        {"id": "dict", "messages": [{"role": "user", "content": {"not": "text"}}]},
        {"id": "field", "messages": '[{"role": "user", "content": "hi", "weight": NaN}]'},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([*map(json.dumps, rows), '{"id": "line", "prompt": "hi", "x": 1e400}']) + "\n",
                    encoding="utf-8")
    loaded = load_prompts([DatasetSpec(name="d", path=path)])
    assert [s.id for s in loaded.samples] == ["d-ok"]
    f = str(path)
    assert [str(e) for e in loaded.errors] == [
        f"{f}: line 2: field 'messages[0].role': unknown role 'function' (expected one of {sorted(ROLES)})",
        f"{f}: line 3: field 'messages[0].content[0].text': must be a string, got int",
        f"{f}: line 4: field 'messages[0].content': must be a string, null or a list of content parts, got dict",
        f"{f}: line 5: field 'messages': not valid JSON: NaN at [0].weight: JSON has no NaN or infinity",
        f"{f}: line 6: field '<line>': not valid JSON: 1e400 at x: JSON has no NaN or infinity",
    ]


def test_a_leading_byte_order_mark_is_dropped_for_text_and_bytes():
    """The stdlib skipped it on bytes only: export read a line inspect and reconstruct refused."""
    assert jsonl.loads_line('\ufeff{"a": 1}') == jsonl.loads_line(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}


@pytest.mark.parametrize("text,detail", [
    # the stdlib recurses per level: a RecursionError, which no caller caught (exit 8)
    ("[" * 100_000, "nested too deeply to read"),
    ('{"a": [' * 50_000, "nested too deeply to read"),
    ('{"a":\n  x}', "not valid JSON (Expecting value at line 2 column 3)"),
    (b'{"a": "\xff"}', "not valid UTF-8 (invalid start byte at byte 7)"),
    ('{"a": ' + "7" * 5000 + "}", "not valid JSON (a number of more than 4300 digits)"),
])
def test_a_document_that_cannot_be_read_is_one_json_line_error(text, detail):
    with pytest.raises(jsonl.JsonLineError) as err:
        jsonl.loads_document(text)
    assert str(err.value) == err.value.detail == detail


def test_a_document_reads_as_the_stdlib_reads_it():
    assert jsonl.loads_document('{"a": [1, 2.5, NaN]}')["a"][:2] == [1, 2.5]
    assert jsonl.loads_document(b'["\\ud800"]') == ["\ud800"]


def test_no_module_parses_a_file_with_the_bare_stdlib():
    """A file read straight into ``json.loads`` raises RecursionError for ``[`` * 100,000,
    which its caller never caught: every file goes through :func:`jsonl.loads_document`."""
    import re
    from pathlib import Path

    src = Path(jsonl.__file__).parent
    bare = re.compile(r"json\.loads\(.*\.read_(text|bytes)\(")
    found = [f"{p.relative_to(src)}:{n}" for p in sorted(src.rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if bare.search(line)]
    assert found == []


@pytest.mark.parametrize(("value", "numbers", "said"), [
    ({"a": None, "b": [1.5, "x"]}, True, None),
    ({"n": 10**30, "s": "é"}, True, None),  # an integer past 64 bits is fine (orjson's write refuses it)
    ({"a": None, "b": float("inf")}, True, "b: holds a number that is not finite"),  # written as null by orjson
    ({"a": float("nan")}, False, None),
    ({"m": [{"content": "x\ud800"}]}, False, "m[0].content: holds a lone surrogate (not UTF-8)"),
    ({"\udc80": 1}, True, "<top>: holds a lone surrogate (not UTF-8)"),
])
def test_unencodable_names_what_json_or_utf8_cannot_carry(value, numbers, said):
    from tokenbridge.jsonl import unencodable

    assert unencodable(value, numbers=numbers) == said
