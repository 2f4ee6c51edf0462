"""inspect: reads reconstruct's Parquet output; --tokens outside the sample is a clear error."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import EXAMPLE_EXCHANGES as EXAMPLE
from tokenbridge.cli import app
from tokenbridge.reconstruct import reconstruct_file


@pytest.fixture(scope="module")
def outputs(kimi, tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    reconstruct_file(EXAMPLE, root / "r.jsonl", kimi)
    reconstruct_file(EXAMPLE, root / "r.parquet", kimi)
    return root / "r.jsonl", root / "r.parquet"


def _inspect(path, kimi_dir, *args):
    return CliRunner().invoke(app, ["inspect", str(path), "-t", str(kimi_dir), *args])


def test_parquet_output_shows_the_same_as_jsonl(outputs, kimi_dir):
    jsonl, parquet = outputs
    args = ("--id", "ex-parsed", "--tokens", "50:60")
    from_jsonl, from_parquet = _inspect(jsonl, kimi_dir, *args), _inspect(parquet, kimi_dir, *args)
    assert from_parquet.exit_code == 0, from_parquet.output
    assert from_parquet.output == from_jsonl.output
    assert "structured_tool_calls" in from_parquet.output and "ex-parsed choice 0: rejected" in from_parquet.output


def test_parquet_without_the_sample_says_so(outputs, kimi_dir):
    res = _inspect(outputs[1], kimi_dir, "--id", "nope")
    assert res.exit_code == 2 and f"{outputs[1]}: no sample 'nope' with choice 0" in res.output
    res = _inspect(outputs[1], kimi_dir, "--id", "")  # was "no sample (first)", where the first exists
    assert res.exit_code == 2 and f"{outputs[1]}: no sample '' with choice 0" in res.output


@pytest.mark.parametrize("span", ["-5:", "3:-1", "-1"])
def test_negative_positions_are_refused_before_loading(outputs, kimi_dir, span):
    res = _inspect(outputs[0], kimi_dir, "--id", "ex-tool", "--tokens", span)
    assert res.exit_code == 2
    expected = "positions start at 0" if ":" in span else "expected A:B"
    assert expected in res.output


@pytest.mark.parametrize("span", ["5000:", "10:5000", "20:20"])
def test_span_outside_the_sample_names_its_length(outputs, kimi_dir, span):
    n = next(len(r["input_ids"]) for r in map(json.loads, outputs[0].read_text().splitlines()) if r["id"] == "ex-tool")
    res = _inspect(outputs[0], kimi_dir, "--id", "ex-tool", "--tokens", span)
    assert res.exit_code == 2
    want = "empty span: 20 is not below 20" if span == "20:20" else f"the sample has {n} tokens, positions 0 to {n - 1}"
    assert res.output == f"error: --tokens {span}: {want}\n"


def test_inspect_names_the_reading_the_evidence_proved(tmp_path, kimi, kimi_dir):
    from tokenbridge.chat import DIALECTS

    section = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
               "<|tool_call_end|><|tool_calls_section_end|>")
    request = {"model": "m", "messages": [{"role": "user", "content": "Call f."}]}
    truth = kimi.encode("Calling f.") + kimi.encode(section) + [kimi.token_id("<|im_end|>")]
    usage = {"prompt_tokens": len(kimi.encode(DIALECTS["kimi-k2.5"].render_request(request))),
             "completion_tokens": len(truth)}
    rec = {"id": "nt", "request": request, "response": {"usage": usage, "choices": [
        {"index": 0, "finish_reason": "tool_calls", "message": {"reasoning_content": "Calling f.", "content": section}}]}}
    # a run whose plain answers show the end token counted: the count alone could not tell
    # the section opened without </think> from the formula with an uncounted end
    plain = []
    for i in range(24):
        ids = [*kimi.encode(f"Think {i}."), kimi.token_id("</think>"), *kimi.encode(f"Answer {i}."),
               kimi.token_id("<|im_end|>")]
        plain.append({"id": f"p{i}", "request": request, "response": {"usage": {**usage, "completion_tokens": len(ids)},
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"reasoning_content": f"Think {i}.", "content": f"Answer {i}."}}]}})
    src = tmp_path / "ex.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [*plain, rec]))
    reconstruct_file(src, tmp_path / "r.jsonl", kimi)
    res = _inspect(tmp_path / "r.jsonl", kimi_dir, "--id", "nt")
    assert res.exit_code == 0, res.output
    assert "nt choice 0: ok" in res.output and "reconstruction: no_think_close" in res.output
    assert "</think> (163607)" not in res.output


@pytest.mark.parametrize(("value", "message"), [
    (-1, "input_ids: has a negative id at position"),
    (200_000, "input_ids: id 200000 at position"),
    (5.0, "input_ids: must hold integers only, found float at position"),
    ("5", "input_ids: must hold integers only, found str at position"),
])
def test_a_row_edited_by_hand_is_named_not_a_traceback(outputs, kimi_dir, tmp_path, value, message):
    """inspect holds a row from disk to export's contract, ids within the tokenizer's
    vocabulary: each of these was an OverflowError, KeyError or TypeError traceback."""
    row = json.loads(outputs[0].read_text(encoding="utf-8").splitlines()[0])
    at = len(row["prompt_ids"])
    row["completion_ids"][0] = row["input_ids"][at] = value
    path = tmp_path / "edited.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    res = _inspect(path, kimi_dir, "--tokens", f"{at}:{at + 3}")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert f"{path}:1: {message}" in " ".join(res.output.split())


def test_a_rejected_row_and_a_gpt_oss_row_are_shown(tmp_path):
    """inspect holds ``ok`` rows to the training contract only: a rejected row with no
    completion is the one to look at, and harmony's ``format`` segments are a known kind."""
    from conftest import KIMI_DIR

    TOKENIZERS = KIMI_DIR.parent

    def record(rid, content, finish):
        return {"id": rid, "request": {"messages": [{"role": "user", "content": "Hi"}]},
                "response": {"choices": [{"message": {"role": "assistant", "content": content, "reasoning": "r"},
                                          "finish_reason": finish}]}}

    src = tmp_path / "ex.jsonl"
    src.write_text(json.dumps(record("ok1", "Hello.", "stop")) + "\n" + json.dumps(record("cut", "", "length")) + "\n",
                   encoding="utf-8")
    for family in ("qwen3", "gpt-oss"):
        out = tmp_path / f"{family}.jsonl"
        reconstruct_file(src, out, TOKENIZERS / family, workers=1)
        for rid in ("ok1", "cut"):
            res = _inspect(out, TOKENIZERS / family, "--id", rid, "--tokens", ":")
            assert res.exit_code == 0, (family, rid, res.output)
            assert f"{rid} choice 0: " in res.output


@pytest.mark.parametrize(("dialect", "message"), [
    ("qwen3", "error: {tok}: the qwen3 dialect needs the token(s) <|im_start|>, which this tokenizer does not have "
              "(it is kimi-k2.5's: drop the dialect or give kimi-k2.5)\n"),
    ("nope", "error: --dialect: unknown value 'nope' (choose from: "),
])
def test_a_dialect_that_does_not_fit_is_a_bad_flag_as_in_reconstruct(kimi_dir, dialect, message):
    """It was a DialectError traceback (exit 8) where reconstruct says so with exit 2."""
    res = _inspect(EXAMPLE, kimi_dir, "--dialect", dialect)
    assert res.exit_code == 2
    assert res.output.startswith(message.format(tok=kimi_dir)), res.output


@pytest.mark.parametrize("which", [0, 1])
def test_a_dialect_for_a_file_of_rows_is_refused_not_ignored(outputs, kimi_dir, which):
    path = outputs[which]
    res = _inspect(path, kimi_dir, "--dialect", "kimi-k2.5")
    assert res.exit_code == 2
    assert res.output == (f"error: --dialect kimi-k2.5 applies to exchange records; {path} holds reconstructed rows, "
                          "already rendered (leave --dialect out)\n")


def test_a_rows_file_starting_with_a_byte_order_mark_reads_as_export_reads_it(outputs, kimi_dir, tmp_path):
    """inspect said 'no sample (first) with choice 0' where export read the line."""
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + outputs[0].read_bytes())
    res, plain = _inspect(bom, kimi_dir), _inspect(outputs[0], kimi_dir)
    assert res.exit_code == 0 and res.output == plain.output


@pytest.mark.parametrize(("segments", "message"), [
    ([{"kind": "prompt"}], "segments[0]: must be an object with a string kind and integer start and end"),
    (["x"], "segments[0]: must be an object with a string kind and integer start and end"),
    ("end9", "segments[0]: must be an object with a string kind and integer start and end"),
    ([{"kind": "prompt", "start": 0, "end": 10**12}], "segments[0]: spans 0..1000000000000, outside input_ids (0..{n})"),
    ([{"kind": 5, "start": 0, "end": 1}], "segments[0]: must be an object with a string kind and integer start and end"),
], ids=["no-start-end", "a-string", "end-as-text", "end-far-out", "kind-a-number"])
def test_a_flagged_or_rejected_rows_segments_are_checked_before_they_are_shown(outputs, kimi_dir, tmp_path,
                                                                              segments, message):
    """Segments were checked only for ``ok`` rows, and shown for every row: a hand-edited
    flagged or rejected row's were a KeyError or TypeError traceback (exit 8)."""
    rows = [json.loads(x) for x in outputs[0].read_text(encoding="utf-8").splitlines()]
    for status in ("flagged", "rejected"):
        row = next(r for r in rows if r["status"] == status)
        if segments == "end9":
            row["segments"][0]["end"] = "9"
        else:
            row["segments"] = segments
        path = tmp_path / f"{status}.jsonl"
        path.write_text(json.dumps(row) + "\n", encoding="utf-8")
        res = _inspect(path, kimi_dir, "--tokens", ":")
        assert res.exit_code == 1, res.output
        assert res.output.splitlines() == [f"error: {path}:1: {message.format(n=len(row['input_ids']))}"]


def _rows_file(rows, path, edit_first):
    """``rows`` written to ``path`` (JSONL, or Parquet as reconstruct writes it) with the
    first row edited by ``edit_first`` (on the JSON row, or on its Arrow record)."""
    from tokenbridge.rows import COLUMNS, arrow_schema, to_arrow_record

    rows = [json.loads(json.dumps(r)) for r in rows]
    if path.suffix == ".jsonl":
        edit_first(rows[0])
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [to_arrow_record(r, COLUMNS) for r in rows]
    edit_first(records[0])
    pq.write_table(pa.Table.from_pylist(records, schema=arrow_schema()), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_bad_row_is_the_same_fault_in_jsonl_and_parquet(outputs, kimi_dir, tmp_path, suffix):
    """The same hand-edited row (``findings: null``) was exit 1 from JSONL and exit 2 from
    Parquet (its error turned into "not found"), and ``--id`` of a good row found it in JSONL
    but stopped at the bad first row in Parquet. A row is held to the contract when it is
    the one asked for, and a bad one is bad data (exit 1), in both."""
    rows = [json.loads(x) for x in outputs[0].read_text(encoding="utf-8").splitlines()]
    path = _rows_file(rows, tmp_path / f"bad{suffix}", lambda r: r.update(findings=None))
    res = _inspect(path, kimi_dir)
    assert res.exit_code == 1
    assert res.output.splitlines() == [f"error: {path}:1: findings: must be a list, got NoneType"]
    res = _inspect(path, kimi_dir, "--id", rows[1]["id"], "--tokens", "0:5")
    assert res.exit_code == 0, res.output
    assert res.output == _inspect(outputs[0], kimi_dir, "--id", rows[1]["id"], "--tokens", "0:5").output
    res = _inspect(path, kimi_dir, "--id", "nope")
    assert res.exit_code == 2 and res.output.splitlines() == [f"error: {path}: no sample 'nope' with choice 0"]


def test_a_parquet_rows_json_text_is_checked_when_that_row_is_asked_for(outputs, kimi_dir, tmp_path):
    rows = [json.loads(x) for x in outputs[0].read_text(encoding="utf-8").splitlines()]
    path = _rows_file(rows, tmp_path / "bad.parquet", lambda r: r.update(messages="[{not json"))
    res = _inspect(path, kimi_dir)
    assert res.exit_code == 1 and res.output.splitlines() == [f"error: {path}:1: messages: is not valid JSON text"]
    assert _inspect(path, kimi_dir, "--id", rows[2]["id"]).exit_code == 0
