"""reconstruct / inspect on files: bad lines, Parquet, workers, and the CLI."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import EXAMPLE_EXCHANGES, read_jsonl
from tokenbridge.cli import app
from tokenbridge.reconstruct import reconstruct_file

EXAMPLE = EXAMPLE_EXCHANGES


def test_example_file_reconstructs_with_its_bad_line_reported(tmp_path, kimi):
    out = tmp_path / "out.jsonl"
    summary = reconstruct_file(EXAMPLE, out, kimi)
    assert [(b.line, b.field) for b in summary.bad_lines] == [(8, "request.messages[0].role")]
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == ["ex-clean", "ex-tool", "ex-cjk", "ex-leak", "ex-truncated", "ex-instant", "ex-parsed"]
    status = {r["id"]: (r["status"], sorted(f["code"] for f in r["findings"])) for r in rows}
    assert status == {
        "ex-clean": ("ok", []),
        "ex-tool": ("ok", []),
        "ex-cjk": ("ok", []),
        "ex-leak": ("rejected", ["eos_in_text"]),
        "ex-truncated": ("flagged", ["truncated"]),
        "ex-instant": ("ok", []),
        "ex-parsed": ("rejected", ["structured_tool_calls", "usage_completion_mismatch"]),
    }
    assert summary.to_dict()["status"] == {"ok": 4, "flagged": 1, "rejected": 2}
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_parquet_and_two_workers_equal_jsonl(tmp_path, kimi):
    big = tmp_path / "many.jsonl"
    lines = [line for line in EXAMPLE.read_text(encoding="utf-8").splitlines()]
    with big.open("w", encoding="utf-8") as fh:
        for k in range(40):
            for line in lines:
                rec = json.loads(line)
                rec["id"] = f"{rec['id']}-{k}"
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    s1 = reconstruct_file(big, one, kimi, workers=1)
    s2 = reconstruct_file(big, two, kimi, workers=2, chunk_lines=7)
    assert one.read_bytes() == two.read_bytes()
    assert s1.to_dict() == s2.to_dict() and len(s1.bad_lines) == 40
    pq_out = tmp_path / "out.parquet"
    reconstruct_file(big, pq_out, kimi, workers=1)
    table = pq.read_table(pq_out).to_pylist()
    rows = read_jsonl(one)
    assert len(table) == len(rows)
    for a, b in zip(table, rows):
        for key in ("id", "status", "prompt_ids", "completion_ids", "input_ids", "loss_mask", "segments", "findings"):
            assert a[key] == b[key], key
        assert json.loads(a["messages"]) == b["messages"]


def test_cli_reconstruct_summary_and_exit_code(tmp_path, kimi_dir):
    out = tmp_path / "r.jsonl"
    summary = tmp_path / "s.json"
    res = CliRunner().invoke(app, ["reconstruct", str(EXAMPLE), "-o", str(out), "--tokenizer", str(kimi_dir),
                                   "--summary-json", str(summary)])
    assert res.exit_code == 1
    assert "exchanges.jsonl:8: request.messages[0].role: missing\n" in res.output
    assert "structured_tool_calls" in res.output and "eos_in_text" in res.output
    assert json.loads(summary.read_text())["status"] == {"ok": 4, "flagged": 1, "rejected": 2}
    assert len(read_jsonl(out)) == 7


def test_cli_reconstruct_policy_flags(tmp_path, kimi_dir):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(EXAMPLE.read_text(encoding="utf-8").splitlines()[:7]) + "\n", encoding="utf-8")
    out = tmp_path / "r.jsonl"
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(out), "-t", str(kimi_dir),
                                   "--warn", "eos_in_text", "--off", "truncated"])
    assert res.exit_code == 0, res.output
    status = {r["id"]: r["status"] for r in read_jsonl(out)}
    assert status["ex-leak"] == "flagged" and status["ex-truncated"] == "ok"
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(out), "-t", str(kimi_dir), "--warn", "bogus"])
    assert res.exit_code == 2 and "unknown finding code 'bogus'" in res.output


def test_cli_inspect_shows_marker_positions(tmp_path, kimi, kimi_dir):
    out = tmp_path / "r.jsonl"
    reconstruct_file(EXAMPLE, out, kimi)
    row = next(r for r in read_jsonl(out) if r["id"] == "ex-tool")
    pos = row["input_ids"].index(163607)
    res = CliRunner().invoke(app, ["inspect", str(out), "-t", str(kimi_dir), "--id", "ex-tool", "--tokens", f"{pos}:{pos + 2}"])
    assert res.exit_code == 0, res.output
    assert f"</think> (163607) at position {pos} [think_end]" in res.output
    assert f"<|im_end|> (163586) at position {len(row['input_ids']) - 1} [end]" in res.output
    assert "163595" in res.output and "ok" in res.output


def test_cli_inspect_reconstructs_an_exchange_file_on_the_fly(kimi_dir):
    res = CliRunner().invoke(app, ["inspect", str(EXAMPLE), "-t", str(kimi_dir), "--id", "ex-leak"])
    assert res.exit_code == 0 and "eos_in_text" in res.output


def test_cli_inspect_names_a_missing_sample(tmp_path, kimi, kimi_dir):
    out = tmp_path / "r.jsonl"
    reconstruct_file(EXAMPLE, out, kimi)
    res = CliRunner().invoke(app, ["inspect", str(out), "-t", str(kimi_dir), "--id", "missing"])
    assert res.exit_code == 2 and "no sample 'missing' with choice 0" in res.output
    res = CliRunner().invoke(app, ["inspect", str(out), "-t", str(kimi_dir), "--id", ""])
    assert res.exit_code == 2 and "no sample '' with choice 0" in res.output


def test_cli_inspect_of_an_id_says_what_it_could_not_read(tmp_path, kimi, kimi_dir):
    """A cold tester's: with ``--id``, a UTF-16 file and a file whose wanted row holds NaN
    both said only "no sample 'ex-clean' with choice 0" (export named the cause)."""
    out = tmp_path / "r.jsonl"
    reconstruct_file(EXAMPLE, out, kimi)
    wide = tmp_path / "wide.jsonl"
    wide.write_bytes(out.read_text(encoding="utf-8").encode("utf-16"))
    res = CliRunner().invoke(app, ["inspect", str(wide), "-t", str(kimi_dir), "--id", "ex-clean"])
    assert res.exit_code == 2 and res.output.startswith(f"error: {wide}: UTF-16LE text, not JSONL: "), res.output
    lines = out.read_text(encoding="utf-8").splitlines()
    at = next(k for k, line in enumerate(lines) if json.loads(line)["id"] == "ex-clean")
    lines[at] = lines[at].replace('"choice":0', '"choice":NaN', 1)
    nan = tmp_path / "nan.jsonl"
    nan.write_text("\n".join(lines) + "\n", encoding="utf-8")
    res = CliRunner().invoke(app, ["inspect", str(nan), "-t", str(kimi_dir), "--id", "ex-clean"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (f"error: {nan}: no sample 'ex-clean' with choice 0; 1 line(s) could not be read, the "
                                  f"sample may be among them (first: {nan}:{at + 1}: <line>: not valid JSON (NaN at "
                                  "choice: JSON has no NaN or infinity))")


@pytest.mark.parametrize(("change", "said"), [
    ({"choice": "0"}, "choice: must be a non-negative integer, got '0'"),
    ({"choice": -1}, "choice: must be a non-negative integer, got -1"),
    ({"choice": True}, "choice: must be a non-negative integer, got True"),
])
def test_cli_inspect_names_a_mistyped_choice_not_a_missing_sample(tmp_path, kimi, kimi_dir, change, said):
    """A row whose choice is no count was passed over: "no sample 'ex-tool' with choice 0"
    (exit 2) sent the user looking for a sample that is there (a cold tester's); export names it."""
    out = tmp_path / "r.jsonl"
    reconstruct_file(EXAMPLE, out, kimi)
    rows = [dict(r, **change) if r["id"] == "ex-tool" else r for r in read_jsonl(out)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    line = next(k for k, r in enumerate(rows, start=1) if r["id"] == "ex-tool")
    res = CliRunner().invoke(app, ["inspect", str(out), "-t", str(kimi_dir), "--id", "ex-tool"])
    assert res.exit_code == 1 and res.output.splitlines() == [f"error: {out}:{line}: {said}"], res.output


@pytest.mark.parametrize(("column", "said"), [
    (lambda choices: pa.array([str(c) for c in choices]), "choice: must be a non-negative integer, got '0'"),
    (lambda choices: pa.array([c - 1 for c in choices], type=pa.int64()),
     "choice: must be a non-negative integer, got -1"),
])
def test_cli_inspect_names_a_mistyped_choice_in_parquet_too(tmp_path, kimi, kimi_dir, column, said):
    """The Parquet path passed such a row over as well (a cold reviewer's)."""
    out = tmp_path / "r.parquet"
    reconstruct_file(EXAMPLE, out, kimi)
    table = pq.read_table(out)
    table = table.set_column(table.column_names.index("choice"), "choice", column(table.column("choice").to_pylist()))
    pq.write_table(table, out)
    line = 1 + table.column("id").to_pylist().index("ex-tool")
    res = CliRunner().invoke(app, ["inspect", str(out), "-t", str(kimi_dir), "--id", "ex-tool"])
    assert res.exit_code == 1 and res.output.splitlines() == [f"error: {out}:{line}: {said}"], res.output


def test_lone_surrogate_in_file_is_gated_and_output_stays_utf8(tmp_path, kimi):
    line = json.loads(EXAMPLE.read_text(encoding="utf-8").splitlines()[0])
    text = json.dumps(line, ensure_ascii=True).replace("Canberra", "Canb\\ud800rra", 1)
    src = tmp_path / "s.jsonl"
    src.write_text(text + "\n", encoding="ascii")
    out = tmp_path / "o.jsonl"
    reconstruct_file(src, out, kimi)
    raw = out.read_bytes()
    raw.decode("utf-8")  # valid UTF-8 on disk
    row = json.loads(raw)
    assert row["status"] == "rejected"
    assert "roundtrip_mismatch" in [f["code"] for f in row["findings"]]
    assert "\ud800" in row["content"]


def test_not_json_line_is_reported(tmp_path, kimi):
    src = tmp_path / "s.jsonl"
    src.write_text(EXAMPLE.read_text(encoding="utf-8").splitlines()[0] + "\n{not json\n", encoding="utf-8")
    summary = reconstruct_file(src, tmp_path / "o.jsonl", kimi)
    assert [(b.line, b.field) for b in summary.bad_lines] == [(2, "<line>")]
    assert "not valid JSON" in summary.bad_lines[0].message


def test_parquet_output_keeps_odd_field_types(tmp_path, kimi):
    rec = json.loads(EXAMPLE.read_text(encoding="utf-8").splitlines()[0])
    rec["response"]["provider"] = {"name": "X"}
    rec["response"]["choices"][0]["index"] = "0"
    src = tmp_path / "s.jsonl"
    src.write_text(json.dumps(rec) + "\n", encoding="utf-8")
    out = tmp_path / "o.parquet"
    reconstruct_file(src, out, kimi)
    row, = pq.read_table(out).to_pylist()
    assert json.loads(row["provider"]) == {"name": "X"} and row["choice"] == 0


@pytest.mark.parametrize(("file", "flags", "code", "message"), [
    ("s.jsonl", ["--id", "ex-tool"], 0, "ex-tool"),  # a bad line before the sample is passed over
    ("s.jsonl", ["--id", "ex-tool", "--tokens", "a:b"], 2, "--tokens"),
    ("s.jsonl", ["--choice", "-1"], 2, "--choice"),
    ("b.jsonl", ["--id", "ex-broken"], 2, "b.jsonl:1: request.messages[0].role"),  # the record with no role
], ids=["bad-line-skipped", "bad-span", "negative-choice", "broken-record"])
def test_cli_inspect_survives_bad_lines_and_bad_flags(tmp_path, kimi_dir, file, flags, code, message):
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    (tmp_path / "s.jsonl").write_text("{not json\n" + lines[1] + "\n", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text(lines[7] + "\n", encoding="utf-8")
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / file), "-t", str(kimi_dir), *flags])
    assert res.exit_code == code and message in res.output, res.output
    assert "Traceback" not in res.output


def test_stripping_provider_is_named_across_a_run():
    from tokenbridge.reconstruct import ReconstructSummary

    s = ReconstructSummary()
    for i in range(30):
        s.add([("ok", [], "clean", i % 3 == 0)])   # a third keep a trailing newline or the like
        s.add([("ok", [], "stripper", False)])     # never
        s.add([("ok", [], "few", False)] if i < 5 else [])
    notes = s.stripping_suspects()
    assert len(notes) == 1 and notes[0].startswith("stripper: none of its 30 samples")
    assert s.to_dict()["provider_notes"] == notes
    lone = ReconstructSummary()
    lone.add([("ok", [], "stripper", False)] * 40)
    assert lone.stripping_suspects() == []  # nothing to compare against


def test_cli_empty_input_warns_and_writes_an_empty_file(tmp_path, kimi_dir):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(tmp_path / "o.jsonl"), "-t", str(kimi_dir)])
    assert res.exit_code == 0
    assert f"warning: {src} holds no records; {tmp_path / 'o.jsonl'} has no rows.\n" in res.output
    assert (tmp_path / "o.jsonl").read_bytes() == b""


def test_cli_many_bad_lines_show_twenty_then_a_count_and_say_nothing_was_written(tmp_path, kimi_dir):
    src = tmp_path / "bad.jsonl"
    src.write_text("{not json\n" * 25)
    out = tmp_path / "o.jsonl"
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(out), "-t", str(kimi_dir)])
    assert res.exit_code == 1
    shown = [x for x in res.output.splitlines() if x.startswith("bad record: ")]
    assert [x.split(":")[2] for x in shown] == [str(n) for n in range(1, 21)]
    assert res.output.endswith(f"... and 5 more bad lines\nno record was written: {out} is empty.\n")


@pytest.mark.parametrize(("suffix", "workers"), [(".jsonl", "1"), (".jsonl", "2"), (".parquet", "1"), (".parquet", "2")])
def test_records_that_crashed_the_run_are_bad_lines_and_the_rest_is_written(tmp_path, kimi_dir, suffix, workers):
    """Found by a hostile-input test: each of these was a traceback (exit 8) that lost every
    good record of the file. Now each is its own bad line, named, and the others are rows."""
    good = EXAMPLE.read_text(encoding="utf-8").splitlines()[0]
    rec = json.loads(good)
    extra = {**rec, "request": {**rec["request"], "extra_body": "x"}}
    listed = json.loads(good)
    listed["response"]["choices"][0]["finish_reason"] = ["stop"]
    too_deep = good[:-1] + ', "x": ' + "[" * 1100 + "]" * 1100 + "}"  # past orjson's 1024: the stdlib's recursion
    walked = json.loads(good)  # parsed (under 1024 levels), too deep for Python to walk
    walked["request"]["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"x": "DEEP"}}}]
    walked_line = json.dumps(walked).replace('"DEEP"', "[" * 1000 + "]" * 1000)
    src = tmp_path / "in.jsonl"
    lines = [good, json.dumps(extra), json.dumps(listed), too_deep, walked_line, good.replace('"ex-clean"', '"ex-2"')]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / f"out{suffix}"
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(out), "-t", str(kimi_dir), "-j", workers])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and "internal error" not in res.output
    assert f"{src}:2: request.extra_body: must be an object or null, got str" in res.output
    assert f"{src}:3: response.choices[0].finish_reason: must be a string or null, got list" in res.output
    assert f"{src}:4: <line>: nested more than 1024 levels deep" in res.output
    assert f"{src}:5: <record>: nested too deeply to reconstruct (RecursionError)" in res.output
    rows = read_jsonl(out) if suffix == ".jsonl" else pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == ["ex-clean", "ex-2"]


@pytest.mark.parametrize(("workers", "suffix"), [(1, ".jsonl"), (2, ".jsonl"), (1, ".parquet"), (2, ".parquet")])
def test_a_repeated_id_is_a_bad_line_naming_the_first_and_its_rows_are_left_out(tmp_path, kimi, workers, suffix):
    """export takes each (id, choice) once and refused the whole file over a repeat that
    reconstruct let through; now reconstruct says so per record and keeps the first."""
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()[:7]
    many = [json.dumps({**json.loads(line), "id": f"r{k}"}) for k in range(60) for line in lines[k % 7 : k % 7 + 1]]
    repeats = {10: 3, 11: 3, 25: 0, 59: 58}  # line index -> the index whose id it repeats
    with_repeats = [json.dumps({**json.loads(line), "id": f"r{repeats.get(k, k)}"}) for k, line in enumerate(many)]
    src, clean_src = tmp_path / "in.jsonl", tmp_path / "clean.jsonl"
    src.write_text("\n".join(with_repeats) + "\n", encoding="utf-8")
    clean_src.write_text("\n".join(line for k, line in enumerate(with_repeats) if k not in repeats) + "\n", encoding="utf-8")
    out, clean = tmp_path / f"out{suffix}", tmp_path / f"clean-out{suffix}"
    summary = reconstruct_file(src, out, kimi, workers=workers, chunk_lines=4)
    assert [(b.line, b.field, b.message) for b in summary.bad_lines] == [
        (k + 1, "id", f"'r{first}' is also the id of line {first + 1}: each record once (its rows are named by id and choice)")
        for k, first in sorted(repeats.items())]
    reconstruct_file(clean_src, clean, kimi, workers=1)
    if suffix == ".jsonl":
        assert out.read_bytes() == clean.read_bytes()
    else:
        assert pq.read_table(out).to_pylist() == pq.read_table(clean).to_pylist()
    assert summary.records == 60 - len(repeats)


def test_a_lone_surrogate_reaches_parquet_as_its_json_text(tmp_path, kimi):
    """An API's "\\ud800" (valid JSON, flagged by the gate) crashed reconstruct's Parquet
    writer and the Parquet export with UnicodeEncodeError, exit 8: an Arrow string is UTF-8.
    The text is stored as its JSON text, as other odd API values in text columns are."""
    from tokenbridge.export import export_file

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "s", "request": {"messages": [{"role": "user", "content": "hi"}]}, "response": {"choices": '
                   '[{"message": {"content": "a\\ud800b", "reasoning": "r"}, "finish_reason": "stop"}]}}\n', encoding="utf-8")
    reconstruct_file(src, tmp_path / "out.parquet", kimi, workers=1)
    (row,) = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert row["content"] == '"a\\ud800b"' and row["reasoning"] == "r" and row["status"] == "rejected"
    reconstruct_file(src, tmp_path / "out.jsonl", kimi, workers=1)
    ok = json.loads((tmp_path / "out.jsonl").read_text(encoding="utf-8"))
    ok.update(status="ok", findings=[])  # as if the gate had passed it: the export names it, never crashes
    (tmp_path / "edited.jsonl").write_text(json.dumps(ok) + "\n", encoding="utf-8")
    with pytest.raises(Exception, match=r"edited.jsonl:1: content: holds a lone surrogate \(not UTF-8\): no training "
                                        "file can carry it"):  # (it was written as its JSON text: a loader's refusal)
        export_file(tmp_path / "edited.jsonl", tmp_path / "x", "parquet")
    assert not (tmp_path / "x").exists()
    big = dict(ok, choice=2**31)
    (tmp_path / "big.jsonl").write_text(json.dumps(big) + "\n", encoding="utf-8")
    with pytest.raises(Exception, match=r"big.jsonl:1: choice: must be a non-negative integer up to 2147483647"):
        export_file(tmp_path / "big.jsonl", tmp_path / "y", "parquet")


@pytest.mark.parametrize("kind", ["gzip", "parquet", "sqlite", "utf-16", "utf-16-be", "utf-32"])
@pytest.mark.parametrize("command", ["reconstruct", "inspect", "export", "vocab"])
def test_an_input_that_is_plainly_not_jsonl_is_one_line(tmp_path, kimi_dir, kind, command):
    """A gzip, Parquet or SQLite file given as JSONL was read line by line: one "not valid
    JSON" per binary line, an empty output, exit 1 (inspect: "no sample"). Now one line
    naming what it is, exit 2, nothing written."""
    import gzip
    import sqlite3

    import pyarrow as pa

    path = tmp_path / "in.jsonl"
    if kind == "gzip":
        path.write_bytes(gzip.compress(EXAMPLE.read_bytes()))
    elif kind == "parquet":
        pq.write_table(pa.table({"id": ["a"]}), path)
    elif kind == "sqlite":
        sqlite3.connect(path).execute("CREATE TABLE t (x)").connection.commit()
    else:  # PowerShell's ">" writes UTF-16 with a byte-order mark; without one too ("utf-16-be")
        path.write_bytes(EXAMPLE.read_text(encoding="utf-8").encode(kind))
    out = tmp_path / ("out.jsonl" if command == "reconstruct" else "out")
    args = {"reconstruct": ["-o", str(out), "-t", str(kimi_dir)], "inspect": ["-t", str(kimi_dir)],
            "export": ["-o", str(out), "-f", "specforge"], "vocab": ["-o", str(out), "-n", "64", "-t", str(kimi_dir)]}[command]
    res = CliRunner().invoke(app, [command, str(path), *args])
    name = {"gzip": "a gzip file", "parquet": "a Parquet file", "sqlite": "an SQLite database", "utf-16": "UTF-16LE text",
            "utf-16-be": "UTF-16BE text", "utf-32": "UTF-32LE text"}[kind]
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: {name}, not JSONL: "), lines
    assert not out.exists()


def test_a_compressed_pipe_is_one_line_too(tmp_path, kimi_dir):
    """A pipe is looked at once read (its bytes cannot be peeked at and left for the reader):
    gzip through /dev/stdin gave one "not valid JSON" per line and an empty output."""
    import gzip
    import os
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "o.jsonl"
    res = subprocess.run([sys.executable, "-m", "tokenbridge.cli", "reconstruct", "/dev/stdin", "-o", str(out),
                          "-t", str(kimi_dir)], input=gzip.compress(EXAMPLE.read_bytes()), capture_output=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.decode().strip().splitlines() == [
        "error: /dev/stdin: a gzip file, not JSONL: decompress it first (gunzip)"]
    assert sorted(os.listdir(tmp_path)) == []


def test_a_summary_json_that_cannot_be_written_fails_before_the_output_is_replaced(tmp_path, kimi_dir, monkeypatch):
    """On a read-only place, ``--summary-json`` failed after ``-o`` had been replaced, and the
    error said "nothing partial was kept" (a cold tester's): its temp is made first now."""
    import errno

    from tokenbridge import fsio

    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"my earlier output": 1}\n')
    summary = tmp_path / "ro" / "summary.json"
    prepare = fsio._prepare_parent

    def read_only(target):
        if target.name == "summary.json":
            raise fsio.OutputWriteError(target, OSError(errno.EROFS, "Read-only file system"))
        prepare(target)

    monkeypatch.setattr(fsio, "_prepare_parent", read_only)
    res = CliRunner().invoke(app, ["reconstruct", str(EXAMPLE), "-o", str(out), "-t", str(kimi_dir),
                                   "--summary-json", str(summary)])
    assert res.exit_code == 1 and res.output.splitlines() == [
        f"error: {summary}: cannot write (Read-only file system); nothing partial was kept"]
    assert out.read_bytes() == b'{"my earlier output": 1}\n'


def test_a_rejected_row_whose_text_is_not_utf8_is_shown_by_inspect(tmp_path, kimi_dir):
    """A lone surrogate the API escaped in a message (``\\udcff``): reconstruct rejects the
    sample (its text cannot be encoded exactly) and writes its row; inspect then refused that
    row, "no training file can carry it" (a cold tester's). A rejected row is shown, escaped;
    an ok row's texts are still held to what a training file can carry. The same character
    as a raw byte in the file is no JSON text: one bad line naming its field."""
    rec = json.loads(EXAMPLE.read_text(encoding="utf-8").splitlines()[0])
    rec["request"]["messages"][0]["content"] = "PLACEHOLDER"
    src = tmp_path / "in.jsonl"
    out = tmp_path / "out.jsonl"
    src.write_bytes(json.dumps(rec).encode().replace(b"PLACEHOLDER", b"abc\xffdef") + b"\n")
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(out), "-t", str(kimi_dir)])
    assert res.exit_code == 1 and out.read_bytes() == b"", res.output
    at = src.read_bytes().index(b"abc") + 3
    assert (f"bad record: {src}:1: request.messages[0].content: not valid UTF-8 (byte 0xff at byte {at}: "
            "invalid start byte)") in res.output.splitlines()
    src.write_bytes(json.dumps(rec).encode().replace(b"PLACEHOLDER", b"abc\\udcffdef") + b"\n")
    CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(out), "-t", str(kimi_dir)])
    row = json.loads(out.read_text(encoding="utf-8"))
    assert row["status"] == "rejected" and row["messages"][0]["content"] == "abc\udcffdef"
    res = CliRunner().invoke(app, ["inspect", str(out), "-t", str(kimi_dir)])
    assert res.exit_code == 0 and "roundtrip_mismatch" in res.output, res.output
    # under a user's policy that only warns of the round trip the row is flagged: shown too
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(out), "-t", str(kimi_dir), "--warn",
                                   "roundtrip_mismatch", "--off", "usage_prompt_mismatch"])
    assert json.loads(out.read_text(encoding="utf-8"))["status"] == "flagged", res.output
    res = CliRunner().invoke(app, ["inspect", str(out), "-t", str(kimi_dir)])
    assert res.exit_code == 0 and "roundtrip_mismatch" in res.output, res.output
    # no training file can carry it: the export of that row is refused, naming it
    res = CliRunner().invoke(app, ["export", str(out), "-o", str(tmp_path / "exp"), "-f", "specforge",
                                   "--include-flagged"])
    assert res.exit_code == 1 and "messages[0].content: holds a lone surrogate" in res.output, res.output


def test_an_input_named_like_a_temp_survives_the_summary_json_made_beside_it(tmp_path, kimi_dir):
    """--summary-json's temp, made before the input was registered, swept the input away
    (a cold reviewer's): the input is registered first."""
    folder = tmp_path / "sj"
    folder.mkdir()
    src = folder / ".in.jsonl.999999-deadbeef.tbtmp"
    src.write_bytes(EXAMPLE.read_bytes())
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(folder / "out.jsonl"), "-t", str(kimi_dir),
                                   "--summary-json", str(folder / "s.json")])
    assert res.exit_code == 1 and src.read_bytes() == EXAMPLE.read_bytes(), res.output  # 1: the example's bad line
    assert json.loads((folder / "s.json").read_text(encoding="utf-8"))["records"] == 7


def test_out_of_memory_in_another_command_gives_its_own_advice(tmp_path, monkeypatch, stage_inputs):
    """export has no --workers and no bad lines of its own: the advice is reconstruct's only."""
    import tokenbridge.export as E

    def starved(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(E, "export_file", starved)
    res = CliRunner().invoke(app, ["export", str(stage_inputs / "reconstructed.jsonl"), "-o", str(tmp_path / "x"),
                                   "-f", "specforge"])
    assert res.exit_code == 1 and res.output.splitlines() == [
        "error: out of memory; nothing partial was kept: give the command more memory"]


def test_an_input_replaced_between_passes_is_one_error_line_and_keeps_the_old_output(tmp_path, kimi, kimi_dir,
                                                                                      monkeypatch):
    """The second pass reopened the input by path and read whatever file had taken its name."""
    from test_lanes import _between_passes, _uncounted_run

    src, out, other = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "other.jsonl"
    _uncounted_run(kimi, src)
    _uncounted_run(kimi, other, tag="new")
    out.write_bytes(b"old\n")
    _between_passes(monkeypatch, lambda: os.replace(other, src))
    res = CliRunner().invoke(app, ["reconstruct", str(src), "-o", str(out), "-t", str(kimi_dir), "--workers", "1"])
    assert res.exit_code == 1 and res.output.splitlines() == [
        f"error: {src}: another file took its name while it was being read (renamed or copied over it); nothing "
        "partial was kept: run again on a file nothing is writing"], res.output
    assert out.read_bytes() == b"old\n"
