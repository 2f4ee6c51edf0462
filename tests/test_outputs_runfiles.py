"""No output of any command replaces its inputs or a run folder's own files.

A cold attack found three outputs checked against one path only: ``generate
--summary-json RUN/state.sqlite`` and ``reconstruct RUN/exchanges.jsonl -o
RUN/state.sqlite`` replaced the run's store (every paid response, attempt and cost) with a
summary or with rows, and ``generate sj/prompts.jsonl --summary-json sj/prompts.jsonl``
replaced the prompts (exit 0). Now every output flag of every command is refused, before
any work, when it resolves (path, symlink, hard link) to an input or into an input folder
(prompts, config, a local tokenizer, a provider profile), to a run folder's store, its
``-wal`` / ``-shm`` / ``-journal``, lock, ``exchanges.jsonl`` or ``generate.json`` (the
command's own run folder, made yet or not, or any folder holding a ``state.sqlite``), to an
SQLite database (a copy of a store, or the user's own), or to a folder holding another of
its outputs; ``generate --out`` and ``run``'s ``[run] out`` refuse an input that is one of
the files the run rewrites there. Each: exit 2, one ``error:`` line naming the flag and the
path, and every protected file byte-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import EXAMPLE_EXCHANGES, write_run_config
from outputs_support import snapshot
from test_export_support import make_run, write_jsonl
from tokenbridge.cli import app
from tokenbridge.generate.store import Store
from tokenbridge.outdir import RUN_STATE_FILES
from tokenbridge.pipeline import load_run_config

_UNREACHABLE = ["--model", "m", "--base-url", "http://127.0.0.1:9/v1", "--max-attempts", "1", "--progress", "none"]
_REFUSE = "refusing to replace it: give another output name"


@pytest.fixture
def run(tmp_path) -> Path:
    """A run folder as generate leaves it: its store (one paid response), lock, exchanges, summary."""
    from tokenbridge.generate.store import Batch, ResponseRecord

    folder = tmp_path / "RUN"
    with Store.open(folder) as store:
        store.add_samples([("p-1", "p", "", "{}")])
        store.commit(Batch(responses=[ResponseRecord("p-1", b"{}", None, "prov", "m", None, 0.5, 0.1, 1.0, 2.0, 1,
                                                     False)]))
    (folder / ".lock").write_bytes(b"4242 tokenbridge generate\n")
    lines = EXAMPLE_EXCHANGES.read_text(encoding="utf-8").splitlines(keepends=True)[:3]
    (folder / "exchanges.jsonl").write_text("".join(lines), encoding="utf-8")
    (folder / "generate.json").write_bytes(b'{"done": 1}\n')
    return folder


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "sj" / "prompts.jsonl"
    path.parent.mkdir()
    path.write_text('{"prompt": "hi"}\n', encoding="utf-8")
    return path


def _invoke(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args])


def _refused(res, line: str) -> None:
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert res.output.splitlines() == [f"error: {line}"]


def _state(run: Path, name: str) -> str:
    return f"is {RUN_STATE_FILES[name]} of the run folder {run.resolve()}; {_REFUSE}"


# --- generate ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RUN_STATE_FILES))
def test_generate_summary_json_on_a_run_file_is_refused_before_any_request(run, prompts, tmp_path, name):
    before = snapshot(run) | {".lock": (run / ".lock").read_bytes()}
    target = run / name
    _refused(_invoke("generate", prompts, "-o", run, *_UNREACHABLE, "--summary-json", target),
             f"--summary-json {target}: {_state(run, name)}")
    assert snapshot(run) | {".lock": (run / ".lock").read_bytes()} == before  # the store's bytes too


def test_generate_summary_json_on_the_store_of_a_run_not_made_yet_is_refused(prompts, tmp_path):
    fresh = tmp_path / "fresh"
    _refused(_invoke("generate", prompts, "-o", fresh, *_UNREACHABLE, "--summary-json", fresh / "state.sqlite"),
             f"--summary-json {fresh / 'state.sqlite'}: {_state(fresh, 'state.sqlite')}")
    assert not fresh.exists()


@pytest.mark.parametrize("how", ["path", "symlink", "hard link", "in a prompt folder", "config"])
def test_generate_summary_json_on_an_input_is_refused(prompts, tmp_path, how):
    args: list[str | Path] = [prompts]
    summary = {"path": prompts, "symlink": tmp_path / "link.json", "hard link": tmp_path / "hard.json",
               "in a prompt folder": prompts.parent / "summary.json", "config": tmp_path / "gen.toml"}[how]
    if how == "symlink":
        summary.symlink_to(prompts)
    elif how == "hard link":
        os.link(prompts, summary)
    elif how == "in a prompt folder":
        args = [prompts.parent]
    elif how == "config":
        summary.write_text('model = "m"\n', encoding="utf-8")
        args += ["--config", summary]
    before = snapshot(tmp_path)
    why = (f"lies in the input folder {prompts.parent}; give another output name" if how == "in a prompt folder"
           else "is the input file; give another output name")
    _refused(_invoke("generate", *args, "-o", tmp_path / "run_sj", *_UNREACHABLE, "--summary-json", summary),
             f"--summary-json {summary}: {why}")
    assert snapshot(tmp_path) == before and not (tmp_path / "run_sj").exists()


def test_generate_summary_json_holding_the_run_folder_is_refused(prompts, tmp_path):
    """It was written after the paid run, onto the folder the run had made: a failed write."""
    _refused(_invoke("generate", prompts, "-o", tmp_path / "x" / "run", *_UNREACHABLE, "--summary-json",
                     tmp_path / "x"),
             f"--summary-json {tmp_path / 'x'}: holds the --out output {tmp_path / 'x' / 'run'}; give another name")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("how", ["path", "hard link"])
def test_generate_from_a_file_its_run_rewrites_is_refused(run, tmp_path, how):
    source = run / "exchanges.jsonl"
    if how == "hard link":
        source = tmp_path / "prompts.jsonl"
        os.link(run / "exchanges.jsonl", source)
    before = snapshot(run)
    _refused(_invoke("generate", source, "-o", run, *_UNREACHABLE),
             f"--out {run}: the input {source} is the run folder's exchanges.jsonl, which the run rewrites; nothing "
             "was written: move the input out of the run folder, or give another folder")
    assert snapshot(run) == before


# --- reconstruct ---------------------------------------------------------------------------


@pytest.mark.parametrize(("flag", "name"), [("-o", "state.sqlite"), ("-o", "generate.json"),
                                            ("--summary-json", "state.sqlite"), ("--summary-json", "state.sqlite-wal"),
                                            ("--summary-json", ".lock")])
def test_reconstruct_onto_a_run_file_is_refused(run, kimi_dir, flag, name):
    before = snapshot(run)
    out = run / name if flag == "-o" else run / "rec.jsonl"
    extra = ["--summary-json", run / name] if flag == "--summary-json" else []
    _refused(_invoke("reconstruct", run / "exchanges.jsonl", "-o", out, "-t", kimi_dir, *extra),
             f"{flag} {run / name}: {_state(run, name)}")
    assert snapshot(run) == before  # and no rec.jsonl


@pytest.mark.parametrize("flag", ["-o", "--summary-json"])
def test_reconstruct_onto_the_pipelines_record_is_refused(run, kimi_dir, flag):
    """``pipeline.json`` is ``run``'s record of its stages: replaced by rows or a summary, the
    next ``run`` called it damaged and redid every stage (a cold tester's)."""
    (run / "pipeline.json").write_bytes(b'{"stages": {}}\n')
    before = snapshot(run)
    out = run / "pipeline.json" if flag == "-o" else run / "rec.jsonl"
    extra = ["--summary-json", run / "pipeline.json"] if flag == "--summary-json" else []
    _refused(_invoke("reconstruct", run / "exchanges.jsonl", "-o", out, "-t", kimi_dir, *extra),
             f"{flag} {run / 'pipeline.json'}: is run's record of its stages of the run folder {run.resolve()}; "
             f"{_REFUSE}")
    assert snapshot(run) == before


def _marked(run: Path) -> None:
    """Output folders as export and vocab leave them: each marker lists what it wrote."""
    for folder, kind, files in (("vocab", "vocab", ["d2t.npy", "t2d.npy"]), ("export/specforge", "export", ["train.jsonl"])):
        (run / folder).mkdir(parents=True)
        (run / folder / ".tokenbridge-output").write_text(json.dumps({"tokenbridge_output": kind, "files": files}))
        for name in files:
            (run / folder / name).write_bytes(b"theirs\n")
    (run / "export/specforge/hidden_states").mkdir()  # a user's entry, carried over by every export


@pytest.mark.parametrize("inside", ["vocab/d2t.npy", "export/specforge/train.jsonl", "vocab/.tokenbridge-output"])
def test_a_file_output_onto_an_entry_a_marker_lists_is_refused(run, kimi_dir, inside):
    """An export or vocab folder is written whole: ``reconstruct -o RUN/vocab/d2t.npy`` wrote
    rows over the draft vocabulary's map, and a standalone user had a corrupt folder."""
    _marked(run)
    before = snapshot(run)
    target = run / inside
    folder, name = inside.rsplit("/", 1)
    _refused(_invoke("reconstruct", run / "exchanges.jsonl", "-o", target, "-t", kimi_dir),
             f"-o {target}: is {name} of {(run / folder).resolve()}, an output tokenbridge wrote there and rewrites "
             "whole (a file written over it corrupts that output); give another output name")
    assert snapshot(run) == before


@pytest.mark.parametrize(("marker", "name", "refused"), [
    ('{"tokenbridge_output": "export", "format": "specforge"}', "train.jsonl", True),  # a marker from before lists
    ('{"tokenbridge_output": "export", "format": "specforge"}', ".tokenbridge-output", True),
    ('{"tokenbridge_output": "export", "format": "specforge"}', "notes.jsonl", False),
    ("not json", "notes.jsonl", True),  # a marker that cannot be read claims its folder
])
def test_a_marker_without_a_list_is_read_as_the_next_output_reads_it(run, kimi_dir, tmp_path, marker, name, refused):
    """A cold reader's: a marker with no ``files`` list (written before the lists) protected
    nothing, not even itself, where the next export still takes its names as its own."""
    folder = tmp_path / "ex"
    folder.mkdir()
    (folder / ".tokenbridge-output").write_text(marker + "\n")
    (folder / "train.jsonl").write_bytes(b"{}\n")
    before = snapshot(folder)
    res = _invoke("reconstruct", run / "exchanges.jsonl", "-o", folder / name, "-t", kimi_dir)
    if refused:
        assert res.exit_code == 2 and f"is {name} of {folder.resolve()}, an output tokenbridge wrote there" in res.output
        assert snapshot(folder) == before
    else:
        assert res.exit_code == 0, res.output


@pytest.mark.parametrize("inside", ["export/specforge/hidden_states/rows.jsonl", "export/specforge/my_notes.jsonl",
                                    "vocab/extra/rows.jsonl"])
def test_a_file_output_beside_a_markers_entries_is_the_users_to_write(run, kimi_dir, inside):
    """The user's entries in an output folder are kept by every export (a cold reviewer's:
    the first refusal took any path under a marked folder)."""
    _marked(run)
    target = run / inside
    res = _invoke("reconstruct", run / "exchanges.jsonl", "-o", target, "-t", kimi_dir)
    assert res.exit_code == 0, res.output
    assert target.read_bytes().count(b"\n") == 3


def test_reconstruct_into_its_tokenizer_folder_or_onto_its_profile_is_refused(run, kimi_dir, tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(kimi_dir, tok)
    profile = tmp_path / "profile.json"
    profile.write_bytes(b'{"providers": []}\n')
    before = snapshot(tmp_path)
    _refused(_invoke("reconstruct", run / "exchanges.jsonl", "-o", tok / "tokenizer_config.json", "-t", tok),
             f"-o {tok / 'tokenizer_config.json'}: lies in the input folder {tok}; give another output name")
    _refused(_invoke("reconstruct", run / "exchanges.jsonl", "-o", tmp_path / "rec.jsonl", "-t", tok,
                     "--provider-profile", profile, "--summary-json", profile),
             f"--summary-json {profile}: is the input file; give another output name")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("what", ["a copy of a store", "a hard link to a store", "the user's database"])
def test_an_sqlite_database_is_never_an_output(run, kimi_dir, tmp_path, what):
    target = tmp_path / "db.sqlite"
    if what == "a copy of a store":
        shutil.copyfile(run / "state.sqlite", target)
    elif what == "a hard link to a store":
        os.link(run / "state.sqlite", target)
    else:
        con = sqlite3.connect(target)
        con.execute("CREATE TABLE accounts (id INTEGER)")
        con.commit()
        con.close()
    data = target.read_bytes()
    why = {"a copy of a store": "is a tokenbridge run's store (no output of tokenbridge is one)",
           "a hard link to a store": f"is a hard link to {run.resolve() / 'state.sqlite'}, "
                                     f"{RUN_STATE_FILES['state.sqlite']} of that run folder",
           "the user's database": "is an SQLite database (no output of tokenbridge is one)"}[what]
    _refused(_invoke("reconstruct", run / "exchanges.jsonl", "-o", target, "-t", kimi_dir), f"-o {target}: {why}; {_REFUSE}")
    assert target.read_bytes() == data


# --- probe, export, vocab --------------------------------------------------------------------


def test_probe_json_on_a_run_store_is_refused_before_any_probe(run, kimi_dir):
    before = snapshot(run)
    _refused(_invoke("probe", "-m", "m", "--providers", "a", "--base-url", "http://127.0.0.1:9/v1", "-t", kimi_dir,
                     "--json", run / "state.sqlite"),
             f"--json {run / 'state.sqlite'}: {_state(run, 'state.sqlite')}")
    assert snapshot(run) == before


def test_probe_json_into_its_tokenizer_folder_is_refused(kimi_dir, tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(kimi_dir, tok)
    _refused(_invoke("probe", "-m", "m", "--providers", "a", "--base-url", "http://127.0.0.1:9/v1", "-t", tok,
                     "--json", tok / "pat_str.txt"),
             f"--json {tok / 'pat_str.txt'}: lies in the input folder {tok}; give another output name")
    assert (tok / "pat_str.txt").read_bytes() == (kimi_dir / "pat_str.txt").read_bytes()


@pytest.mark.parametrize(("command", "name"), [("export", "state.sqlite-wal"), ("export", "state.sqlite-journal"),
                                               ("vocab", ".lock"), ("vocab", "generate.json")])
def test_a_folder_output_never_takes_a_run_file_name(run, kimi, command, name):
    """A folder named state.sqlite-wal beside the store would leave it unopenable."""
    write_jsonl(run / "reconstructed.jsonl", make_run(kimi, 4)[1])
    (run / "generate.json").unlink()  # missing: a folder would be made there
    before, names = snapshot(run), sorted(os.listdir(run))
    args = ["-f", "parquet"] if command == "export" else ["-n", "8", "--target-vocab-size", "300000"]
    _refused(_invoke(command, run / "reconstructed.jsonl", "-o", run / name, *args, "--force"),
             f"-o {run / name}: is the name of {RUN_STATE_FILES[name]} of the run folder {run.resolve()}; give a new "
             "folder outside the run's own files")
    assert snapshot(run) == before and sorted(os.listdir(run)) == names


def test_vocab_force_never_replaces_its_tokenizer_folder(run, kimi, kimi_dir, tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(kimi_dir, tok)
    write_jsonl(run / "reconstructed.jsonl", make_run(kimi, 4)[1])
    before = snapshot(tok)
    res = _invoke("vocab", run / "reconstructed.jsonl", "-n", "8", "-t", tok, "-o", tok, "--force")
    _refused(res, f"-o {tok}: refusing to replace the input {tok.resolve()}; give a new or empty folder")
    assert snapshot(tok) == before


# --- run -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["exchanges.jsonl", "reconstructed.jsonl"])
def test_run_from_a_dataset_its_run_rewrites_is_refused(tmp_path, kimi_dir, name):
    cfg = write_run_config(tmp_path, kimi_dir)
    out = load_run_config(cfg).out
    Store.open(out).close()  # an earlier run's folder
    dataset = out / name
    dataset.write_text('{"prompt": "hi"}\n', encoding="utf-8")
    cfg.write_text(cfg.read_text(encoding="utf-8").replace("builtin:prompts/plain.jsonl", str(dataset)),
                   encoding="utf-8")
    before = snapshot(out)
    _refused(_invoke("run", cfg),
             f"{cfg}:3: run.out: {out}: the input {dataset} is the run folder's {name}, which the run rewrites; "
             "nothing was written: move the input out of the run folder, or give another folder")
    assert snapshot(out) == before
