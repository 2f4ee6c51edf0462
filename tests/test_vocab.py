"""Draft vocabulary: counts under the loss mask, deterministic selection, trainer file layouts."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from test_export_support import make_run, write_jsonl
from tokenbridge.cli import app
from tokenbridge.export import ExportError, build_vocab, select_draft_vocab

V = 163840


@pytest.fixture(scope="module")
def rows(kimi):
    return make_run(kimi, 30, seed=1)[1]


@pytest.fixture(scope="module")
def src(rows, tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("vocab") / "reconstructed.jsonl", rows)


def _masked_counter(rows, statuses=("ok",)):
    c = Counter()
    for r in rows:
        if r["status"] in statuses:
            c.update(r["completion_ids"])
    return c


def test_selection_order_ties_and_offsets():
    counts = np.zeros(20, dtype=np.int64)
    counts[[3, 7, 9, 15, 2]] = [5, 5, 9, 1, 5]  # 3, 7 and 2 tie at 5
    d2t, t2d, filled = select_draft_vocab(counts, 3)
    # 9 (count 9), then the 5s by id: 2, 3 (7 loses the tie); draft ids in target-id order
    assert list(d2t + np.arange(3)) == [2, 3, 9]
    assert list(d2t) == [2, 2, 7]
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_ and t2d.shape == (20,)
    assert list(np.flatnonzero(t2d)) == [2, 3, 9] and filled == 0


def test_fewer_seen_than_n_fills_lowest_unseen_ids():
    counts = np.zeros(10, dtype=np.int64)
    counts[[0, 4, 8]] = [1, 2, 3]
    d2t, t2d, filled = select_draft_vocab(counts, 6)
    assert list(np.flatnonzero(t2d)) == [0, 1, 2, 3, 4, 8]  # 0, 4, 8 seen; 1, 2, 3 are the lowest unseen
    assert filled == 3 and list(d2t) == [0, 0, 0, 0, 0, 3]


def test_bad_sizes():
    with pytest.raises(ValueError):
        select_draft_vocab(np.ones(5, dtype=np.int64), 6)
    with pytest.raises(ValueError):
        select_draft_vocab(np.ones(5, dtype=np.int64), 0)


def test_build_vocab_counts_only_masked_ok_tokens(src, rows, tmp_path):
    counter = _masked_counter(rows)
    n = 40
    s = build_vocab(src, n, tmp_path, V)
    d2t, t2d = np.load(tmp_path / "d2t.npy"), np.load(tmp_path / "t2d.npy")
    assert d2t.dtype == np.int64 and d2t.shape == (n,) and t2d.dtype == np.bool_ and t2d.shape == (V,)
    chosen = sorted(sorted(counter, key=lambda t: (-counter[t], t))[:n])
    assert list(np.flatnonzero(t2d)) == chosen == list(d2t + np.arange(n))
    total = sum(counter.values())
    assert s.masked_tokens == total and s.distinct_tokens == len(counter)
    assert s.coverage == pytest.approx(sum(counter[t] for t in chosen) / total)
    assert s.rows == sum(r["status"] == "ok" for r in rows)
    prompt_only = {t for r in rows if r["status"] == "ok" for t in r["prompt_ids"]} - set(counter)
    assert s.filled_unseen == 0 and prompt_only
    assert not t2d[sorted(prompt_only)].any()  # prompt tokens are never counted
    meta = json.loads((tmp_path / "vocab.json").read_text())
    assert meta["coverage"] == s.coverage and meta["draft_vocab_size"] == n and meta["target_vocab_size"] == V
    assert meta["coverage_at"]["1024"] == 1.0  # every distinct token fits in 1024


def test_include_flagged_counts_flagged_rows(src, rows, tmp_path):
    s = build_vocab(src, 16, tmp_path, V, include_flagged=True)
    assert s.masked_tokens == sum(_masked_counter(rows, ("ok", "flagged")).values())


def test_torch_files(src, rows, tmp_path):
    torch = pytest.importorskip("torch")
    build_vocab(src, 2000, tmp_path, V)
    mapping = torch.load(tmp_path / "vocab_mapping.pt", weights_only=True, mmap=True)
    assert set(mapping) == {"d2t", "t2d"}
    assert mapping["d2t"].dtype == torch.int64 and mapping["t2d"].dtype == torch.bool
    assert mapping["d2t"].tolist() == np.load(tmp_path / "d2t.npy").tolist()
    assert mapping["t2d"].tolist() == np.load(tmp_path / "t2d.npy").tolist()
    assert torch.load(tmp_path / "token_freq.pt", weights_only=True) == dict(_masked_counter(rows))


def test_id_outside_target_vocab_names_the_line(rows, tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    k = next(i for i, r in enumerate(rows) if r["status"] == "ok")
    top = max(rows[k]["completion_ids"])
    with pytest.raises(ExportError) as err:
        build_vocab(src, 10, tmp_path / "v", top)  # vocab too small for this row
    assert (err.value.line, err.value.field) == (k + 1, "input_ids")


def test_cli_vocab(src, rows, tmp_path, kimi_dir):
    res = CliRunner().invoke(app, ["vocab", str(src), "-n", "32", "-o", str(tmp_path), "--tokenizer", str(kimi_dir)])
    assert res.exit_code == 0, res.output
    assert np.load(tmp_path / "t2d.npy").shape == (V,)
    assert res.output.startswith(f"draft vocab 32 of {V}: coverage ")
    res = CliRunner().invoke(app, ["vocab", str(src), "-n", "32", "-o", str(tmp_path)])
    assert res.exit_code == 2 and "--target-vocab-size" in res.output


@pytest.mark.parametrize(("args", "message"), [
    # numpy's ArrayMemoryError (exit 8) before; 10**9 was OOM-killed
    (["-n", "10", "--target-vocab-size", "10000000000000"],
     "Invalid value for '--target-vocab-size': Input should be less than or equal to 16777216"),
    # was "--draft-vocab-size must be in 1..-5": the wrong flag
    (["-n", "10", "--target-vocab-size", "-5"],
     "Invalid value for '--target-vocab-size': Input should be greater than or equal to 1"),
    (["-n", "20000000", "--target-vocab-size", "100"],
     "Invalid value for '--draft-vocab-size' / '-n': Input should be less than or equal to 16777216"),
])
def test_vocab_sizes_are_range_checked_naming_the_flag(src, tmp_path, args, message):
    res = CliRunner().invoke(app, ["vocab", str(src), *args, "-o", str(tmp_path / "v")])
    assert res.exit_code == 2
    assert message in " ".join(res.output.replace("│", " ").split()), res.output
    assert not (tmp_path / "v").exists()


def test_export_target_vocab_size_is_bounded_too(src, tmp_path):
    res = CliRunner().invoke(app, ["export", str(src), "-o", str(tmp_path / "o"), "-f", "parquet",
                                   "--target-vocab-size", str((1 << 24) + 1)])
    assert res.exit_code == 2
    assert "Input should be less than or equal to 16777216" in " ".join(res.output.replace("│", " ").split())


def test_the_target_size_says_where_it_came_from(kimi, tmp_path):
    """Kimi's folder has no config.json: its 163,840 is the reserved range's, and vocab.json
    said "config.json" (a cold tester's)."""
    from tokenbridge.export.vocab import target_vocab_size_of
    from tokenbridge.tokenizer import load_tokenizer

    assert not (Path(kimi.source) / "config.json").exists()
    assert target_vocab_size_of(kimi, None)[:2] == (163840, "reserved range")
    folder = tmp_path / "k"
    folder.mkdir()
    for f in Path(kimi.source).iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 163840}))
    assert target_vocab_size_of(load_tokenizer(folder), None)[:2] == (163840, "config.json")
