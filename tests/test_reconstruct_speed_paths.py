"""The fast paths of reconstruct give exactly what the plain paths give.

Equivalence, not timing: byte chunks read the same lines (numbers included) as
``iter_lines``; rows are the same whatever the worker count and chunk size; and they are
the rows the pre-fast-path tokenizer (tiktoken's special-aware encode on every call, no
prompt cache) gives, ids and findings alike.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import tempfile
from functools import lru_cache
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbridge.chat import resolve_dialect
from tokenbridge.exchanges import RecordError, iter_lines, loads_line
from tokenbridge.fsio import dumps_line
from tokenbridge.rows import DERIVED_COLUMNS, encode_lean_row, encode_row, with_derived
from tokenbridge.reconstruct import _chunk_lines, _chunks, _load, reconstruct_file, reconstruct_record
from tokenbridge.tokenizer import KIMI_PAT_STR, load_tokenizer, marker_pattern, marker_splitter

from conftest import KIMI_DIR, ROOT

_LINE_BYTES = st.one_of(
    st.sampled_from([b"", b" ", b"\r", b"\xff\xfe", b"\xe4\xb8", "字".encode(), b'{"a": 1}', b"x" * 700]),
    st.binary(max_size=30),
)
_ENDINGS = st.sampled_from([b"\n", b"\r\n", b"\r", b"\n\n"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_LINE_BYTES, _ENDINGS), max_size=25), st.booleans(),
       st.integers(1, 5), st.sampled_from([1, 3, 64, 1000, 256 * 1024]))
def test_byte_chunks_read_the_lines_iter_lines_reads(lines, trailing, max_lines, max_bytes):
    data = b"".join(text + end for text, end in lines) + (b"tail" if trailing else b"")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.jsonl"
        path.write_bytes(data)
        expected = list(iter_lines(path))
        chunks = list(_chunks(path, max_lines, max_bytes))
    got = [(n, _text(line)) for c in chunks for n, line in _chunk_lines(c)]
    assert got == expected
    assert b"".join(d for _, d in chunks) == data  # every byte shipped once, in order
    assert all(d.count(b"\n") <= max_lines for _, d in chunks)


def _text(line: memoryview | str) -> str:
    """A line as iter_lines' text: lines kept as bytes decode as it decodes."""
    return line if isinstance(line, str) else str(line, "utf-8", "surrogateescape")


_JSONISH = st.one_of(
    st.sampled_from([b'{"a": 1}', b'{"a": "\\ud800"}', b'{"a": "\xff"}', b'{"a": "\xe4\xb8"}', b"\xef\xbb\xbf{}",
                     '{"字": "\u3000"}'.encode(), "\u3000".encode(), b"\x1c", b"[1, 2", b"nan", b'"x"']),
    st.binary(max_size=12).map(lambda b: b'{"k": "' + b + b'"}'),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_JSONISH, min_size=1, max_size=6))
def test_byte_lines_parse_as_their_text_parses(lines):
    """A line kept as bytes gives the value (or the RecordError) that loads_line gives for
    its text, and blank-as-text lines are skipped alike."""
    data = b"\n".join(lines) + b"\n"
    expected = {n: text for n, text in enumerate(io.StringIO(data.decode("utf-8", "surrogateescape"), newline=None), 1)
                if text.strip()}
    got = dict(_chunk_lines((1, data)))
    assert sorted(got) == sorted(expected)
    for n, line in got.items():
        assert _outcome(_load, line) == _outcome(loads_line, expected[n])


def _outcome(read, line):
    try:
        return ("value", read(line))
    except RecordError as exc:
        return ("error", exc.field, exc.detail)


@lru_cache(maxsize=1)
def _reference_tokenizer():
    """The Kimi tokenizer as it was before the fast paths: every text through tiktoken's
    special-aware encode (all markers allowed), and encode_prompt is plain encode."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    kimi = load_tokenizer(KIMI_DIR)
    raw = tiktoken.Encoding(
        "reference", pat_str=KIMI_PAT_STR, mergeable_ranks=load_tiktoken_bpe(str(KIMI_DIR / "tiktoken.model")),
        special_tokens={t: i for i, t in kimi.marker_ids.items()},
    )

    def encode(text: str) -> list[int]:
        assert len(text) <= 25_000  # the records below stay on the one-call path
        return raw.encode(text, allowed_special="all")

    return dataclasses.replace(kimi, _encode=encode, _split_markers=None, _encode_plain=None)


def _records(kimi) -> list[str]:
    """Multi-turn conversations over two shared system prompts, clean and dirty
    completions, and lines that are not records."""
    dialect = resolve_dialect(kimi)
    systems = ["You are a careful assistant. " * 30, "Answer in French, briefly. <|im_end|> is text here. " * 10]
    lines: list[str] = []
    for conv in range(6):
        msgs = [{"role": "system", "content": systems[conv % 2]}]
        for turn in range(3):
            msgs = [*msgs, {"role": "user", "content": f"Question {turn} of conversation {conv}: why [BOS] <think?"}]
            reasoning = f"Let me think about turn {turn}. " * 20 + "字" * 10
            content = f"Answer {turn}:\n```python\nx = a[0] < b\n```\n"
            if (conv, turn) == (2, 1):
                content += "</think>"  # a leaked marker: found from the ids
            parts = dialect.completion_parts({"reasoning": reasoning, "content": content}, "stop", True)
            n = sum(1 if k in ("think_end", "end") else len(kimi.encode(t)) for k, t in parts)
            if (conv, turn) == (4, 2):
                n += 1  # a usage mismatch
            request = {"model": "moonshotai/kimi-k2.5", "messages": msgs}
            record = {
                "id": f"c{conv}-t{turn}", "dataset": "speed",
                "request": request,
                "response": {"id": "gen", "provider": "p", "model": "moonshotai/kimi-k2.5",
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "reasoning": reasoning, "content": content}}],
                             "usage": {"prompt_tokens": len(kimi.encode(dialect.render_request(request))),
                                       "completion_tokens": n}},
            }
            lines.append(json.dumps(record, ensure_ascii=conv % 2 == 0))
            msgs = [*msgs, {"role": "assistant", "content": content}]
    lines[5:5] = ["{not json", ""]
    return lines


def _small_ranges(monkeypatch, size: int = 700) -> None:
    """Pool workers read ranges of about ``size`` bytes (a few records each)."""
    from tokenbridge import lanes

    monkeypatch.setattr(lanes, "RANGE_BYTES", size)
    monkeypatch.setattr(lanes, "MIN_RANGE_BYTES", size)


def test_rows_equal_the_reference_path_for_any_worker_count_and_chunk_size(tmp_path, kimi, monkeypatch):
    lines = _records(kimi)
    src = tmp_path / "exchanges.jsonl"
    # CRLF endings and one invalid UTF-8 line: numbering and errors must match too
    src.write_bytes(b"\r\n".join(line.encode() for line in lines) + b"\r\n\xff\xfe\r\n")

    reference = _reference_tokenizer()
    expected = b"".join(
        dumps_line(row) + b"\n"
        for line in lines if line.strip() and line != "{not json"
        for row in reconstruct_record(json.loads(line), reference)
    )
    outputs = {}
    summaries = {}
    # (workers, lines a chunk in one process / bytes a range in a pool)
    for workers, chunk in [(1, 256), (2, 256 * 1024), (2, 700), (3, 1), (1, 1)]:
        dst = tmp_path / f"out-{workers}-{chunk}.jsonl"
        if workers > 1:
            _small_ranges(monkeypatch, chunk)
        summary = reconstruct_file(src, dst, kimi, workers=workers, chunk_lines=chunk)
        outputs[workers, chunk] = dst.read_bytes()
        summaries[workers, chunk] = summary.to_dict()
    assert all(out == expected for out in outputs.values())
    first = summaries[1, 256]
    assert all(s == first for s in summaries.values())
    assert first["records"] == 18 and first["status"]["ok"] == 16
    assert first["status"]["rejected"] == 2
    assert [(b["line"], b["field"]) for b in first["bad_lines"]] == [(6, "<line>"), (21, "<line>")]


def test_prompt_cache_serves_shared_pieces_in_reconstruct(kimi):
    lines = _records(kimi)
    before = kimi.prompt_cache_stats["hits"]
    for line in lines:
        if line.strip() and line != "{not json":
            reconstruct_record(json.loads(line), kimi)
    # each later exchange finds its system prompt and earlier turns in the cache
    assert kimi.prompt_cache_stats["hits"] - before > 18 * 3


def test_pool_spool_folder_is_removed_after_success_and_failure(tmp_path, kimi, monkeypatch):
    import pytest

    from tokenbridge import reconstruct
    from tokenbridge.fsio import OutputWriteError, is_temp_name

    src = tmp_path / "in" / "exchanges.jsonl"
    src.parent.mkdir()
    src.write_text("\n".join(_records(kimi)) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    _small_ranges(monkeypatch)  # many chunks spooled, so the disk can fill between them
    reconstruct_file(src, out / "ok.jsonl", kimi, workers=2, chunk_lines=2)
    assert sorted(p.name for p in out.iterdir()) == ["ok.jsonl"]

    calls = []
    copy_from = reconstruct._JsonlSink.copy_from

    def failing_copy(self, fd, offset, length):  # pool workers' rows reach the output this way
        calls.append(length)
        if len(calls) == 3:  # the disk fills while chunks are still spooled
            raise OSError(28, "No space left on device")
        copy_from(self, fd, offset, length)

    monkeypatch.setattr(reconstruct._JsonlSink, "copy_from", failing_copy)
    with pytest.raises(OutputWriteError, match="No space left on device"):
        reconstruct_file(src, out / "full.jsonl", kimi, workers=2, chunk_lines=2)
    assert len(calls) == 3
    assert sorted(p.name for p in out.iterdir()) == ["ok.jsonl"]
    assert not any(is_temp_name(p.name) for p in out.iterdir())


def test_pool_output_around_repeated_ids_is_the_one_process_output(tmp_path, kimi, monkeypatch):
    """Records that repeat an earlier id are cut out of spooled chunks by byte range (the
    rest copied from the spool file): the bytes are the ones one process writes, and every
    repeat is a bad line naming the first."""
    lines = [line for line in _records(kimi) if line.startswith("{") and line != "{not json"]
    repeated = [*lines[:5], lines[1], *lines[5:9], lines[0], lines[3], *lines[9:]]  # repeats inside and across chunks
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(repeated) + "\n", encoding="utf-8")
    one = reconstruct_file(src, tmp_path / "one.jsonl", kimi, workers=1)
    _small_ranges(monkeypatch, 6000)  # a few records a chunk: repeats fall inside them
    from tokenbridge import reconstruct

    starts = []
    copy_from = reconstruct._JsonlSink.copy_from

    def noted(self, fd, offset, length):
        starts.append(offset)
        copy_from(self, fd, offset, length)

    monkeypatch.setattr(reconstruct._JsonlSink, "copy_from", noted)
    pool = reconstruct_file(src, tmp_path / "pool.jsonl", kimi, workers=2)
    assert any(starts), "no copy began inside a spooled chunk"
    assert (tmp_path / "pool.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert [(b.line, b.field) for b in pool.bad_lines] == [(b.line, b.field) for b in one.bad_lines] == [
        (6, "id"), (11, "id"), (12, "id")]
    ids = [json.loads(row)["id"] for row in (tmp_path / "pool.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(ids) == len(set(ids)) == len(lines)


_NESTED_MARKERS = ("<a", "<ab", "<abc", "<b>", "b", "[EOS]", "[E", "<|x|>")


@lru_cache(maxsize=1)
def _kimi_markers() -> tuple[str, ...]:
    return tuple(load_tokenizer(KIMI_DIR).markers)


def _near(markers: tuple[str, ...]):
    """Text made of markers, their prefixes and stray characters."""
    bits = [m[:k] for m in markers for k in range(1, len(m) + 1)]
    return st.lists(st.one_of(st.sampled_from(bits), st.text("<|>[]/abcEOS _x", max_size=4)), max_size=30).map("".join)


def _alternation(markers) -> re.Pattern[str]:
    """The plain form: every marker, longest first."""
    return re.compile("(" + "|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)) + ")")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_marker_prefix_tree_matches_the_longest_first_alternation(data):
    """The prefix-tree regex finds the same markers at the same places as the plain
    longest-first alternation, on Kimi's 256 markers and on a set of nested prefixes."""
    for markers in (_kimi_markers(), _NESTED_MARKERS):
        text = data.draw(_near(markers))
        tree, plain = marker_pattern(markers), _alternation(markers)
        assert tree.split(text) == plain.split(text)
        assert [m.span() for m in tree.finditer(text)] == [m.span() for m in plain.finditer(text)]


_MANY_FIRSTS = ("<a", "[b", "{c", "(d", "|e", "ab")  # more first characters than the splitter groups


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_marker_splitter_cuts_where_the_whole_pattern_cuts(data):
    """Splitting by the largest first-character group (when no other group's marker is
    in the text) gives the whole pattern's pieces: on Kimi's 256 markers, on nested
    prefixes across groups (``<a``/``<ab``, ``[E``/``[EOS]``, a one-character ``b``),
    and on a set with too many groups to split by one."""
    for markers in (_kimi_markers(), _NESTED_MARKERS, _MANY_FIRSTS):
        text = data.draw(_near(markers))
        assert marker_splitter(markers)(text) == marker_pattern(markers).split(text)


def test_marker_splitter_takes_the_whole_pattern_when_another_group_occurs():
    split = marker_splitter(_NESTED_MARKERS)
    assert split("x<ab y") == ["x", "<ab", " y"]  # only the largest group ("<...") occurs
    assert split("<ab[EOS]b") == ["", "<ab", "", "[EOS]", "", "b", ""]  # "[" and "b" groups too
    assert split("<a[E") == ["", "<a", "", "[E", ""]


def _row_like(prompt: list[int], completion: list[int], text: str = "é\u2028\"\\x") -> dict:
    return {"id": "r", "choice": 0, "status": "ok", "prompt_ids": prompt, "completion_ids": completion,
            "input_ids": [*prompt, *completion], "loss_mask": [0] * len(prompt) + [1] * len(completion),
            "segments": [], "content": text, "messages": [{"role": "user", "content": text}]}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=20), st.lists(st.integers(0, 2**31 - 1), max_size=20),
       st.text(max_size=20))
def test_encoded_rows_are_the_bytes_of_the_whole_row(prompt, completion, text):
    """encode_row splices input_ids/loss_mask from the ids' own JSON: the bytes are
    dumps_line's for the whole row, empty lists and lone surrogates included."""
    row = _row_like(prompt, completion, text)
    assert encode_row(row) == dumps_line(row)
    assert json.loads(encode_row(row)) == json.loads(dumps_line(row))
    lean = {k: v for k, v in row.items() if k not in DERIVED_COLUMNS}
    assert with_derived(lean) == row and list(with_derived(lean)) == list(row)  # same columns, same order
    assert encode_lean_row(lean) == dumps_line(row)


def test_encoded_rows_fall_back_whole_when_the_derived_columns_do_not_follow():
    row = _row_like([1, 2], [3])
    odd = [dict(row, input_ids=[1, 2]), dict(row, loss_mask=[0, 1, 1]), {k: v for k, v in row.items() if k != "loss_mask"},
           {k: v for k, v in row.items() if k != "input_ids"}, dict(row, prompt_ids=(1, 2))]
    for r in odd:
        assert encode_row(r) == dumps_line(r)
    lean = {k: v for k, v in row.items() if k not in DERIVED_COLUMNS}
    apart = {"prompt_ids": lean["prompt_ids"], **{k: v for k, v in lean.items() if k != "prompt_ids"}}
    for r in (apart, dict(lean, content="\ud800"), dict(lean, completion_ids=(3,))):
        assert encode_lean_row(r) == dumps_line(with_derived(r))
    reordered = {"input_ids": row["input_ids"], "loss_mask": row["loss_mask"], **row}  # first keys
    assert encode_row(reordered) == dumps_line(reordered)
    last = {**{k: v for k, v in row.items() if k not in ("input_ids", "loss_mask")},
            "input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}  # last keys
    assert encode_row(last) == dumps_line(last)


def test_reconstructed_file_is_the_whole_rows_bytes(tmp_path, kimi):
    """Every line reconstruct writes is dumps_line of the row reconstruct_record returns."""
    src = ROOT / "examples" / "exchanges.jsonl"
    reconstruct_file(src, tmp_path / "out.jsonl", kimi, workers=1)
    expected = []
    for _, line in iter_lines(src):
        try:
            expected += [dumps_line(r) + b"\n" for r in reconstruct_record(json.loads(line), kimi)]
        except RecordError:
            continue
    assert len(expected) == 7 and (tmp_path / "out.jsonl").read_bytes() == b"".join(expected)
