"""The row contract: one schema every writer follows, one reader that checks every row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_export_support import (
    make_exchange,
    make_run,
    read_jsonl,
    reconstruct,
    write_jsonl,
)

from tokenbridge import rows
from tokenbridge.export import export_file
from tokenbridge.export.writers import META_COLUMNS, WRITERS, Writer
from tokenbridge.reconstruct import reconstruct_file

SRC = Path(__file__).resolve().parents[1] / "src" / "tokenbridge"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def run(kimi, tmp_path_factory):
    """Rows of the real reconstruct, one of them with tools and a reconstruction hypothesis."""
    root = tmp_path_factory.mktemp("rows")
    exchanges, made = make_run(kimi, 12, seed=5)
    ex = make_exchange(50, "tool", seed=5)
    ex["request"]["tools"] = TOOLS
    tool_rows = reconstruct(ex, kimi, "tool")
    assert tool_rows[0]["status"] == "ok"
    tool_rows[0]["reconstruction"] = "tool_call_without_think_close"
    exchanges.append(ex)
    made += tool_rows
    return root, write_jsonl(root / "reconstructed.jsonl", made), write_jsonl(root / "exchanges.jsonl", exchanges), made


def _arrow_schema_of(folder: Path, fmt: str) -> pa.Schema:
    if fmt == "speculators":
        with pa.ipc.open_stream(next(folder.glob("*.arrow"))) as reader:
            return reader.schema
    return pq.read_schema(next((folder / "data").glob("*.parquet")))


# what each writer adds to the row's columns, and the types it changes (and why: speculators reads int64)
EXTRA = {"speculators": {"seq_len": pa.int64()},
         "parquet": {"num_prompt_tokens": pa.int32(), "num_completion_tokens": pa.int32()}}
WIDER = {"speculators": {"input_ids": pa.list_(pa.int64()), "loss_mask": pa.list_(pa.int64())}}


@pytest.mark.parametrize("fmt", ["speculators", "parquet"])
def test_every_arrow_writer_follows_the_one_schema(run, tmp_path, fmt):
    _, src, _, _ = run
    export_file(src, tmp_path / fmt, fmt)
    schema = _arrow_schema_of(tmp_path / fmt, fmt)
    one = rows.arrow_schema()
    for f in schema:
        if f.name in EXTRA[fmt]:
            assert f.type == EXTRA[fmt][f.name], f.name
        else:
            assert f.type == WIDER.get(fmt, {}).get(f.name, one.field(f.name).type), f.name
    assert set(schema.names) - set(EXTRA[fmt]) >= {"input_ids", "loss_mask", *META_COLUMNS}


def test_parquet_export_carries_every_column_but_the_split_ids(run, tmp_path):
    _, src, _, made = run
    export_file(src, tmp_path / "pq", "parquet")
    names = set(pq.read_schema(next((tmp_path / "pq" / "data").glob("*.parquet"))).names)
    assert names == set(rows.COLUMNS) - {"prompt_ids", "completion_ids"} | set(EXTRA["parquet"])
    table = pq.read_table(next((tmp_path / "pq" / "data").glob("*.parquet"))).to_pylist()
    want = [r for r in made if r["status"] == "ok"]
    assert [None if t["tools"] is None else json.loads(t["tools"]) for t in table] == [r["tools"] for r in want]
    assert any(t["tools"] for t in table)
    assert [t["reconstruction"] for t in table] == [r.get("reconstruction") for r in want]


def test_reconstruct_parquet_is_the_one_schema(run, tmp_path, kimi_dir):
    exchanges = run[2]
    out = tmp_path / "reconstructed.parquet"
    reconstruct_file(exchanges, out, kimi_dir, workers=1)
    assert pq.read_schema(out).remove_metadata() == rows.arrow_schema()


def test_jsonl_writers_keys(run, tmp_path):
    src = run[1]
    export_file(src, tmp_path / "sf", "specforge")
    export_file(src, tmp_path / "conv", "conversations")
    assert {tuple(r) for r in read_jsonl(tmp_path / "sf" / "train.jsonl")} == {("input_ids", "loss_mask", *META_COLUMNS)}
    conv = read_jsonl(tmp_path / "conv" / "conversations.jsonl")
    assert {tuple(r) for r in conv} == {(*META_COLUMNS, "conversations"), (*META_COLUMNS, "conversations", "tools")}
    with_tools = [c for c in conv if "tools" in c]
    assert len(with_tools) == 1 and json.loads(with_tools[0]["tools"]) == TOOLS
    # the model's own tool call stays raw marker text in the final turn; no invented tool_calls key
    final = with_tools[0]["conversations"][-1]
    assert set(final) == {"role", "content", "reasoning_content"} and "<|tool_calls_section_begin|>" in final["content"]


def test_one_schema_in_the_source():
    """Only rows.py spells out the row's Arrow types (grep finds one schema). A struct type
    built for another purpose (prompts' UTF-8 check casts a prompt column's strings to
    binary) is not the row's: its id lists and segments are what name it."""
    spelled = re.compile(r"pa\.list_\(pa\.int(8|32)\(\)\)|\(\"(segments|kind)\", pa\.")
    hits = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if spelled.search(p.read_text(encoding="utf-8"))]
    assert hits == ["rows.py"]


# --- the reader -----------------------------------------------------------------------------


def test_rows_without_reconstruction_read_as_null(run, tmp_path, kimi_dir):
    _, src, _, made = run
    old = [{k: v for k, v in r.items() if k != "reconstruction"} for r in made]
    got = [r for _, r in rows.iter_rows(write_jsonl(tmp_path / "old.jsonl", old))]
    assert [r["reconstruction"] for r in got] == [None] * len(old)
    # a Parquet file from before the column existed
    legacy = pa.schema([f for f in rows.arrow_schema() if f.name != "reconstruction"])
    table = pa.Table.from_pylist([rows.to_arrow_record(r, legacy.names) for r in old], schema=legacy)
    pq.write_table(table, tmp_path / "old.parquet")
    from_parquet = [r for _, r in rows.iter_rows(tmp_path / "old.parquet")]
    assert from_parquet == got
    # and the value round-trips where present
    assert [r["reconstruction"] for _, r in rows.iter_rows(src)] == [r.get("reconstruction") for r in made]


def test_odd_api_values_read_the_same_from_jsonl_and_parquet(run, tmp_path):
    _, _, _, made = run
    odd = [dict(made[0], provider={"name": "Alpha", "tier": 2}, model=7, finish_reason=["stop"])]
    from_jsonl = [r for _, r in rows.iter_rows(write_jsonl(tmp_path / "odd.jsonl", odd))]
    sink = rows.ParquetRowSink(tmp_path / "odd.parquet")
    sink.write(odd)
    sink.close()
    from_parquet = [r for _, r in rows.iter_rows(tmp_path / "odd.parquet")]
    assert from_jsonl == from_parquet
    assert (from_jsonl[0]["provider"], from_jsonl[0]["model"], from_jsonl[0]["finish_reason"]) == (
        '{"name":"Alpha","tier":2}', "7", '["stop"]')


BAD = {
    "missing": (lambda r: r.pop("segments"), "segments", "missing"),
    "status": (lambda r: r.update(status="great"), "status", "must be one of ok, flagged, rejected, got 'great'"),
    "choice": (lambda r: r.update(choice=True), "choice", "must be a non-negative integer"),
    "id": (lambda r: r.update(id=12), "id", "must be a string"),
    "thinking": (lambda r: r.update(thinking="yes"), "thinking", "must be true or false"),
    "usage": (lambda r: r.update(usage=[1]), "usage", "must be an object or null"),
    "tools": (lambda r: r.update(tools="x"), "tools", "must be a list or null"),
    "ids": (lambda r: r.update(input_ids="1,2"), "input_ids", "must be a list"),
    "finding": (lambda r: r.update(findings=[{"code": "x", "severity": "fatal", "message": "m"}]), "findings[0]",
                "severity error or warning"),
    "content": (lambda r: r.update(content=None), "content", "must be a string"),
    # the conversations export wrote these as they were
    "messages": (lambda r: r.update(messages=[]), "messages", "must be a non-empty list, got list"),
    "role": (lambda r: r.update(messages=[{**r["messages"][0], "role": 7}]), "messages[0].role",
             "unknown role 7 (expected one of ['assistant', 'developer', 'system', 'tool', 'user'])"),
    # prompt loading's rules (tokenbridge.content): a role it would not send, content it would not read
    "empty role": (lambda r: r.update(messages=[{**r["messages"][0], "role": ""}]), "messages[0].role",
                   "unknown role ''"),
    "dict content": (lambda r: r.update(messages=[{**r["messages"][0], "content": {"text": "x"}}]),
                     "messages[0].content", "must be a string, null or a list of content parts, got dict"),
    "part": (lambda r: r.update(messages=[{**r["messages"][0], "content": [{"text": "x"}]}]),
             "messages[0].content[0]", "must be a content part object with a string 'type'"),
    "part text": (lambda r: r.update(messages=[{**r["messages"][0], "content": [{"type": "text", "text": 5}]}]),
                  "messages[0].content[0].text", "must be a string, got int"),
    "deep": (lambda r: r.update(messages=[[[]]]), "messages[0]", "must be an object with a string role"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_row_names_file_line_and_field(run, tmp_path, name):
    _, _, _, made = run
    change, field, message = BAD[name]
    rows_ = [dict(r) for r in made[:4]]
    change(rows_[2])
    src = write_jsonl(tmp_path / "bad.jsonl", rows_)
    with pytest.raises(rows.RowError) as err:
        list(rows.iter_rows(src))
    assert (err.value.line, err.value.field) == (3, field)
    assert message in err.value.detail and str(err.value).startswith(f"{src}:3: {field}: ")


def test_not_an_object_and_not_json(tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_text("[1, 2]\n")
    with pytest.raises(rows.RowError, match=r"r.jsonl:1: <line>: must be a JSON object, got list"):
        list(rows.iter_rows(src))
    src.write_bytes(b'{"id": "\xff"}\n')
    with pytest.raises(rows.RowError, match=r"r.jsonl:1: id: not valid UTF-8 \(byte 0xff at byte 8: invalid start byte\)"):
        list(rows.iter_rows(src))
    with pytest.raises(rows.RowError, match="no such file"):
        list(rows.iter_rows(tmp_path / "none.jsonl"))


def test_a_damaged_parquet_row_group_names_the_file_and_row(run, tmp_path, monkeypatch):
    """Damage past the footer (a later row group) is a RowError naming where reading stopped, not a traceback."""
    _, _, _, made = run
    monkeypatch.setattr(rows, "_PARQUET_BATCH_ROWS", 4)  # one read batch per row group
    path = tmp_path / "r.parquet"
    sink = rows.ParquetRowSink(path, batch_rows=4)
    for r in made[:8]:
        sink.write([r])
    sink.close()
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 2 and meta.row_group(0).num_rows == 4
    col = meta.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    data[col.data_page_offset:col.data_page_offset + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    path.write_bytes(bytes(data))
    got = []
    with pytest.raises(rows.RowError) as err:
        for _, row in rows.iter_rows(path):
            got.append(row["id"])
    assert got == [r["id"] for r in made[:4]]
    assert (err.value.line, err.value.field) == (5, "<row>")
    assert str(err.value).startswith(f"{path}:5: <row>: cannot be read (")


def test_a_parquet_string_that_is_not_utf8_names_the_row_and_column(run, tmp_path):
    """A hand edit that left invalid UTF-8 in a string column: export and inspect died with a
    UnicodeDecodeError traceback, vocab said only the codec's words (a cold tester)."""
    _, _, _, made = run
    path = tmp_path / "r.parquet"
    sink = rows.ParquetRowSink(path)
    for r in made[:3]:
        sink.write([{**r, "content": "zz-marker-zz"}])
    sink.close()
    data = path.read_bytes()
    assert data.count(b"zz-marker-zz") >= 1  # plain encoding, uncompressed enough to patch
    path.write_bytes(data.replace(b"zz-marker-zz", b"\xffz-marker-zz"))
    with pytest.raises(rows.RowError) as err:
        list(rows.iter_rows(path))
    assert (err.value.line, err.value.field) == (1, "content")
    assert str(err.value) == f"{path}:1: content: is not valid UTF-8"


def test_a_parquet_file_holding_a_column_twice_is_refused_not_read_as_its_last(run, tmp_path):
    """``status`` and ``findings`` each held twice, the first pair saying rejected: each row
    kept the last pair, so rejected rows went out as ``ok`` training rows (a cold tester's).
    The JSONL reader refuses a key given twice; pyarrow's own read_table refuses this file."""
    _, _, _, made = run
    path = tmp_path / "r.parquet"
    sink = rows.ParquetRowSink(path)
    sink.write([made[0]])
    sink.close()
    table = pq.read_table(path)
    rejected = pa.array(["rejected"] * table.num_rows)  # first in the file, the row's own status last
    pq.write_table(pa.Table.from_arrays([rejected, *table.columns], names=["status", *table.column_names]), path)
    with pytest.raises(rows.RowError) as err:
        list(rows.iter_rows(path))
    assert str(err.value) == (f"{path}: status: the file holds this column 2 times (which one a row means is unclear: "
                              "a row's JSON holds each key once)")


def test_a_file_that_is_not_parquet_is_a_row_error(tmp_path):
    path = tmp_path / "r.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(rows.RowError, match=r"r.parquet: <file>: not a readable Parquet file \("):
        list(rows.iter_rows(path))


# --- every writer against the row contract -------------------------------------------------

#: What each format adds beyond the row's columns (a new writer must say here what it adds)
WRITER_EXTRA = {"specforge": set(), "conversations": {"conversations"}, "speculators": {"seq_len"},
                "parquet": {"num_prompt_tokens", "num_completion_tokens"}}
#: Row columns a format stores as JSON text rather than as the value
WRITER_JSON_TEXT = {"conversations": {"tools"}, "parquet": set(rows.JSON_TEXT_COLUMNS)}


def _written_rows(folder: Path, fmt: str) -> list[dict]:
    if fmt in ("specforge", "conversations"):
        return read_jsonl(folder / ("train.jsonl" if fmt == "specforge" else "conversations.jsonl"))
    if fmt == "speculators":
        out: list[dict] = []
        for path in sorted(folder.glob("*.arrow")):
            with pa.ipc.open_stream(path) as reader:
                out += reader.read_all().to_pylist()
        return out
    return pq.read_table(sorted((folder / "data").glob("*.parquet"))).to_pylist()


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_every_writer_holds_the_row_contract(run, tmp_path, fmt):
    """Each writer implements the Writer protocol, and each column it writes is a row column holding the
    row's value (or JSON text of it), or one of the extras it declares; the provenance columns always."""
    _, src, _, made = run
    assert isinstance(WRITERS[fmt](), Writer)
    export_file(src, tmp_path / fmt, fmt)
    written = _written_rows(tmp_path / fmt, fmt)
    want = [r for r in made if r["status"] == "ok"]
    assert len(written) == len(want) > 0
    for got, row in zip(written, want):
        assert set(META_COLUMNS) <= set(got), fmt
        for col, value in got.items():
            if col in WRITER_EXTRA[fmt]:
                continue
            assert col in rows.COLUMNS, (fmt, col)
            if col in WRITER_JSON_TEXT.get(fmt, ()) and value is not None:
                value = json.loads(value)
            assert value == row[col], (fmt, col)


def test_a_segment_of_no_known_kind_is_refused_by_export(run, tmp_path):
    """Segments name what each span of ids is; an unknown kind went into every export."""
    _, _, _, made = run
    rows_ = [json.loads(json.dumps(r)) for r in made[:4] if r["status"] == "ok"]
    rows_[0]["segments"][1]["kind"] = "bonus"
    src = write_jsonl(tmp_path / "bad.jsonl", rows_)
    with pytest.raises(rows.RowError) as err:
        export_file(src, tmp_path / "out", "specforge")
    assert (err.value.line, err.value.field) == (1, "segments[1].kind")
    assert err.value.detail.startswith("is 'bonus', not one of prompt, format, think_start, reasoning, think_end")
    assert not (tmp_path / "out").exists()


def test_segment_kinds_are_the_prompt_and_every_dialects_part_kinds():
    from tokenbridge.chat.dialect import PART_KINDS

    assert ("prompt", *PART_KINDS) == rows.SEGMENT_KINDS


@pytest.mark.parametrize(("message", "field", "detail"), [
    ({"role": "", "content": "x"}, "messages[0].role",
     "unknown role '' (expected one of ['assistant', 'developer', 'system', 'tool', 'user'])"),
    ({"role": "user", "content": {"text": "x"}}, "messages[0].content",
     "must be a string, null or a list of content parts, got dict"),
])
def test_export_refuses_a_message_prompt_loading_would_not_send(run, tmp_path, message, field, detail):
    """The conversations export writes messages as they are, for a trainer: a row whose
    message has no known role or content of another type stops it, naming file:line:field."""
    from typer.testing import CliRunner

    from tokenbridge.cli import app

    _, _, _, made = run
    rows_ = [dict(r) for r in made[:3]]
    rows_[1]["messages"] = [message]
    src = write_jsonl(tmp_path / "bad.jsonl", rows_)
    res = CliRunner().invoke(app, ["export", str(src), "-o", str(tmp_path / "o"), "-f", "conversations"])
    assert res.exit_code == 1
    assert f"error: {src}:2: {field}: {detail}\n" in res.output
    assert not (tmp_path / "o" / "conversations.jsonl").exists()


def test_pyarrows_words_on_a_damaged_parquet_file_stay_on_one_line(tmp_path, monkeypatch):
    """thrift's message holds a line break: the error printed as two ``error:`` lines, the
    second a lone ``)``."""
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1" + b"\0" * 64 + b"PAR1")

    def broken(*args, **kwargs):
        raise OSError("Couldn't deserialize thrift: TProtocolException: Invalid data\n")

    monkeypatch.setattr(pq, "ParquetFile", broken)
    with pytest.raises(rows.RowError) as err:
        list(rows.iter_rows(path))
    assert "\n" not in str(err.value)
    assert str(err.value).endswith("not a readable Parquet file (Couldn't deserialize thrift: TProtocolException: "
                                   "Invalid data)")
