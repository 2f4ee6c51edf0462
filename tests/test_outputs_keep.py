"""Re-writing or removing an output folder loses only what tokenbridge wrote there.

The speculators card tells users hidden states go to ``OUT/hidden_states``; a re-export
(``run``'s export stage after a config change too) used to swap the whole folder and
delete them with exit 0. Every entry tokenbridge did not write (its marker lists what it
did) is moved into the new folder before the one-step swap, and a kill at any commit
point leaves it in the folder, or in the dead writer's temp from which the next start
moves it back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from outputs_support import SRC, cli, kill_env, leftovers, snapshot

from tokenbridge.export import build_vocab, export_file
from tokenbridge.fsio import MARKER, OutputRefused, clean_stale_temps
from tokenbridge.outdir import remove_own_output

HS = b"\x00gpu-hours\xff" * 100


def _user_entries(folder: Path, hidden_states: bool = True) -> None:
    if hidden_states:
        (folder / "hidden_states").mkdir()
        (folder / "hidden_states" / "hs_0.pt").write_bytes(HS)
        (folder / "hidden_states" / "hs_1.pt").write_bytes(HS[::-1])
    (folder / "notes.txt").write_bytes(b"my notes\n")


def _assert_user_entries(folder: Path, hidden_states: bool = True) -> None:
    if hidden_states:
        assert (folder / "hidden_states" / "hs_0.pt").read_bytes() == HS
        assert (folder / "hidden_states" / "hs_1.pt").read_bytes() == HS[::-1]
    assert (folder / "notes.txt").read_bytes() == b"my notes\n"


def _ours(folder: Path) -> dict[str, bytes]:
    return {k: v for k, v in snapshot(folder).items() if not k.startswith("hidden_states/") and k != "notes.txt"}


def _new(ref: Path, out: Path) -> dict[str, bytes]:
    return {k: v.replace(str(ref).encode(), str(out).encode()) for k, v in snapshot(ref).items()}


@pytest.mark.parametrize("fmt", ["speculators", "specforge", "parquet", "conversations"])
def test_reexport_keeps_the_users_entries_and_replaces_ours(stage_inputs, tmp_path, fmt):
    """(New rows in a speculators folder whose hidden_states/ holds anything are refused:
    :func:`test_a_reexport_that_changes_the_rows_refuses_speculators_caches_of_the_old_ones`.)"""
    ref, out = tmp_path / "ref", tmp_path / "out"
    export_file(stage_inputs / "reconstructed.jsonl", ref, fmt)
    export_file(stage_inputs / "first-half.jsonl", out, fmt)
    if fmt == "speculators":
        assert f"hidden states go to `{out}/hidden_states`" in (out / "README.md").read_text(encoding="utf-8")
    hs = fmt != "speculators"
    _user_entries(out, hidden_states=hs)
    if not hs:
        (out / "hidden_states").mkdir()  # empty: no cache of the old rows
        (out / "d2t.npy").write_bytes(b"a vocab's d2t.npy: not a name speculators caches or reads")
    res = cli("export", str(stage_inputs / "reconstructed.jsonl"), "-o", str(out), "--format", fmt)
    assert res.returncode == 0, res.stderr
    _assert_user_entries(out, hidden_states=hs)
    if not hs:
        assert (out / "d2t.npy").is_file() and list((out / "hidden_states").iterdir()) == []
        (out / "d2t.npy").unlink()
        (out / "hidden_states").rmdir()
    assert _ours(out) == _new(ref, out)  # ours replaced: the full export, byte for byte
    names = set(snapshot(ref)) | {n.split("/")[0] for n in snapshot(ref)}  # a folder and each file in it
    assert json.loads((out / MARKER).read_text())["files"] == sorted(names - {MARKER})
    assert leftovers(tmp_path) == []


#: What speculators leaves in its --data-path for the rows it read there (hidden states by
#: row index, its cached draft vocabulary) and a token_freq.pt it reads from there.
_CACHES = {
    "hidden_states": ({"hidden_states/hs_0.safetensors": HS, "hidden_states/hs_1.safetensors": HS[::-1]},
                      "hidden_states/"),
    "vocab": ({"d2t-64.npy": b"\x93NUMPY d2t", "t2d-64.npy": b"\x93NUMPY t2d"}, "d2t-64.npy, t2d-64.npy"),
    "token_freq": ({"token_freq.pt": b"PK freq"}, "token_freq.pt"),
    "all": ({"hidden_states/hs_0.safetensors": HS, "t2d-32000.npy": b"t", "d2t-32000.npy": b"d",
             "token_freq.pt": b"PK"}, "hidden_states/, d2t-32000.npy, t2d-32000.npy, token_freq.pt"),
}


@pytest.mark.parametrize("cache", sorted(_CACHES))
def test_a_reexport_that_changes_the_rows_refuses_speculators_caches_of_the_old_ones(stage_inputs, tmp_path, cache):
    """speculators reads ``hidden_states/hs_<row index>.safetensors`` and its cached
    ``d2t-N.npy`` / ``t2d-N.npy`` from the data folder whenever they are there: kept across a
    re-export of other rows, it trained on a stale vocabulary and dropped every row whose
    index shifted (147 of 159, a warning each; a cold tester's). New rows are refused while
    they are there, ``--force`` or not, naming them; the same rows (a rerun) keep them."""
    out, first, full = tmp_path / "out", stage_inputs / "first-half.jsonl", stage_inputs / "reconstructed.jsonl"
    export_file(first, out, "speculators")
    files, named = _CACHES[cache]
    for name, data in files.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_bytes(data)
    (out / "notes.txt").write_bytes(b"my notes\n")
    before = snapshot(out)
    for force in ((), ("--force",)):
        res = cli("export", str(full), "-o", str(out), "--format", "speculators", *force)
        assert res.returncode == 2, res.stderr
        assert res.stderr.splitlines() == [
            f"error: {out}: holds speculators' caches of the rows exported there before ({named}), and this export "
            "changes those rows: speculators would use them as they are (a stale draft vocabulary, hidden states of "
            f"other rows); nothing was written: move them out of {out}, or export into a new folder"]
        assert snapshot(out) == before and leftovers(tmp_path) == []
    res = cli("export", str(first), "-o", str(out), "--format", "speculators")  # a rerun: the same rows
    assert res.returncode == 0, res.stderr
    assert snapshot(out) == before and leftovers(tmp_path) == []
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in {n.split("/")[0] for n in files}:
        shutil.move(out / name, moved / name)
    res = cli("export", str(full), "-o", str(out), "--format", "speculators")
    assert res.returncode == 0, res.stderr
    assert snapshot(moved) == files and (out / "notes.txt").read_bytes() == b"my notes\n"
    assert _ours(out) == _new(_full_export(stage_inputs, tmp_path / "ref"), out)


def _full_export(stage_inputs: Path, ref: Path) -> Path:
    export_file(stage_inputs / "reconstructed.jsonl", ref, "speculators")
    return ref


SPLIT = b"PAR1 the user's own held-out split PAR1"


@pytest.mark.parametrize("legacy", [False, True])
def test_parquet_reexport_keeps_a_users_file_inside_data(stage_inputs, tmp_path, legacy):
    """A validation split the user put beside the shards in ``data/`` (how Hugging Face
    lays out splits) survives a re-export; the old shards go, even when the marker is from
    before markers listed what is inside a folder (then the shard names decide)."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    export_file(stage_inputs / "reconstructed.jsonl", ref, "parquet")
    export_file(stage_inputs / "first-half.jsonl", out, "parquet", shard_rows=1)
    old_shards = sorted(p.name for p in (out / "data").iterdir())
    assert len(old_shards) > 1
    if legacy:
        (out / MARKER).write_text(json.dumps({"files": ["README.md", "data"], "format": "parquet",
                                              "tokenbridge_output": "export"}) + "\n")
    (out / "data" / "validation-00000-of-00001.parquet").write_bytes(SPLIT)
    res = cli("export", str(stage_inputs / "reconstructed.jsonl"), "-o", str(out), "--format", "parquet")
    assert res.returncode == 0, res.stderr
    assert (out / "data" / "validation-00000-of-00001.parquet").read_bytes() == SPLIT
    ours = {k: v for k, v in snapshot(out).items() if k != "data/validation-00000-of-00001.parquet"}
    assert ours == _new(ref, out) and leftovers(tmp_path) == []  # no old shard left beside the new one


def test_a_users_shard_named_file_in_data_is_not_taken_for_ours(stage_inputs, tmp_path):
    """Own is what the marker lists, nothing else: a file the user put in ``data/`` under a
    shard's name (a copy of a shard, say) was taken for an old shard and deleted by the next
    re-export, and by ``run``'s stale-output removal, with exit 0 (a cold tester's)."""
    out = tmp_path / "out"
    export_file(stage_inputs / "first-half.jsonl", out, "parquet")
    mine = out / "data" / "train-00001-of-00002.parquet"
    mine.write_bytes(SPLIT)
    # the very shard a new export writes (two shards of these rows): refused when it comes to be
    # published, with what it writes named, and nothing of the folder replaced
    rows = export_file(stage_inputs / "reconstructed.jsonl", tmp_path / "count", "parquet").rows_exported
    before = snapshot(out)
    with pytest.raises(OutputRefused) as info:
        export_file(stage_inputs / "reconstructed.jsonl", out, "parquet", shard_rows=(rows + 1) // 2)
    assert str(info.value) == (f"{out}: {mine} is not tokenbridge's and the new output writes that name; nothing was "
                               "written: move it away or give another folder")
    assert snapshot(out) == before and leftovers(tmp_path) == []
    # a shard name it does not write this time is the user's, kept (it was refused, "the new
    # export writes that name", though it wrote train-00000-of-00001 only: a cold tester's)
    res = cli("export", str(stage_inputs / "reconstructed.jsonl"), "-o", str(out), "--format", "parquet")
    assert res.returncode == 0, res.stderr
    assert mine.read_bytes() == SPLIT and sorted(os.listdir(out / "data")) == [
        "train-00000-of-00001.parquet", "train-00001-of-00002.parquet"]
    assert "data/train-00001-of-00002.parquet" not in json.loads((out / MARKER).read_text())["files"]
    assert remove_own_output(out, "export") == ["data/train-00001-of-00002.parquet"]
    assert snapshot(out) == {MARKER: (out / MARKER).read_bytes(), "data/train-00001-of-00002.parquet": SPLIT}
    # data/ stays tokenbridge's (the next export writes its shards there), nothing inside it
    assert json.loads((out / MARKER).read_text()) == {"files": ["data"], "files_nested": True,
                                                      "tokenbridge_output": "export"}
    assert remove_own_output(out, "export") == ["data/train-00001-of-00002.parquet"]
    assert snapshot(out)["data/train-00001-of-00002.parquet"] == SPLIT
    mine.unlink()
    assert cli("export", str(stage_inputs / "reconstructed.jsonl"), "-o", str(out), "--format", "parquet").returncode == 0


@pytest.mark.parametrize("point", ["export:carried:1", "export:swapped:1"])
def test_parquet_export_killed_then_rerun_keeps_a_users_file_inside_data(stage_inputs, tmp_path, point):
    out = tmp_path / "out"
    export_file(stage_inputs / "first-half.jsonl", out, "parquet")
    (out / "data" / "validation-00000-of-00001.parquet").write_bytes(SPLIT)
    name, nth = point.rsplit(":", 1)
    args = ("export", str(stage_inputs / "reconstructed.jsonl"), "-o", str(out), "--format", "parquet")
    assert cli(*args, env=kill_env(name, int(nth))).returncode == -9
    assert cli(*args).returncode == 0
    assert (out / "data" / "validation-00000-of-00001.parquet").read_bytes() == SPLIT
    assert remove_own_output(out, "export") == ["data/validation-00000-of-00001.parquet"]
    assert sorted(snapshot(out)) == [MARKER, "data/validation-00000-of-00001.parquet"]
    assert leftovers(tmp_path) == []
    # the folder that holds it stays tokenbridge's: the next export writes its shards beside it
    assert cli(*args).returncode == 0
    assert (out / "data" / "validation-00000-of-00001.parquet").read_bytes() == SPLIT
    assert (out / "data" / "train-00000-of-00001.parquet").is_file() and leftovers(tmp_path) == []


def test_a_users_entry_named_as_a_new_output_file_is_refused_before_any_work(stage_inputs, tmp_path):
    out = tmp_path / "out"
    export_file(stage_inputs / "reconstructed.jsonl", out, "speculators")
    (out / "train.jsonl").write_bytes(b"mine")  # not in the marker's files: the user's
    before = snapshot(out)
    # another format needs --force, and even then the user's train.jsonl is refused
    res = cli("export", str(stage_inputs / "reconstructed.jsonl"), "-o", str(out), "--format", "specforge", "--force")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(out / "train.jsonl") in lines[0]
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_legacy_marker_without_files_keeps_the_users_entries(stage_inputs, tmp_path):
    out = tmp_path / "out"
    export_file(stage_inputs / "first-half.jsonl", out, "speculators")
    (out / MARKER).write_text(json.dumps({"format": "speculators", "tokenbridge_output": "export"}) + "\n")
    _user_entries(out)
    # the same rows: hidden states of these rows are kept (other rows: refused, as below)
    res = cli("export", str(stage_inputs / "first-half.jsonl"), "-o", str(out), "--format", "speculators")
    assert res.returncode == 0, res.stderr
    _assert_user_entries(out)
    assert "data-00000-of-00001.arrow" in snapshot(out)


def test_vocab_and_report_rewrites_keep_the_users_entries(stage_inputs, tmp_path):
    vocab = tmp_path / "vocab"
    build_vocab(stage_inputs / "reconstructed.jsonl", 64, vocab, 163840)
    _user_entries(vocab)
    res = cli("vocab", str(stage_inputs / "reconstructed.jsonl"), "-n", "256", "-o", str(vocab),
              "--target-vocab-size", "163840", no_torch=True)
    assert res.returncode == 0, res.stderr
    _assert_user_entries(vocab)
    assert json.loads((vocab / "vocab.json").read_text())["draft_vocab_size"] == 256
    run = tmp_path / "run"
    run.mkdir()
    (run / "reconstructed.jsonl").write_bytes((stage_inputs / "reconstructed.jsonl").read_bytes())
    assert cli("report", str(run)).returncode == 0
    _user_entries(run / "report")
    res = cli("report", str(run), "--force")
    assert res.returncode == 0, res.stderr
    _assert_user_entries(run / "report")
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("kind, names", [("vocab", ["vocab.json"]), ("report", ["report.html"]),
                                         ("report", ["report.html", "report.json"])])
def test_a_users_file_named_as_ours_alone_in_a_folder_is_never_replaced_even_with_force(stage_inputs, tmp_path,
                                                                                     kind, names):
    """A folder holding only a user's ``vocab.json`` (or ``report.html``) is not an earlier
    tokenbridge output: nothing in it says so. ``--force`` writes beside the user's
    entries, so one the new output would write is refused, as everywhere else."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "reconstructed.jsonl").write_bytes((stage_inputs / "reconstructed.jsonl").read_bytes())
    out = run / "report" if kind == "report" else tmp_path / "v"
    out.mkdir()
    for name in names:
        (out / name).write_bytes(b'{"mine": true}\n' if name.endswith(".json") else b"<html>my page</html>\n")
    before = snapshot(out)
    args = ["report", str(run), "--force"] if kind == "report" else [
        "vocab", str(run / "reconstructed.jsonl"), "-n", "64", "-o", str(out), "--target-vocab-size", "163840", "--force"]
    res = cli(*args, no_torch=True)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "is not tokenbridge's" in lines[0], lines
    assert snapshot(out) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["vocab", "report"])
def test_an_unmarked_earlier_output_is_still_ours_by_its_content(stage_inputs, tmp_path, kind):
    """Written before markers existed: its own summary (or page title) says it is ours, so
    it is replaced without --force."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "reconstructed.jsonl").write_bytes((stage_inputs / "reconstructed.jsonl").read_bytes())
    if kind == "vocab":
        out = tmp_path / "v"
        build_vocab(stage_inputs / "reconstructed.jsonl", 64, out, 163840)
        args = ["vocab", str(run / "reconstructed.jsonl"), "-n", "256", "-o", str(out), "--target-vocab-size", "163840"]
    else:
        out = run / "report"
        assert cli("report", str(run)).returncode == 0
        args = ["report", str(run)]
    (out / MARKER).unlink()
    res = cli(*args, no_torch=True)
    assert res.returncode == 0, res.stderr
    if kind == "vocab":
        assert json.loads((out / "vocab.json").read_text())["draft_vocab_size"] == 256
    assert (out / MARKER).is_file() and leftovers(tmp_path) == []


def test_remove_own_output_removes_only_ours(stage_inputs, tmp_path):
    out = tmp_path / "out"
    export_file(stage_inputs / "reconstructed.jsonl", out, "speculators")
    _user_entries(out)
    assert remove_own_output(out, "export") == ["hidden_states", "notes.txt"]
    _assert_user_entries(out)
    assert sorted(snapshot(out)) == [MARKER, "hidden_states/hs_0.pt", "hidden_states/hs_1.pt", "notes.txt"]
    assert json.loads((out / MARKER).read_text())["files"] == []
    # still tokenbridge's folder, but the rows its hidden states were made of are gone (``run``
    # drops an output made from older data this way): the next export is refused while they
    # are there, then writes into it, keeping the rest
    before = snapshot(out)
    with pytest.raises(OutputRefused, match=r"holds speculators' caches of the rows exported there before "
                                            r"\(hidden_states/\)"):
        export_file(stage_inputs / "reconstructed.jsonl", out, "speculators")
    assert snapshot(out) == before and leftovers(tmp_path) == []
    shutil.move(out / "hidden_states", tmp_path / "moved")
    export_file(stage_inputs / "reconstructed.jsonl", out, "speculators")
    assert (out / "notes.txt").read_bytes() == b"my notes\n" and (out / "state.json").is_file()
    alone = tmp_path / "alone"
    export_file(stage_inputs / "reconstructed.jsonl", alone, "specforge")
    assert remove_own_output(alone, "export") == [] and not alone.exists()
    assert leftovers(tmp_path) == []


# --- kills: at every commit point the user's entries survive --------------------------

_WRITER = """
import sys
from pathlib import Path
from tokenbridge import fsio
if sys.argv[3] == "no-exchange":
    fsio._exchange = lambda a, b: False
target, version = Path(sys.argv[1]), sys.argv[2]
with fsio.publish_dir(target, marker={"tokenbridge_output": "export"}) as tmp:
    (tmp / "a.txt").write_text(version)
    (tmp / "b.txt").write_text(version * 2)
"""


def _write(target: Path, version: str, how: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WRITER, str(target), version, how], capture_output=True, text=True,
                          env={"PYTHONPATH": SRC, **(env or {})}, timeout=60)


@pytest.mark.parametrize(("point", "how"), [
    ("dir:staged", "exchange"), ("dir:carried:1", "exchange"), ("dir:carried:2", "exchange"),
    ("dir:swapped", "exchange"), ("dir:carried:1", "no-exchange"), ("dir:half-swapped", "no-exchange"),
    ("dir:swapped", "no-exchange")])
def test_folder_killed_at_any_point_keeps_the_users_entries(tmp_path, point, how):
    target = tmp_path / "out"
    assert _write(target, "1", how).returncode == 0
    _user_entries(target)
    name, _, nth = point.partition(":carried:")
    env = kill_env("dir:carried", int(nth)) if nth else kill_env(point)
    res = _write(target, "2", how, env=env)
    assert res.returncode == -9, res.stderr
    clean_stale_temps(tmp_path)  # what the next start does first
    _assert_user_entries(target)
    assert {k: v for k, v in _ours(target).items() if k != MARKER} in ({"a.txt": b"1", "b.txt": b"11"},
                                                                       {"a.txt": b"2", "b.txt": b"22"})
    assert leftovers(tmp_path) == []
    assert _write(target, "2", how).returncode == 0
    _assert_user_entries(target)
    assert snapshot(target)["a.txt"] == b"2" and leftovers(tmp_path) == []


@pytest.mark.parametrize("point", ["export:staged:1", "export:carried:1", "export:carried:2", "export:swapped:1"])
def test_export_killed_then_rerun_keeps_hidden_states(stage_inputs, tmp_path, point):
    """A rerun of the same rows (hidden states of other rows are refused before any of this)."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    export_file(stage_inputs / "reconstructed.jsonl", ref, "speculators")
    export_file(stage_inputs / "reconstructed.jsonl", out, "speculators")
    (out / "README.md").write_text("an older card\n")  # ours, replaced: the rerun did write
    _user_entries(out)
    name, nth = point.rsplit(":", 1)
    args = ("export", str(stage_inputs / "reconstructed.jsonl"), "-o", str(out), "--format", "speculators")
    res = cli(*args, env=kill_env(name, int(nth)))
    assert res.returncode == -9, res.stderr
    res = cli(*args)  # its first step moves back what the killed one had carried
    assert res.returncode == 0, res.stderr
    _assert_user_entries(out)
    assert _ours(out) == _new(ref, out) and leftovers(tmp_path) == []


def test_a_reexport_of_the_same_ids_with_other_metadata_keeps_speculators_caches(stage_inputs, tmp_path):
    """speculators' caches depend on the rows' ids and order only: a re-export whose rows
    differ in a metadata column (a provider renamed, a finding reworded by a newer gate) was
    refused as changing the rows, and the user told to move hidden states still valid (a
    reviewer's). Another order of the same rows is a change."""
    import json

    out, first = tmp_path / "out", stage_inputs / "first-half.jsonl"
    export_file(first, out, "speculators")
    (out / "hidden_states").mkdir()
    (out / "hidden_states" / "hs_0.safetensors").write_bytes(b"x")
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text("".join(json.dumps({**r, "provider": "another"}) + "\n" for r in rows))
    res = cli("export", str(renamed), "-o", str(out), "--format", "speculators")
    assert res.returncode == 0, res.stderr
    assert (out / "hidden_states" / "hs_0.safetensors").read_bytes() == b"x"
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text("".join(json.dumps(r) + "\n" for r in [rows[1], rows[0], *rows[2:]]))
    res = cli("export", str(swapped), "-o", str(out), "--format", "speculators")
    assert res.returncode == 2 and "holds speculators' caches" in res.stderr
