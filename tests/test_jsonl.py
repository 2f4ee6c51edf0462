"""tokenbridge.jsonl (the one JSON-lines pair, the JSON-number checks) and tokenbridge.content."""

from __future__ import annotations

import pytest

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
