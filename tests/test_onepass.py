"""One pass after reconstruct: the same outputs as the standalone stages, from one read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from test_export_support import make_run, read_jsonl, write_jsonl

from tokenbridge.export import (
    FORMATS,
    ExportError,
    ExportJob,
    VocabJob,
    build_vocab,
    export_file,
    run_pass,
    validate,
)
from tokenbridge.outdir import OutputRefused
from tokenbridge.report import ReportError, RowStats, collect_run

FIXTURE = Path(__file__).resolve().parent / "data" / "onepass"
V = 163840


@pytest.fixture(scope="module")
def run_dir(kimi, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("onepass")
    exchanges, rows = make_run(kimi, 30, seed=4)
    write_jsonl(root / "exchanges.jsonl", exchanges)
    write_jsonl(root / "reconstructed.jsonl", rows)
    return root


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("include_flagged", [False, True])
def test_one_pass_writes_what_the_standalone_stages_write(run_dir, tmp_path, include_flagged):
    src = run_dir / "reconstructed.jsonl"
    stats = RowStats()
    jobs = [ExportJob(fmt, tmp_path / "pass" / fmt, include_flagged=include_flagged) for fmt in FORMATS]
    result = run_pass(src, exports=jobs, vocab=VocabJob(300, tmp_path / "pass" / "vocab", V, include_flagged),
                      stats=stats)
    assert result.rows_read == len(read_jsonl(src))
    for fmt, summary in zip(FORMATS, result.exports):
        alone = export_file(src, tmp_path / "alone" / fmt, fmt, include_flagged=include_flagged)
        assert summary.format == fmt and summary.rows_exported == alone.rows_exported > 0
        assert summary.skipped == alone.skipped and summary.tokens == alone.tokens
        got, want = _files(tmp_path / "pass" / fmt), _files(tmp_path / "alone" / fmt)
        assert got.keys() == want.keys()
        # the dataset card names its own folder; every other byte is the same
        got["README.md"] = got["README.md"].replace(str(tmp_path / "pass").encode(), b"OUT")
        want["README.md"] = want["README.md"].replace(str(tmp_path / "alone").encode(), b"OUT")
        assert got == want, fmt
    vocab = build_vocab(src, 300, tmp_path / "alone" / "vocab", V, include_flagged)
    assert result.vocab is not None and result.vocab.coverage == vocab.coverage
    assert _files(tmp_path / "pass" / "vocab") == _files(tmp_path / "alone" / "vocab")
    # the report's row numbers from the pass are the ones it gathers by reading the file itself
    from_pass = collect_run(run_dir, rows=stats)
    alone_data = collect_run(run_dir)
    for data in (from_pass, alone_data):
        data.pop("generated_at")
    assert from_pass == alone_data


def test_jsonl_exports_are_byte_identical_to_mains(tmp_path):
    """tests/data/onepass/main-*.jsonl were written by main's per-stage exporter (stdlib /
    orjson mix) from reconstructed.jsonl there; the one pass writes the same bytes."""
    src = FIXTURE / "reconstructed.jsonl"
    jobs = [ExportJob("specforge", tmp_path / "sf", include_flagged=True),
            ExportJob("conversations", tmp_path / "conv", include_flagged=True)]
    run_pass(src, exports=jobs)
    assert (tmp_path / "sf" / "train.jsonl").read_bytes() == (FIXTURE / "main-train.jsonl").read_bytes()
    got = (tmp_path / "conv" / "conversations.jsonl").read_bytes()
    # less the rows no chat template writes back (cut turns), which conversations now leaves out
    cut = {(r["id"], r["choice"]) for r in read_jsonl(src) if not any(s["kind"] == "end" for s in r["segments"])}
    want = [line for line in (FIXTURE / "main-conversations.jsonl").read_bytes().splitlines(keepends=True)
            if (json.loads(line)["id"], json.loads(line)["choice"]) not in cut]
    assert cut and got == b"".join(want)
    assert b'"tools":"[{\\"type\\": \\"function\\"' in got  # a row with tools is in the fixture


def test_bad_row_stops_the_pass_and_publishes_nothing(run_dir, tmp_path):
    rows = read_jsonl(run_dir / "reconstructed.jsonl")
    src = tmp_path / "in" / "reconstructed.jsonl"
    write_jsonl(src, rows)
    out = tmp_path / "out"
    run_pass(src, exports=[ExportJob(f, out / f) for f in ("specforge", "parquet")], vocab=VocabJob(64, out / "vocab", V))
    before = _files(out)
    k = max(i for i, r in enumerate(rows) if r["status"] == "ok")  # the last ok row: everything before it was written
    rows[k]["loss_mask"] = [0] + rows[k]["loss_mask"][:-1]
    write_jsonl(src, rows)
    with pytest.raises(ExportError) as err:
        run_pass(src, exports=[ExportJob(f, out / f) for f in ("specforge", "parquet")],
                 vocab=VocabJob(64, out / "vocab", V))
    assert (err.value.line, err.value.field) == (k + 1, "loss_mask")
    assert _files(out) == before
    assert sorted(p.name for p in out.iterdir()) == ["parquet", "specforge", "vocab"]  # no staging folder left


def test_refused_output_is_refused_before_anything_is_read_or_written(run_dir, tmp_path):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    with pytest.raises(OutputRefused):
        run_pass(run_dir / "reconstructed.jsonl", exports=[ExportJob("specforge", tmp_path / "sf"),
                                                           ExportJob("parquet", keep)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert (keep / "notes.txt").read_text() == "mine"


def test_a_job_with_no_row_fails_the_pass_before_publishing(run_dir, tmp_path):
    rows = [r for r in read_jsonl(run_dir / "reconstructed.jsonl") if r["status"] != "ok"]
    src = write_jsonl(tmp_path / "in" / "r.jsonl", rows)
    with pytest.raises(ExportError, match="no row to export"):
        run_pass(src, exports=[ExportJob("specforge", tmp_path / "a", include_flagged=True),
                               ExportJob("parquet", tmp_path / "b")])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_speculators_fingerprint_is_the_hash_of_its_shards(run_dir, tmp_path):
    import hashlib

    export_file(run_dir / "reconstructed.jsonl", tmp_path / "spec", "speculators", shard_bytes=20_000)
    state = json.loads((tmp_path / "spec" / "state.json").read_text())
    names = [f["filename"] for f in state["_data_files"]]
    assert len(names) > 1
    h = hashlib.blake2b(digest_size=8)
    for name in names:
        h.update((tmp_path / "spec" / name).read_bytes())
    assert state["_fingerprint"] == h.hexdigest()
    assert sorted(p.name for p in (tmp_path / "spec").iterdir()) == sorted(
        [*names, "state.json", "dataset_info.json", "README.md", ".tokenbridge-output"])


# --- the fast training-row check agrees with the precise one ---------------------------------

_ODD = st.sampled_from([True, False, 1.0, 0.0, -1, 1.5, None, "1", [1], {"a": 1}, 2**31, 2**31 - 1, 2**64, 10**10])


@st.composite
def _rows(draw):
    n_prompt = draw(st.integers(0, 6))
    n_completion = draw(st.integers(0, 6))
    prompt = draw(st.lists(st.integers(0, 200_000), min_size=n_prompt, max_size=n_prompt))
    completion = draw(st.lists(st.integers(0, 200_000), min_size=n_completion, max_size=n_completion))
    row = {"prompt_ids": prompt, "completion_ids": completion, "input_ids": prompt + completion,
           "loss_mask": [0] * n_prompt + [1] * n_completion, "finish_reason": "length"}
    for _ in range(draw(st.integers(0, 2))):  # corrupt some entries (or none)
        key = draw(st.sampled_from(["prompt_ids", "completion_ids", "input_ids", "loss_mask"]))
        if row[key]:
            row[key] = list(row[key])
            row[key][draw(st.integers(0, len(row[key]) - 1))] = draw(_ODD)
    if draw(st.booleans()):
        key = draw(st.sampled_from(["input_ids", "loss_mask"]))
        row[key] = row[key][:-1] if draw(st.booleans()) else row[key] + [1]
    return row


def _outcome(row):
    try:
        return validate.check_training_row(row, "r.jsonl", 1)
    except ExportError as exc:
        return (exc.field, exc.detail)


@settings(max_examples=400, deadline=None)
@given(_rows())
def test_fast_check_agrees_with_the_precise_one(row):
    fast = _outcome(row)
    original = validate._exact_row
    validate._exact_row = lambda rec: None
    try:
        slow = _outcome(row)
    finally:
        validate._exact_row = original
    assert fast == slow


def test_fast_check_takes_the_clean_row_and_leaves_the_odd_ones(run_dir):
    row = next(r for r in read_jsonl(run_dir / "reconstructed.jsonl") if r["status"] == "ok")
    assert validate._exact_row(row) == (row["input_ids"], row["loss_mask"], len(row["prompt_ids"]))
    for key, value in (("loss_mask", True), ("input_ids", 1.0), ("prompt_ids", False), ("input_ids", 2**31)):
        odd = dict(row)
        odd[key] = [value] + row[key][1:]
        assert validate._exact_row(odd) is None, key


# --- the pipeline uses it -------------------------------------------------------------------


def test_pipeline_reads_reconstructed_once(tmp_path, kimi_dir, monkeypatch):
    from conftest import write_run_config

    from tokenbridge import rows as rows_module
    from tokenbridge.export import onepass
    from tokenbridge.pipeline import load_run_config, run_pipeline

    reads: list[str] = []
    real = rows_module.iter_rows

    def counting(path):
        reads.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(onepass, "iter_rows", counting)
    monkeypatch.setattr(rows_module, "iter_rows", counting)
    monkeypatch.setattr("tokenbridge.report.collect.iter_rows", counting)
    results = {r.name: r.status for r in run_pipeline(load_run_config(write_run_config(tmp_path, kimi_dir)), echo=lambda _: None)}
    assert results["export:specforge"] == results["vocab"] == results["report"] == "ran"
    assert reads == ["reconstructed.jsonl"]
    out = tmp_path / "out"
    rows = read_jsonl(out / "reconstructed.jsonl")
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) > 0
    assert [(r["input_ids"], r["loss_mask"]) for r in read_jsonl(out / "export" / "specforge" / "train.jsonl")] == \
        [(r["input_ids"], r["loss_mask"]) for r in ok]
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["rows"]["status"] == {s: sum(r["status"] == s for r in rows) for s in ("ok", "flagged", "rejected")}
    # a rerun skips the exports, the vocabulary and the report, and reads nothing
    reads.clear()
    again = {r.name: r.status for r in run_pipeline(load_run_config(write_run_config(tmp_path, kimi_dir)), echo=lambda _: None)}
    assert again["export:parquet"] == again["vocab"] == again["report"] == "skipped" and reads == []
    shutil.rmtree(out / "export" / "parquet")
    reads.clear()
    third = {r.name: r.status for r in run_pipeline(load_run_config(write_run_config(tmp_path, kimi_dir)), echo=lambda _: None)}
    assert third["export:parquet"] == "ran" and third["export:specforge"] == "skipped" and reads == ["reconstructed.jsonl"]


@pytest.mark.parametrize("exports", [False, True], ids=["stats-alone", "with-an-export"])
def test_the_reports_statistics_hold_rows_as_the_standalone_report_does(run_dir, tmp_path, exports):
    """With no export or vocabulary in the pass (``[export] formats = []``, or every format
    empty), ``run``'s report counted a sample listed twice that ``tokenbridge report`` refuses
    (a cold tester's 219 rows of 216): the statistics are a consumer whose rows are checked."""
    rows = read_jsonl(run_dir / "reconstructed.jsonl")
    src = write_jsonl(tmp_path / "r.jsonl", [*rows, *rows[:3]])
    jobs = [ExportJob("specforge", tmp_path / "sf", include_flagged=True)] if exports else []
    with pytest.raises(ExportError) as err:
        run_pass(src, exports=jobs, stats=RowStats())
    want = f"{src}:{len(rows) + 1}: id: ({rows[0]['id']!r}, choice 0) is also on line 1: each sample choice once"
    assert str(err.value) == want
    shutil.copy(src, tmp_path / "reconstructed.jsonl")
    with pytest.raises(ReportError) as alone:  # the standalone report says the same of the same file
        collect_run(tmp_path)
    assert str(alone.value) == want.replace(str(src), str(tmp_path / "reconstructed.jsonl"))
    k = next(i for i, r in enumerate(rows) if r["status"] == "ok")
    bad = [dict(r) for r in rows]
    bad[k]["loss_mask"] = [1] * len(bad[k]["loss_mask"])  # an ok row that is not trainable
    src = write_jsonl(tmp_path / "r.jsonl", bad)
    with pytest.raises(ExportError) as err:
        run_pass(src, stats=RowStats())
    assert (err.value.line, err.value.field) == (k + 1, "loss_mask")
