"""Export holds every row it writes to the row contract (issue 7, item 8): an ``ok`` row
that carries an error finding, an id outside the vocabulary, a repeated ``(id, choice)``
and wrong-typed fields are refused with file:line:field, never exported and never a
traceback; the previous export is kept."""

from __future__ import annotations

import copy

import pytest

from outputs_support import cli, snapshot
from test_export_support import make_run, read_jsonl, write_jsonl
from tokenbridge.export import ExportError, export_file

V = 163840  # the Kimi K2.5 vocabulary


@pytest.fixture(scope="module")
def rows(kimi):
    return make_run(kimi, 12)[1]


def _ok_index(rows) -> int:
    return next(k for k, r in enumerate(rows) if r["status"] == "ok" and k > 0)


def _error_finding(r):
    r["findings"] = [{"code": "eos_in_text", "severity": "error", "message": "x"}]


def _warning_on_ok(r):
    r["findings"] = [{"code": "truncated", "severity": "warning", "message": "x"}]


def _oov(r):
    r["input_ids"][-2] = r["completion_ids"][-2] = V


CASES = {  # name: (change to the first ok row, field, message)
    "ok_with_error": (_error_finding, "status", "is 'ok' but the row carries error finding eos_in_text, so it is 'rejected'"),
    "ok_with_warning": (_warning_on_ok, "status", "is 'ok' but the row carries 1 finding(s), so it is 'flagged'"),
    "out_of_vocab": (_oov, "input_ids", f"id {V} at position"),
    "findings_text": (lambda r: r.update(findings="none"), "findings", "must be a list, got str"),
    "finding_shape": (lambda r: r.update(findings=[{"code": 1}]), "findings[0]", "must be an object with string code and message"),
    "choice_text": (lambda r: r.update(choice="0"), "choice", "must be a non-negative integer, got '0'"),
    "choice_bool": (lambda r: r.update(choice=True), "choice", "must be a non-negative integer, got True"),
    "id_int": (lambda r: r.update(id=5), "id", "must be a string, got int"),
}


def test_odd_api_values_in_text_fields_are_exported_as_their_json_text(rows, tmp_path):
    """A provider or dataset the API sent as another JSON type is data, not a broken row:
    the row reader keeps it as its compact JSON text, as Parquet stores it."""
    rows = copy.deepcopy(rows)
    k = _ok_index(rows)
    rows[k].update(dataset=["b3"], provider={"n": 1})
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    export_file(src, tmp_path / "conversations", "conversations", vocab_size=V)
    out = read_jsonl(next((tmp_path / "conversations").glob("*.jsonl")))
    assert any(r.get("provider") == '{"n":1}' for r in out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_row_breaking_the_contract_is_refused_with_its_line_and_field(rows, tmp_path, name):
    change, field, message = CASES[name]
    rows = copy.deepcopy(rows)
    k = _ok_index(rows)
    change(rows[k])
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    for fmt in ("specforge", "parquet", "conversations", "speculators"):
        with pytest.raises(ExportError) as err:
            export_file(src, tmp_path / fmt, fmt, vocab_size=V)
        assert (err.value.line, err.value.field) == (k + 1, field), (fmt, str(err.value))
        assert message in err.value.detail, (fmt, str(err.value))
        assert not (tmp_path / fmt).exists()


def test_a_repeated_sample_choice_names_both_lines(rows, tmp_path):
    rows = copy.deepcopy(rows)
    k = _ok_index(rows)
    rows.append(copy.deepcopy(rows[k]))  # a provider that repeats a choice index did this
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    with pytest.raises(ExportError) as err:
        export_file(src, tmp_path / "out", "specforge")
    assert (err.value.line, err.value.field) == (len(rows), "id")
    assert f"choice 0) is also on line {k + 1}: each sample choice once" in err.value.detail


def test_the_same_id_with_another_choice_is_fine(rows, tmp_path):
    rows = copy.deepcopy(rows)
    k = _ok_index(rows)
    rows.append({**copy.deepcopy(rows[k]), "choice": 1})
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    export_file(src, tmp_path / "out", "specforge", vocab_size=V)
    got = [(r["id"], r["choice"]) for r in read_jsonl(tmp_path / "out" / "train.jsonl")]
    assert got.count((rows[k]["id"], 0)) == 1 and got.count((rows[k]["id"], 1)) == 1


def test_without_a_vocab_size_ids_are_not_range_checked(rows, tmp_path):
    rows = copy.deepcopy(rows)
    _oov(rows[_ok_index(rows)])
    export_file(write_jsonl(tmp_path / "r.jsonl", rows), tmp_path / "out", "specforge")


def test_cli_refuses_in_one_line_and_keeps_the_previous_export(rows, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", rows)
    out = tmp_path / "out"
    export_file(good, out, "specforge")
    before = snapshot(out)
    bad_rows = copy.deepcopy(rows)
    k = _ok_index(bad_rows)
    _oov(bad_rows[k])
    bad = write_jsonl(tmp_path / "bad.jsonl", bad_rows)
    res = cli("export", str(bad), "-o", str(out), "-f", "specforge", "--target-vocab-size", str(V))
    assert res.returncode == 1, res.stderr  # as for every other bad row (test_export.py, test_exit_status.py)
    assert res.stderr.strip().splitlines() == [
        f"error: {bad}:{k + 1}: input_ids: id {V} at position {len(bad_rows[k]['input_ids']) - 2} is outside the "
        f"vocabulary (size {V})"]
    assert snapshot(out) == before


def _drop_end(r):
    """The end token deleted and its segment left empty (a hand edit): a shorter completion."""
    for key in ("completion_ids", "input_ids", "loss_mask"):
        r[key] = r[key][:-1]
    r["segments"][-1]["start"] = r["segments"][-1]["end"] = len(r["input_ids"])


@pytest.mark.parametrize(("change", "field", "message"), [
    (_drop_end, "segments[-1]", "the end segment is one token (a marker), this one spans 0"),
    (lambda r: r["segments"].insert(2, {"kind": "content", "start": r["segments"][2]["start"],
                                        "end": r["segments"][2]["start"]}),
     "segments[2]", "an empty content segment: reconstruct writes none"),
])
def test_an_emptied_or_empty_segment_is_refused(rows, tmp_path, change, field, message):
    rows = copy.deepcopy(rows)
    k = _ok_index(rows)
    change(rows[k])
    field = field.replace("-1", str(len(rows[k]["segments"]) - 1))
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    with pytest.raises(ExportError) as err:
        export_file(src, tmp_path / "sf", "specforge")
    assert (err.value.line, err.value.field) == (k + 1, field) and message in str(err.value)


def test_with_the_tokenizer_a_marker_segment_must_hold_a_marker(rows, tmp_path, kimi):
    """``run`` knows the tokenizer: an end segment whose id a hand edit made an ordinary
    token (13, '.') trains the draft to end on it; refused, naming the segment."""
    from tokenbridge.export import ExportJob, run_pass

    rows = copy.deepcopy(rows)
    k = _ok_index(rows)
    rows[k]["completion_ids"][-1] = rows[k]["input_ids"][-1] = 13
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    assert export_file(src, tmp_path / "plain", "specforge").rows_exported > 0  # no tokenizer: not seen
    with pytest.raises(ExportError) as err:
        run_pass(src, exports=[ExportJob("specforge", tmp_path / "sf")], markers=frozenset(kimi.marker_ids))
    last = len(rows[k]["segments"]) - 1
    assert (err.value.line, err.value.field) == (k + 1, f"segments[{last}]")
    assert "holds id 13, which is no marker of the tokenizer" in str(err.value)


def test_a_status_its_findings_do_not_give_is_refused_on_rows_left_out_too(rows, tmp_path):
    """``flagged`` with no finding, on a row export leaves out: export and vocab took it
    silently while report refused it; every command now names it."""
    rows = copy.deepcopy(rows)
    k = _ok_index(rows)
    rows[k]["status"] = "flagged"
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    with pytest.raises(ExportError) as err:
        export_file(src, tmp_path / "sf", "specforge")
    assert (err.value.line, err.value.field) == (k + 1, "status")
    assert "is 'flagged' but the row carries no finding, so it is 'ok'" in str(err.value)
