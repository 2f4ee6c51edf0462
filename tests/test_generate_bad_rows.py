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
    # a history call reconstruct refuses (no arguments) was sent and paid for, then a bad line
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null, "tool_calls": '
     '[{"id": "c", "type": "function", "function": {"name": "f"}}]}, {"role": "user", "content": "y"}]}',
     "field 'messages[1].tool_calls[0].function.arguments': missing"),
    ('{"messages": [{"role": "assistant", "content": "", "tool_calls": "call"}, {"role": "user", "content": "y"}]}',
     "field 'messages[0].tool_calls': must be a list or null, got str"),
    # a key given twice: the last was sent without a word (a cold tester's)
    ('{"id": "d", "prompt": "first", "prompt": "second"}', "field '<line>': not valid JSON: the key 'prompt' appears "
     "twice in one object: which value is meant is unclear (readers keep the first or the last)"),
    ('{"messages": [{"role": "user", "content": "a", "content": "b"}]}', "field '<line>': not valid JSON: the key "
     "'content' appears twice in one object: which value is meant is unclear (readers keep the first or the last)"),
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


# --- Arrow data whose strings are not UTF-8, or whose layout is damaged ------------------


def _strings(values: list[bytes | None]):
    """A string array holding ``values`` byte for byte (pyarrow checks no UTF-8 on write;
    other writers store such bytes too)."""
    import pyarrow as pa

    offsets = [0]
    for v in values:
        offsets.append(offsets[-1] + len(v or b""))
    valid = pa.array([v is not None for v in values]).buffers()[1]
    return pa.Array.from_buffers(pa.string(), len(values), [valid, pa.array(offsets, pa.int32()).buffers()[1],
                                                            pa.py_buffer(b"".join(v or b"" for v in values))])


def _bad_utf8_table():
    """Rows ok1, bad (its prompt), ok2, msgbad (its second message's content), msgok; and a
    column of bytes that are not UTF-8 either, which no row is made of."""
    import pyarrow as pa

    contents = _strings([b"sys", b"q\xff\xfex", b"fine", b"q-msg-ok"])
    messages = pa.ListArray.from_arrays(pa.array([0, 0, 0, 0, 2, 4], pa.int32()), pa.StructArray.from_arrays(
        [pa.array(["system", "user", "system", "user"]), contents], ["role", "content"]),
        mask=pa.array([True, True, True, False, False]))
    return pa.table({"id": ["ok1", "bad", "ok2", "msgbad", "msgok"],
                     "prompt": _strings([b"q-ok1", b"q-\xc3(", b"q-ok2", None, None]),
                     "messages": messages,
                     "note": _strings([b"\xff"] * 5)})


_UTF8_ERRORS = [
    ("row 1", "prompt", "not valid UTF-8 (byte 0xc3 at byte 2: invalid continuation byte)"),
    ("row 3", "messages[1].content", "not valid UTF-8 (byte 0xff at byte 1: invalid start byte)"),
]


def test_a_parquet_string_that_is_not_utf8_is_one_bad_row_naming_the_field(tmp_path):
    """to_pylist raised UnicodeDecodeError for the whole batch: exit 8 and no row sent."""
    import pyarrow.parquet as pq

    f = tmp_path / "u.parquet"
    pq.write_table(_bad_utf8_table(), f)
    loaded = load_prompts([DatasetSpec("u", f)])
    assert [s.id for s in loaded.samples] == ["u-ok1", "u-ok2", "u-msgok"]
    assert [(e.location, e.field, e.message) for e in loaded.errors] == _UTF8_ERRORS
    assert str(loaded.errors[0]) == f"{f}: row 1: field 'prompt': {_UTF8_ERRORS[0][2]}"
    assert loaded.samples[2].messages == [{"role": "system", "content": "fine"}, {"role": "user", "content": "q-msg-ok"}]


def _save_to_disk(folder: Path, table) -> Path:
    import pyarrow as pa

    folder.mkdir()
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return folder


def test_a_save_to_disk_string_that_is_not_utf8_is_one_bad_row_naming_the_field(tmp_path):
    folder = _save_to_disk(tmp_path / "hf", _bad_utf8_table())
    loaded = load_prompts([DatasetSpec("u", folder)])
    assert [s.id for s in loaded.samples] == ["u-ok1", "u-ok2", "u-msgok"]
    assert [(e.location, e.field, e.message) for e in loaded.errors] == _UTF8_ERRORS


def test_rows_not_utf8_are_reported_and_the_others_sent(tmp_path):
    import pyarrow.parquet as pq

    f = tmp_path / "u.parquet"
    pq.write_table(_bad_utf8_table(), f)
    with HostileServer() as srv:
        settings = GenerateSettings(datasets=(DatasetSpec("u", f),), request=RequestSettings(model="m", max_tokens=8),
                                    base_url=srv.url, concurrency=1, progress="none")
        summary = asyncio.run(agenerate_run(settings, tmp_path / "run"))
        assert dict(srv.attempts) == {"q-ok1": 1, "q-ok2": 1, "q-msg-ok": 1}
    assert (summary.done, summary.exit_code) == (3, ExitCode.INCOMPLETE)
    assert summary.bad_rows == [f"{f}: {where}: field '{field}': {why}" for where, field, why in _UTF8_ERRORS]


def test_an_arrow_file_whose_offsets_point_outside_its_data_is_one_error_not_a_crash(tmp_path):
    """An offset past the data buffer was read as it was: UnicodeDecodeError from whatever
    memory lay there, or SIGSEGV. Run in a child: a regression crashes it, not pytest."""
    import struct
    import subprocess
    import sys

    import pyarrow as pa

    folder = _save_to_disk(tmp_path / "hf", pa.table({"id": [f"r{i}" for i in range(10)], "prompt": ["hello world"] * 10}))
    arrow = folder / "data-00000-of-00001.arrow"
    raw = bytearray(arrow.read_bytes())
    at = raw.find(struct.pack("<3i", 0, 11, 22))  # the prompt column's offsets
    raw[at + 8:at + 12] = struct.pack("<i", 10**6)
    arrow.write_bytes(bytes(raw))
    code = "from tokenbridge.cli import app; app()"
    proc = subprocess.run([sys.executable, "-c", code, "generate", f"d={folder}", "-o", str(tmp_path / "g"),
                           "--dry-run", "-m", "a/b"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (proc.stdout + proc.stderr).strip().splitlines() == [
        f"error: dataset 'd': {arrow}: column 'prompt', rows 0 to 9: damaged "
        "(Offset invariant failure: offset for slot 2 out of bounds: 1000000 > 110)"]


@pytest.mark.parametrize("kind", ["large_string", "dictionary", "string_view", "map"])
def test_other_arrow_string_types_not_utf8_are_bad_rows_too(tmp_path, kind):
    import pyarrow as pa

    prompts = _strings([b"q-ok", b"q-\xff", b"q-ok2"])
    if kind == "large_string":
        column = prompts.view(pa.binary()).cast(pa.large_binary()).view(pa.large_string())
        field = "prompt"
    elif kind == "dictionary":
        column = pa.DictionaryArray.from_arrays(pa.array([0, 1, 2], pa.int32()), prompts)
        field = "prompt"
    elif kind == "string_view":
        if not hasattr(pa, "string_view"):
            pytest.skip("this pyarrow has no string_view")
        column = prompts.view(pa.binary()).cast(pa.binary_view()).view(pa.string_view())
        field = "prompt"
    else:  # a map nobody reads as a prompt: the row is bad all the same, naming the entry
        column = pa.MapArray.from_arrays(pa.array([0, 1, 2, 3], pa.int32()), _strings([b"k", b"\xfe", b"k"]),
                                         pa.array(["v", "v", "v"]))
        field = "tools.<key>"
    table = pa.table({"id": ["a", "b", "c"], "prompt" if kind != "map" else "tools": column,
                      **({"prompt": ["q-ok", "q-bad", "q-ok2"]} if kind == "map" else {})})
    loaded = load_prompts([DatasetSpec("u", _save_to_disk(tmp_path / "hf", table))])
    bad = [e for e in loaded.errors if e.location == "row 1"]
    assert [e.field for e in bad] == [field] and bad[0].message.startswith("not valid UTF-8 (byte 0x"), loaded.errors
    if kind != "map":  # a map is no tools list: its other rows are bad for that
        assert loaded.errors == bad and [s.id for s in loaded.samples] == ["u-a", "u-c"]


def test_a_dry_run_lists_rows_not_utf8_and_exits_1(tmp_path):
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from tokenbridge.cli import app

    f = tmp_path / "u.parquet"
    pq.write_table(_bad_utf8_table(), f)
    res = CliRunner().invoke(app, ["generate", f"u={f}", "-o", str(tmp_path / "g"), "--dry-run", "-m", "a/b"])
    assert res.exit_code == ExitCode.INCOMPLETE, res.output
    assert "samples: 3 (0 already done, 3 to send), bad rows: 2" in res.output
    assert [line for line in res.output.splitlines() if line.startswith("bad row:")] == [
        f"bad row: {f}: {where}: field '{field}': {why}" for where, field, why in _UTF8_ERRORS]


def test_a_parquet_file_with_a_row_column_twice_is_refused(tmp_path):
    """Two ``prompt`` columns: the reader kept the last and sent it without a word."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenbridge.generate.prompts import PromptSourceError

    path = tmp_path / "dup.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["hi"]), pa.array(["yo"])], names=["prompt", "prompt"]), path)
    with pytest.raises(PromptSourceError) as err:
        load_prompts([DatasetSpec("d", path)])
    assert str(err.value) == f"dataset 'd': {path}: column(s) 'prompt' appear twice: which to send is unclear"


@pytest.mark.parametrize(("state", "said"), [
    ({"_data_files": [{"filename": 5}]}, "_data_files[0].filename: must name a file in {folder} (no folder part), got 5"),
    ({"_data_files": [{"filename": "../other/data.arrow"}]},
     "_data_files[0].filename: must name a file in {folder} (no folder part), got '../other/data.arrow'"),
    ({"_data_files": [{"filename": "{outside}"}]},
     "_data_files[0].filename: must name a file in {folder} (no folder part), got '{outside}'"),
    ({"_data_files": "data.arrow"}, "_data_files: must be a list of {{\"filename\": ...}} objects (what datasets' "
                                    "save_to_disk writes), got 'data.arrow'"),
    ([1, 2], "_data_files: must be a list of {{\"filename\": ...}} objects (what datasets' save_to_disk writes), got "
             "a top level that is list"),
    ({"_data_files": [{"filename": "data-00000-of-00001.arrow"}, {"filename": "data-00000-of-00001.arrow"}]},
     "_data_files[1].filename: 'data-00000-of-00001.arrow' is listed twice (its rows would be read twice)"),
])
def test_a_save_to_disk_state_is_read_strictly_and_only_inside_its_folder(tmp_path, state, said):
    """A filename with a folder part read a file elsewhere as this dataset (``../x``, an
    absolute path), one listed twice had its rows read twice as duplicate ids, and a wrong
    type said Python's words ("unsupported operand type(s) for /") (a cold tester's)."""
    import pyarrow as pa

    from tokenbridge.generate.prompts import PromptSourceError

    other = _save_to_disk(tmp_path / "other", pa.table({"id": ["x"], "prompt": ["from elsewhere"]}))
    folder = _save_to_disk(tmp_path / "hf", pa.table({"id": ["a"], "prompt": ["hi"]}))
    outside = str(other / "data-00000-of-00001.arrow")
    text = json.dumps(state).replace("{outside}", outside)
    (folder / "state.json").write_text(text)
    with pytest.raises(PromptSourceError) as err:
        load_prompts([DatasetSpec("d", folder)])
    assert str(err.value).endswith(f"{folder / 'state.json'}: " + said.format(folder=folder, outside=outside))


@pytest.mark.parametrize("split", ["../other", "", "."])
def test_a_split_that_names_another_folder_is_refused(tmp_path, split):
    import pyarrow as pa

    from tokenbridge.generate.prompts import PromptSourceError

    _save_to_disk(tmp_path / "other", pa.table({"id": ["x"], "prompt": ["from elsewhere"]}))
    (tmp_path / "dd").mkdir()
    _save_to_disk(tmp_path / "dd" / "train", pa.table({"id": ["a"], "prompt": ["hi"]}))
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": [split]}))
    with pytest.raises(PromptSourceError) as err:  # "": the folder itself read as its split (a cold reviewer's)
        load_prompts([DatasetSpec("d", tmp_path / "dd")])
    assert str(err.value).endswith(f"dataset_dict.json: splits: {split!r} names no folder in {tmp_path / 'dd'}")


@pytest.mark.parametrize(("data", "kind", "todo"), [
    ('{"id": "a", "prompt": "hi"}\n'.encode("utf-16"), "UTF-16LE text", "convert it to UTF-8 first (iconv -f UTF-16LE "
                                                                        "-t UTF-8)"),
    ('{"id": "a", "prompt": "hi"}\n'.encode("utf-16-be"), "UTF-16BE text", "convert it to UTF-8 first (iconv -f "
                                                                           "UTF-16BE -t UTF-8)"),
    (__import__("gzip").compress(b'{"id": "a", "prompt": "hi"}\n', mtime=0), "a gzip file", "decompress it first (gunzip)"),
])
def test_a_prompt_file_that_is_plainly_not_jsonl_is_one_error_naming_what_it_is(tmp_path, data, kind, todo):
    """A UTF-16 file (PowerShell's ``>``) was a bad row per line in a codec's words ("can't
    decode byte 0x0a ... truncated data", then "Expecting value") (a cold tester's)."""
    from tokenbridge.generate.prompts import PromptSourceError

    path = tmp_path / "p.jsonl"
    path.write_bytes(data)
    with pytest.raises(PromptSourceError) as err:
        load_prompts([DatasetSpec("d", path)])
    assert str(err.value).endswith(f"{path}: {kind}, not JSONL: {todo}")
