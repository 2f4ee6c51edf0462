"""A rerun of a finished `tokenbridge run` is a real skip: no data file read, nothing rewritten.

Evidence is what was opened (a Python audit hook sees every ``open``) and the outputs'
inodes and mtimes, never a timing. The digest clock (:func:`tokenbridge.digests.now_ns`)
is moved on where a test needs files to look older than the racy window.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
import time
from pathlib import Path

import pytest

from conftest import write_run_config
from outputs_support import cli, kill_env, leftovers
from tokenbridge import digests
from tokenbridge.digests import Digest, DigestCache, file_identity
from tokenbridge.fsio import write_bytes
from tokenbridge.generate.store import Store
from tokenbridge.pipeline import PipelineError, load_run_config, run_pipeline

STAGES = ["generate", "reconstruct", "export:specforge", "export:speculators", "export:parquet",
          "export:conversations", "vocab", "report"]
AFTER_GENERATE = STAGES[1:]

# --- what the process opens -------------------------------------------------------------


@pytest.fixture
def opens():
    """``with opens() as opened``: every path opened inside the block through Python's open
    functions (builtins.open, io.open which Path.open uses, os.open). An audit hook would see
    more, but it stays for the whole test process, and with one installed SQLite's WAL files
    outlived their connections in later tests."""
    import builtins
    import io

    @contextmanager
    def recording():
        opened: list[str] = []
        on = [True]
        mp = pytest.MonkeyPatch()

        def spy(real):
            def wrapper(file, *args, **kwargs):
                if on[0] and isinstance(file, (str, bytes, os.PathLike)):
                    opened.append(os.path.abspath(os.fsdecode(file)))
                return real(file, *args, **kwargs)
            return wrapper

        mp.setattr(builtins, "open", spy(builtins.open))
        mp.setattr(io, "open", spy(io.open))
        mp.setattr(os, "open", spy(os.open))
        try:
            yield opened
        finally:
            on[0] = False
            mp.undo()

    return recording


def _data_files(out: Path) -> list[Path]:
    """Every file the stages write (generate's store and summary aside)."""
    return sorted(p for p in out.rglob("*") if p.is_file() and p.name not in (".lock", "generate.json")
                  and not p.name.startswith("state.sqlite"))


def _identities(out: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(out).as_posix(): (os.stat(p).st_ino, os.stat(p).st_mtime_ns) for p in _data_files(out)}


def _data(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in _data_files(out)}


def _run(cfg, lines: list[str] | None = None) -> dict[str, str]:
    return {r.name: r.status for r in run_pipeline(cfg, echo=(lines.append if lines is not None else lambda _: None))}


@pytest.fixture
def aged(monkeypatch):
    """The digest clock runs 10 s ahead: every file looks older than the racy window when read."""
    monkeypatch.setattr(digests, "now_ns", lambda: time.time_ns() + 10_000_000_000)


@pytest.fixture
def finished(tmp_path, kimi_dir, aged):
    cfg = load_run_config(write_run_config(tmp_path, kimi_dir))
    assert set(_run(cfg).values()) == {"ran"}
    return cfg, tmp_path / "out"


# --- the rerun ----------------------------------------------------------------------------


def test_rerun_of_a_finished_run_skips_every_stage_and_reads_no_data_file(finished, opens):
    cfg, out = finished
    before, data_before = _identities(out), _data(out)
    lines: list[str] = []
    with opens() as opened:
        res = _run(cfg, lines)
    assert res == {"generate": "ran", **{s: "skipped" for s in AFTER_GENERATE}}
    assert any(x.startswith("generate: 16 samples: 16 already done; nothing sent") for x in lines)
    # of the files the stages write, only the stage record is opened (read, not rewritten)
    assert set(opened) & {str(p) for p in _data_files(out)} == {str(out / "pipeline.json")}
    assert _identities(out) == before  # nothing rewritten: same inodes, same mtimes
    assert _data(out) == data_before
    assert f"report: skipped → {out / 'report' / 'report.html'}" in lines


def test_first_run_settles_the_digests_of_fresh_files_so_the_rerun_reads_nothing(tmp_path, kimi_dir, monkeypatch,
                                                                                 opens):
    """The digest clock stands still at the run's start during the stages (every output is
    fresh when digested, so untrusted, however slow the machine); it moves on before the run's
    last step, which reads those files once more."""
    from tokenbridge import pipeline

    settled: list[list[str]] = []
    real_settle = pipeline._State.settle

    def settle_later(state):
        monkeypatch.setattr(digests, "now_ns", lambda: time.time_ns() + 10_000_000_000)
        fresh = [k for k, v in state.digests.to_json().items() if not Digest.from_json(v).trusted]
        real_settle(state)
        settled.append(sorted(fresh))

    monkeypatch.setattr(pipeline._State, "settle", settle_later)
    cfg = load_run_config(write_run_config(tmp_path, kimi_dir))
    started = time.time_ns()
    monkeypatch.setattr(digests, "now_ns", lambda: started)
    _run(cfg)
    out = tmp_path / "out"
    assert settled == [[str(out / "exchanges.jsonl"), str(out / "reconstructed.jsonl")]]
    saved = json.loads((out / "pipeline.json").read_text())["digests"]
    assert all(Digest.from_json(v).trusted for v in saved.values())
    with Store.open(out) as store:  # and generate was told its file is the one it wrote
        assert Digest.from_json(store.exchanges_record()["file"]).trusted
    before = _identities(out)
    with opens() as opened:
        res = _run(cfg)
    assert set(res.values()) == {"ran", "skipped"} and res["reconstruct"] == res["report"] == "skipped"
    assert set(opened) & {str(p) for p in _data_files(out)} == {str(out / "pipeline.json")}
    assert _identities(out) == before


# --- what a change re-runs ------------------------------------------------------------------


def test_replaced_rows_rerun_exports_vocab_and_report_only(finished):
    cfg, out = finished
    recon = out / "reconstructed.jsonl"
    exchanges_id = _identities(out)["exchanges.jsonl"]
    write_bytes(recon, b"".join(recon.read_bytes().splitlines(keepends=True)[:8]))
    lines: list[str] = []
    res = _run(cfg, lines)
    assert res == {"generate": "ran", "reconstruct": "skipped", **{s: "ran" for s in AFTER_GENERATE[1:]}}
    assert _identities(out)["exchanges.jsonl"] == exchanges_id
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["rows"]["total"] == 8
    # the rows flow on as they are, and run says they are not the ones it wrote
    assert [x for x in lines if "is not the file this stage wrote" in x] == [
        f"reconstruct: warning: {recon} is not the file this stage wrote (replaced or edited since): the counts "
        "above are the stage's, and the stages after it read the file as it is (rows the config's gate did not "
        "judge included); delete it to have it written again"]
    lines.clear()
    (out / "reconstructed.jsonl").unlink()
    _run(cfg, lines)
    assert not [x for x in lines if "is not the file" in x] and len(recon.read_bytes().splitlines()) == 16


def test_replaced_rows_decide_whether_exports_have_rows_not_the_stages_counts(finished):
    """Whether exports and the vocabulary had rows was read from reconstruct's stored counts:
    rows replaced by rejected ones published four empty exports (exit 0), and curated ok rows
    put where the stage had none exported nothing. A replaced file is read for its statuses."""
    cfg, out = finished
    recon = out / "reconstructed.jsonl"
    rows = [json.loads(x) for x in recon.read_bytes().splitlines()]
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and len(ok) < len(rows)
    write_bytes(recon, b"".join(json.dumps(r).encode() + b"\n" for r in rows if r["status"] == "rejected"))
    lines: list[str] = []
    res = _run(cfg, lines)
    exports = [s for s in AFTER_GENERATE if s.startswith("export:")]
    assert {s: res[s] for s in [*exports, "vocab"]} == {s: "empty" for s in [*exports, "vocab"]}
    assert not (out / "export").exists() or not any((out / "export").iterdir())
    assert f"export specforge: nothing to export (no ok rows); removed the previous {out / 'export' / 'specforge'} " \
           "(it was made from older data)" in lines
    # the stage's counts say no row is ok; the rows file put there has some
    state = json.loads((out / "pipeline.json").read_text())
    state["reconstruct"]["status"] = {"rejected": len(rows)}
    write_bytes(out / "pipeline.json", json.dumps(state).encode())
    write_bytes(recon, b"".join(json.dumps(r).encode() + b"\n" for r in ok))
    res = _run(cfg)
    assert {s: res[s] for s in [*exports, "vocab"]} == {s: "ran" for s in [*exports, "vocab"]}
    assert len((out / "export" / "specforge" / "train.jsonl").read_bytes().splitlines()) == len(ok)


def test_touched_files_are_read_once_and_rerun_nothing(finished, opens):
    cfg, out = finished
    exchanges, recon = out / "exchanges.jsonl", out / "reconstructed.jsonl"
    before = _identities(out)
    later = time.time_ns() + 5_000_000_000
    for p in (exchanges, recon):
        os.utime(p, ns=(later, later))
    with opens() as opened:
        res = _run(cfg)
    assert res == {"generate": "ran", **{s: "skipped" for s in AFTER_GENERATE}}
    # exchanges.jsonl: generate compares it with what it wrote (no rewrite), then reconstruct's digest
    assert opened.count(str(exchanges)) == 2 and opened.count(str(recon)) == 1
    after = _identities(out)
    assert after["exchanges.jsonl"][0] == before["exchanges.jsonl"][0]  # the same inode: verified, not rewritten
    assert {k: v for k, v in after.items() if k not in ("exchanges.jsonl", "reconstructed.jsonl", "pipeline.json")} == \
           {k: v for k, v in before.items() if k not in ("exchanges.jsonl", "reconstructed.jsonl", "pipeline.json")}
    with opens() as opened:  # and now both are trusted again
        _run(cfg)
    assert str(exchanges) not in opened and str(recon) not in opened


def test_replaced_exchanges_are_rewritten_from_the_store_and_nothing_else_runs(finished):
    cfg, out = finished
    exchanges = out / "exchanges.jsonl"
    original = exchanges.read_bytes()
    write_bytes(exchanges, original.replace(b'"dataset":"chat"', b'"dataset":"CHAT"', 1))  # same size, new inode
    res = _run(cfg)
    assert res == {"generate": "ran", **{s: "skipped" for s in AFTER_GENERATE}}
    assert exchanges.read_bytes() == original


def test_a_new_prompt_reruns_every_stage(finished, tmp_path, kimi_dir):
    cfg, out = finished
    path = write_run_config(tmp_path, kimi_dir)
    path.write_text(path.read_text().replace("limit = 4", "limit = 5"), encoding="utf-8")
    more = load_run_config(path)
    before = _identities(out)
    res = _run(more)
    assert res == {s: "ran" for s in STAGES}
    assert len((out / "exchanges.jsonl").read_bytes().splitlines()) == 17
    assert _identities(out)["exchanges.jsonl"][0] != before["exchanges.jsonl"][0]


def test_fewer_prompts_say_how_many_paid_samples_are_left_out(finished, tmp_path, kimi_dir):
    """A smaller prompt set keeps the paid answers in the store but out of the outputs:
    generate said so, run said nothing."""
    cfg, out = finished
    path = write_run_config(tmp_path, kimi_dir)
    path.write_text(path.read_text().replace("limit = 4", "limit = 3"), encoding="utf-8")
    lines: list[str] = []
    _run(load_run_config(path), lines)
    kept = len((out / "exchanges.jsonl").read_bytes().splitlines())
    assert 0 < kept < 16
    left = [x for x in lines if "left out" in x]
    assert left == [f"generate: {16 - kept} stored sample(s) of prompts no longer in this config are kept in the "
                    "store and left out of exchanges.jsonl and every stage after it"], lines


def test_changed_request_settings_say_what_run_itself_can_do(finished, tmp_path, kimi_dir):
    """Answers paid for under other settings: generate's advice (--out, --force-settings)
    named flags run does not have (a cold tester); run names its own ways out."""
    cfg, out = finished
    path = write_run_config(tmp_path, kimi_dir)
    path.write_text(path.read_text().replace("max_tokens = 1024", "max_tokens = 1000"), encoding="utf-8")
    with pytest.raises(PipelineError) as err:
        _run(load_run_config(path))
    assert err.value.code == 2
    message = str(err.value)
    assert message.startswith(f"{out}: done samples were generated with other settings: 16 with another request "
                              "(max_tokens 1024 -> 1000")
    assert message.endswith(f". Put those settings back in {path}, or give [run] out another folder for the new ones "
                            "(the store keeps every answer it paid for)")
    assert "--force-settings" not in message and "--out" not in message


@pytest.mark.parametrize(("reason", "advice"), [("interrupted", "run the same command again to continue"),
                                                ("budget_reached", "fix it and run the same command again")])
def test_a_stopped_generate_says_what_to_do(finished, monkeypatch, reason, advice):
    """Ctrl-C is not a fault: 'fix it' left a user looking for one (a cold tester)."""
    import tokenbridge.generate as generate
    from tokenbridge.generate.run import RunSummary

    cfg, out = finished

    def stopped(settings, out_dir, **kwargs):
        return RunSummary(out_dir=str(out_dir), run=2, samples=16, already_done=10, done=0, failed=0, pending=6,
                          requests=0, spent_run=0.0, spent_total=0.0, prompt_tokens=0, completion_tokens=0,
                          elapsed_s=0.1, errors={}, stop_reason=reason, exit_code=130 if reason == "interrupted" else 4)

    monkeypatch.setattr(generate, "generate_run", stopped)
    with pytest.raises(PipelineError) as err:
        _run(cfg)
    assert str(err.value) == f"generate stopped ({reason}); {advice}"


def test_a_deleted_report_reruns_the_report_only(finished):
    cfg, out = finished
    (out / "report" / "report.html").unlink()
    res = _run(cfg)
    assert res == {"generate": "ran", **{s: "skipped" for s in AFTER_GENERATE[:-1]}, "report": "ran"}
    assert (out / "report" / "report.html").is_file()


@pytest.mark.parametrize("gone", ["export/specforge/train.jsonl", "vocab/d2t.npy", "report/report.json"])
def test_a_file_deleted_from_an_output_folder_reruns_its_stage(finished, gone):
    """README: a deleted output re-runs what depends on it; a file gone from a folder the
    stage wrote counts (it was skipped, the file left missing)."""
    cfg, out = finished
    (out / gone).unlink()
    stage = {"export": "export:specforge", "vocab": "vocab", "report": "report"}[gone.split("/")[0]]
    res = _run(cfg)
    assert res == {"generate": "ran", **{s: "ran" if s == stage else "skipped" for s in AFTER_GENERATE}}
    assert (out / gone).is_file()
    assert _run(cfg) == {"generate": "ran", **{s: "skipped" for s in AFTER_GENERATE}}


def test_an_output_folder_another_command_rewrote_is_written_again(finished):
    """A standalone ``export -f parquet`` into the run's specforge folder (a wrong -f) was
    reported as skipped, the folder left holding Parquet."""
    from tokenbridge.export import export_file

    cfg, out = finished
    target = out / "export" / "specforge"
    export_file(out / "reconstructed.jsonl", target, "parquet", force=True)  # refused without --force
    assert not (target / "train.jsonl").exists()
    res = _run(cfg)
    assert res == {"generate": "ran", **{s: "ran" if s == "export:specforge" else "skipped" for s in AFTER_GENERATE}}
    assert (target / "train.jsonl").is_file() and not (target / "data").exists()


def test_new_failed_attempts_rebuild_the_report_but_not_the_rest(finished):
    """The report also shows generate's counts from the store: a change there rebuilds it."""
    cfg, out = finished
    with Store.open(out) as store:
        store._conn.execute("UPDATE attempts SET error_class='hand_edited' WHERE rowid=1")
    res = _run(cfg)
    assert res == {"generate": "ran", **{s: "skipped" for s in AFTER_GENERATE[:-1]}, "report": "ran"}
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["generation"]["errors"]["hand_edited"] == 1


# --- the digest cache itself ------------------------------------------------------------------


def test_same_size_rewrite_with_the_same_mtime_is_seen_by_its_new_inode(tmp_path, aged):
    f = tmp_path / "f.jsonl"
    write_bytes(f, b"a" * 100)
    cache = DigestCache()
    first = cache.digest(f)
    old = os.stat(f)
    write_bytes(f, b"b" * 100)  # what every tokenbridge output is: a rename of a fresh temp file
    os.utime(f, ns=(old.st_atime_ns, old.st_mtime_ns))  # even in the same mtime tick
    new = os.stat(f)
    assert (new.st_size, new.st_mtime_ns) == (old.st_size, old.st_mtime_ns) and new.st_ino != old.st_ino
    assert cache.digest(f) != first and cache.read == [str(f), str(f)]
    assert cache.digest(f) == cache.digest(f) and len(cache.read) == 2  # and then cached


def test_a_digest_of_a_fresh_file_is_not_trusted_until_it_is_read_again_aged(tmp_path, monkeypatch):
    """The racy rule: same identity is not proof when the file was as new as the read."""
    f = tmp_path / "f.jsonl"
    f.write_bytes(b"x" * 10)
    ident = file_identity(f)
    stale = "0" * 64  # a digest of other content than the file's, with the file's identity
    racy = DigestCache({str(f): Digest(stale, ident, ident.mtime_ns + digests.RACY_NS - 1)})
    assert racy.digest(f) != stale and racy.read == [str(f)]  # within the window: read again
    settled = DigestCache({str(f): Digest(stale, ident, ident.mtime_ns + digests.RACY_NS + 1_000_000)})
    assert settled.digest(f) == stale and settled.read == []  # beyond it the identity is trusted

    monkeypatch.setattr(digests, "now_ns", lambda: ident.mtime_ns)  # the clock as the file is written
    cache = DigestCache()
    d = cache.digest(f)  # the file is fresh
    assert not cache.entry(f).trusted and cache.digest(f) == d and len(cache.read) == 2
    cache.settle()
    assert len(cache.read) == 2  # still fresh: settling cannot make it trusted yet
    monkeypatch.setattr(digests, "now_ns", lambda: time.time_ns() + 10_000_000_000)
    cache.settle()
    assert len(cache.read) == 3 and cache.entry(f).trusted
    assert cache.digest(f) == d and len(cache.read) == 3


def test_in_place_rewrite_keeping_size_and_mtime_changes_ctime(tmp_path, aged):
    f = tmp_path / "f.jsonl"
    f.write_bytes(b"a" * 100)
    old = os.stat(f)
    cache = DigestCache()
    first = cache.digest(f)
    time.sleep(0.01)
    with open(f, "r+b") as fh:  # same inode, same size
        fh.write(b"b" * 100)
    os.utime(f, ns=(old.st_atime_ns, old.st_mtime_ns))  # mtime put back
    assert os.stat(f).st_ino == old.st_ino and os.stat(f).st_ctime_ns != old.st_ctime_ns
    assert cache.digest(f) != first


# --- damage and kills -----------------------------------------------------------------------------


def test_damaged_pipeline_json_is_a_clear_message_and_only_costs_a_rerun(finished):
    cfg, out = finished
    state = out / "pipeline.json"
    state.write_text('{"reconstruct": {"fingerprint": "', encoding="utf-8")
    lines: list[str] = []
    res = _run(cfg, lines)
    assert res == {s: "ran" for s in STAGES}
    assert f"warning: {state}: damaged (not valid JSON: Unterminated string starting at: line 1 column 33 (char 32));" \
           " every stage after generate runs again" in lines
    doc = json.loads(state.read_text())
    doc["vocab"]["coverage"] = "high"
    doc["digests"][str(out / "reconstructed.jsonl")]["size"] = -1
    state.write_text(json.dumps(doc), encoding="utf-8")
    lines.clear()
    res = _run(cfg, lines)
    assert res == {"generate": "ran", **{s: "skipped" for s in AFTER_GENERATE if s != "vocab"}, "vocab": "ran"}
    assert [x for x in lines if x.startswith("warning:")] == [
        f"warning: {state}: 1 cached digest(s) damaged (digests[{str(out / 'reconstructed.jsonl')!r}]: size is not a "
        "non-negative integer); those files are read again",
        f"warning: {state}: stage 'vocab' damaged (coverage is not a number); it runs again"]
    state.write_text("[]", encoding="utf-8")
    lines.clear()
    assert set(_run(cfg, lines).values()) == {"ran"}
    assert f"warning: {state}: damaged (not a JSON object); every stage after generate runs again" in lines
    state.unlink()
    state.mkdir()
    with pytest.raises(PipelineError) as caught:
        run_pipeline(cfg, echo=lambda _: None)
    assert str(caught.value) == (f"{state}: is a folder, not the run's stage record; run reads and rewrites that file "
                                 "itself: move it away and run again") and caught.value.code == 2


@pytest.mark.parametrize("point", ["state:staged", "state:renamed", "generate:exchanges replaced"])
def test_kill_during_a_rerun_leaves_a_consistent_state(finished, tmp_path, point):
    cfg, out = finished
    want = {k: v for k, v in _data(out).items() if k != "pipeline.json"}
    if point.startswith("state"):
        later = time.time_ns()
        os.utime(out / "reconstructed.jsonl", ns=(later, later))  # the rerun has a digest to record
    else:
        (out / "exchanges.jsonl").unlink()  # the rerun's generate writes it again
    res = cli("run", str(tmp_path / "run.toml"), env=kill_env(point))
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr)
    json.loads((out / "pipeline.json").read_text())  # the old state or the new one, whole
    lines: list[str] = []
    assert _run(cfg, lines) == {"generate": "ran", **{s: "skipped" for s in AFTER_GENERATE}}
    assert not [x for x in lines if x.startswith("warning")]
    assert {k: v for k, v in _data(out).items() if k != "pipeline.json"} == want
    assert leftovers(tmp_path) == []


def test_a_new_gate_revision_reruns_every_stage_after_generate(finished, monkeypatch):
    """An upgrade that reads or judges the same samples differently must not leave a finished
    run's rows as the old gate judged them: the package version moves only with releases."""
    import tokenbridge.checks

    cfg, _ = finished
    monkeypatch.setattr(tokenbridge.checks, "GATE_REVISION", tokenbridge.checks.GATE_REVISION + "+next")
    assert _run(cfg) == {"generate": "ran", **{s: "ran" for s in AFTER_GENERATE}}
    assert _run(cfg) == {"generate": "ran", **{s: "skipped" for s in AFTER_GENERATE}}


def test_a_moved_run_folder_makes_again_what_names_its_place(finished, tmp_path):
    """The exports' READMEs (their source and load instructions), vocab.json and the report
    name the run folder; moved elsewhere, a rerun skipped them all and they pointed at the old
    place. Those stages run again there; the rows do not."""
    import dataclasses

    cfg, out = finished
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    out.rename(moved)
    res = _run(dataclasses.replace(cfg, out=moved))
    assert res == {"generate": "ran", "reconstruct": "skipped", **{s: "ran" for s in AFTER_GENERATE[1:]}}
    named = {name for name, data in _data(moved).items() if str(moved).encode() in data}
    assert {"export/specforge/README.md", "export/speculators/README.md", "vocab/vocab.json",
            "report/report.json"} <= named
    assert not [name for name, data in _data(moved).items() if str(out).encode() + b"/" in data]
    assert _run(dataclasses.replace(cfg, out=moved)) == {"generate": "ran", **{s: "skipped" for s in AFTER_GENERATE}}


# --- the files run names itself -----------------------------------------------------------


def _refused_after_a_change(tmp_path, kimi_dir):
    """The run config with a policy change reconstruct must run again for, and the one line
    (exit 2) a run under it stops with."""
    changed = load_run_config(write_run_config(tmp_path, kimi_dir, '[reconstruct]\nseverity = { truncated = "off" }\n'))
    with pytest.raises(PipelineError) as caught:
        run_pipeline(changed, echo=lambda _: None)
    assert caught.value.code == 2
    return changed, str(caught.value)


def test_edited_rows_are_never_replaced_when_reconstruct_must_run_again(finished, tmp_path, kimi_dir):
    """Rows the user cut down to 8 in place are used as they are while reconstruct skips;
    when the config then changed reconstruct ran again and wrote every row over them without
    a word (a cold tester's 50 curated rows became 216). It refuses, naming the file, and the
    rows stay as the user left them."""
    cfg, out = finished
    recon = out / "reconstructed.jsonl"
    write_bytes(recon, b"".join(recon.read_bytes().splitlines(keepends=True)[:8]))
    mine = recon.read_bytes()
    changed, refused = _refused_after_a_change(tmp_path, kimi_dir)
    assert refused == (
        f"{recon} is not the file reconstruct wrote (edited or replaced since), and reconstruct must run again (its "
        "input or settings changed), which would replace it: move it elsewhere to keep it, or delete it to have it "
        "written again")
    assert recon.read_bytes() == mine
    recon.unlink()  # as it says: then it is written again
    assert _run(changed)["reconstruct"] == "ran" and len(recon.read_bytes().splitlines()) == 16


def test_rows_with_no_record_are_written_again_and_the_run_says_so(finished):
    """pipeline.json gone (or a run killed between writing the rows and recording them): no
    record tells the stage's own file from an edit, and the rerun must go on; it says so."""
    cfg, out = finished
    recon = out / "reconstructed.jsonl"
    write_bytes(recon, b"".join(recon.read_bytes().splitlines(keepends=True)[:8]))
    (out / "pipeline.json").unlink()
    lines: list[str] = []
    assert _run(cfg, lines)["reconstruct"] == "ran" and len(recon.read_bytes().splitlines()) == 16
    assert (f"reconstruct: warning: {recon}: pipeline.json holds no digest of it (deleted, damaged or older, or a run "
            "stopped while writing it): written again") in lines


def test_a_run_killed_after_rewriting_the_rows_before_recording_them_goes_on(finished, tmp_path, kimi_dir):
    """Reconstruct ran again after a config change and was killed after its rename, before
    its record: the rerun took its own new rows for an edit of the old ones and refused
    (a cold reviewer's). The old digest is dropped before the rows are written."""
    cfg, out = finished
    path = write_run_config(tmp_path, kimi_dir, '[reconstruct]\nseverity = { truncated = "off" }\n')
    res = cli("run", str(path), env=kill_env("reconstruct:renamed"))
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr)
    lines: list[str] = []
    assert _run(load_run_config(path), lines)["reconstruct"] == "ran"
    recon = out / "reconstructed.jsonl"
    assert [x for x in lines if "digest" in x] == [
        f"reconstruct: warning: {recon}: pipeline.json holds no digest of it (deleted, damaged or older, or a run "
        "stopped while writing it): written again"]


def test_symlinked_rows_are_used_as_they_are_but_never_written_through(finished, tmp_path, kimi_dir):
    """A ``reconstructed.jsonl`` replaced by a link to the user's own rows is used as it is;
    when the config then changes, reconstruct must write the file again: run wrote through
    the link and replaced the user's file outside the run folder with every row (a cold
    tester's 50 curated rows became 216). It refuses, and both the link and the file stay."""
    cfg, out = finished
    recon = out / "reconstructed.jsonl"
    curated = tmp_path / "curated.jsonl"
    curated.write_bytes(b"".join(recon.read_bytes().splitlines(keepends=True)[:8]))
    mine = curated.read_bytes()
    recon.unlink()
    recon.symlink_to(curated)
    lines: list[str] = []
    assert _run(cfg, lines)["reconstruct"] == "skipped"
    assert json.loads((out / "report" / "report.json").read_text())["rows"]["total"] == 8
    assert any("is not the file this stage wrote" in x for x in lines)
    changed, refused = _refused_after_a_change(tmp_path, kimi_dir)
    assert refused == (
        f"{recon}: is a symbolic link to {curated}, a regular file, not the file reconstruct wrote; run writes that "
        "file itself and never through a link or over anything but a file: remove it (the file a link names is "
        "kept) to have it written again")
    assert curated.read_bytes() == mine and os.readlink(recon) == str(curated)
    res = cli("run", str(changed.source))  # the command: one error line, exit 2
    assert res.returncode == 2 and res.stderr.splitlines() == [f"error: {refused}"]
    assert curated.read_bytes() == mine
    recon.unlink()
    assert _run(changed)["reconstruct"] == "ran" and len(recon.read_bytes().splitlines()) == 16


def _fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize(("name", "make", "what"), [
    ("reconstructed.jsonl", Path.mkdir, "is a folder"),
    ("reconstructed.jsonl", _fifo, "is a named pipe (FIFO)"),
    ("reconstructed.jsonl", lambda p: p.symlink_to(p.parent / "gone"), "is a symbolic link to {out}/gone, which is "
                                                                        "missing (or a loop)"),
    ("reconstructed.jsonl", lambda p: p.symlink_to(p.parent / "export"), "is a symbolic link to {out}/export, a folder"),
    ("pipeline.json", _fifo, "is a named pipe (FIFO)"),
    ("pipeline.json", lambda p: p.symlink_to(p.parent / "mine.json"), "is a symbolic link to {out}/mine.json, a "
                                                                       "regular file"),
], ids=["rows-folder", "rows-fifo", "rows-dangling-link", "rows-link-to-folder", "record-fifo", "record-link"])
def test_a_run_file_that_is_not_a_file_is_refused_before_anything_is_sent(finished, name, make, what):
    """``mkdir RUN/reconstructed.jsonl`` crashed run (IsADirectoryError, exit 8) and a FIFO
    hung it forever; a link at ``pipeline.json`` was written through by every stage. Each is
    one error line, exit 2, before generate, and is left as it was."""
    cfg, out = finished
    path = out / name
    (out / "mine.json").write_bytes(path.read_bytes())
    mine = (out / "mine.json").read_bytes()
    path.unlink()
    make(path)
    left = os.lstat(path)
    with Store.open(out) as store:
        sent = store.change_counts()
    res = cli("run", str(cfg.source))  # a child process: a FIFO opened by mistake would block it, not this test
    assert res.returncode == 2, res.stderr
    role = "the rows reconstruct writes" if name == "reconstructed.jsonl" else "the run's stage record"
    assert res.stderr.splitlines() == [
        f"error: {path}: {what.format(out=out)}, not {role}; run reads and rewrites that file itself: move it away and "
        "run again"]
    with Store.open(out) as store:
        assert "generate:" not in res.stdout and store.change_counts() == sent
    now = os.lstat(path)
    assert (now.st_ino, now.st_mode, now.st_mtime_ns) == (left.st_ino, left.st_mode, left.st_mtime_ns)
    assert (out / "mine.json").read_bytes() == mine


def test_outputs_of_stages_the_config_dropped_are_named_when_the_rows_moved_on(finished, tmp_path, kimi_dir):
    """Formats taken out of export.formats, the vocabulary and the report turned off: their
    outputs stayed, made from older rows, with nothing saying so, and read as this run's they
    disagreed with it (a cold tester's). They are left as they were and named; outputs made
    from these very rows are still right and are not."""
    cfg, out = finished
    path = write_run_config(tmp_path, kimi_dir, "[export]\nformats = [\"specforge\"]\n[report]\nenabled = false\n")
    path.write_text(path.read_text(encoding="utf-8").replace("[vocab]\ndraft_vocab_size = 512\n", ""), encoding="utf-8")
    fewer = load_run_config(path)
    lines: list[str] = []
    assert _run(fewer, lines) == {"generate": "ran", "reconstruct": "skipped", "export:specforge": "skipped"}
    assert not [x for x in lines if "earlier run's" in x]  # the same rows: still right
    recon = out / "reconstructed.jsonl"
    write_bytes(recon, b"".join(recon.read_bytes().splitlines(keepends=True)[:8]))
    before = {name: (out / name).stat().st_mtime_ns for name in ("export/parquet", "vocab", "report")}
    lines.clear()
    assert _run(fewer, lines)["export:specforge"] == "ran"
    assert [x for x in lines if "earlier run's" in x] == [
        f"warning: {out / target} is an earlier run's ({why}), made from other rows than this run's: it is left as it "
        "was; delete it if you do not need it" for target, why in (
            ("export/speculators", "'speculators' is no longer in export.formats"),
            ("export/parquet", "'parquet' is no longer in export.formats"),
            ("export/conversations", "'conversations' is no longer in export.formats"),
            ("vocab", "vocab.draft_vocab_size is no longer set"), ("report", "report.enabled is false"))]
    assert before == {name: (out / name).stat().st_mtime_ns for name in ("export/parquet", "vocab", "report")}
    # a record older than the digests says nothing either way: no warning (it fired on every rerun)
    doc = json.loads((out / "pipeline.json").read_text())
    for stage in ("export:parquet", "export:speculators", "export:conversations", "vocab", "report"):
        doc[stage].pop("rows_sha256")
    write_bytes(out / "pipeline.json", json.dumps(doc).encode())
    lines.clear()
    _run(fewer, lines)
    assert not [x for x in lines if "earlier run's" in x]


def test_with_no_export_and_no_vocab_the_report_still_refuses_a_sample_listed_twice(tmp_path, kimi_dir):
    """``[export] formats = []`` and no ``[vocab]``: the one pass fed only the report, whose
    rows nothing checked, so a sample listed twice was counted (the standalone report
    refuses that file, exit 1)."""
    path = write_run_config(tmp_path, kimi_dir, "[export]\nformats = []\n")
    path.write_text(path.read_text(encoding="utf-8").replace("[vocab]\ndraft_vocab_size = 512\n", ""), encoding="utf-8")
    cfg = load_run_config(path)
    assert not cfg.export_formats and not cfg.draft_vocab_size
    assert _run(cfg) == {"generate": "ran", "reconstruct": "ran", "report": "ran"}
    recon = cfg.out / "reconstructed.jsonl"
    lines = recon.read_bytes().splitlines(keepends=True)
    recon.write_bytes(b"".join(lines + lines[:3]))
    report = (cfg.out / "report" / "report.json").read_bytes()
    first = json.loads(lines[0])
    with pytest.raises(PipelineError) as caught:
        run_pipeline(cfg, echo=lambda _: None)
    assert str(caught.value) == (f"{recon}:{len(lines) + 1}: id: ({first['id']!r}, choice 0) is also on line 1: each "
                                 "sample choice once") and caught.value.code == 1
    assert (cfg.out / "report" / "report.json").read_bytes() == report
    res = cli("report", str(cfg.out))
    assert res.returncode == 1 and res.stderr.splitlines() == [f"error: {caught.value}"]


# --- bookkeeping files are untrusted too ----------------------------------------------------


@pytest.mark.parametrize(("stage", "field", "value", "why"), [
    ("reconstruct", "status", {"ok": "148"}, "status is not an object of counts"),
    ("export:specforge", "skipped", [1], "skipped is not an object of counts"),
    ("reconstruct", "provider_notes", [1], "provider_notes is not a list of strings"),
    ("reconstruct", "bad_shown", "x", "bad_shown is not a list of strings"),
    ("export:parquet", "rows", -3, "rows is not a count"),
    ("vocab", "output", [[[[1]]]], "output is not a list of file identities"),
    ("report", "html", None, "html is not a string"),
], ids=["status-text", "skipped-list", "notes-ints", "shown-text", "rows-negative", "output-nested", "html-null"])
def test_a_stage_entry_of_the_right_shape_but_wrong_types_only_runs_again(finished, stage, field, value, why):
    """Only the top-level types were checked: ``status.ok = "148"`` was a TypeError in
    _plan_exports, ``skipped = [1]`` and ``provider_notes = [1]`` AttributeErrors (exit 8).
    Every field read is checked once, as the file is loaded; a damaged one reruns its stage."""
    cfg, out = finished
    state = out / "pipeline.json"
    doc = json.loads(state.read_text())
    doc[stage][field] = value
    state.write_text(json.dumps(doc), encoding="utf-8")
    lines: list[str] = []
    res = _run(cfg, lines)
    assert res[stage] == "ran"
    assert [x for x in lines if x.startswith("warning:")] == [
        f"warning: {state}: stage {stage!r} damaged ({why}); it runs again"]
    assert json.loads(state.read_text())[stage][field] != value  # recorded again


def test_bookkeeping_nested_too_deeply_is_damaged_not_a_crash(finished):
    """``'[' * 100000`` in ``pipeline.json`` or in an export folder's marker was a
    RecursionError traceback (exit 8): each is a damaged file, which costs a rerun."""
    cfg, out = finished
    state = out / "pipeline.json"
    state.write_text("[" * 100_000, encoding="utf-8")
    lines: list[str] = []
    assert _run(cfg, lines) == {s: "ran" for s in STAGES}
    assert f"warning: {state}: damaged (nested too deeply to read); every stage after generate runs again" in lines
    marker = out / "export" / "specforge" / ".tokenbridge-output"
    marker.write_text("[" * 100_000, encoding="utf-8")
    res = cli("run", str(cfg.source))
    assert res.returncode == 0, res.stderr
    assert "export specforge: ran" in res.stdout and "export parquet: skipped" in res.stdout
    assert json.loads(marker.read_text())["format"] == "specforge"  # written again
    (out / "export" / "parquet" / ".tokenbridge-output").write_text("{" * 100_000, encoding="utf-8")
    res = cli("export", str(out / "reconstructed.jsonl"), "-o", str(out / "export" / "parquet"), "-f", "parquet")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_lock_file_that_is_not_a_file_is_refused_not_a_traceback(finished, tmp_path, kind):
    """``RUN/.lock`` as a FIFO was ``OSError: [Errno 22]`` from the lock (exit 8); a symlink
    there would have had the file it names cut and overwritten with the lock's pid."""
    cfg, out = finished
    lock = out / ".lock"
    lock.unlink()
    mine = tmp_path / "mine.txt"
    mine.write_bytes(b"my file\n")
    if kind == "fifo":
        os.mkfifo(lock)
        what = "a named pipe (FIFO)"
    else:
        lock.symlink_to(mine)
        what = f"a symbolic link (to {mine})"
    why = f"{lock}: is {what}, not tokenbridge's lock file; nothing was written: move it away and run again"
    res = cli("run", str(cfg.source))
    assert res.returncode == 2 and res.stderr.splitlines() == [f"error: {cfg.source}:3: run.out: {why}"]
    res = cli("report", str(out))
    assert res.returncode == 2 and res.stderr.splitlines() == [f"error: {why}"]
    res = cli("generate", "--out", str(out), "--base-url", "http://127.0.0.1:9/api/v1", "--model", "m",
              "builtin:prompts/chat.jsonl")
    assert res.returncode == 2 and res.stderr.splitlines() == [f"error: --out {why}"]
    assert mine.read_bytes() == b"my file\n" and os.path.lexists(lock)


@pytest.mark.parametrize(("folder", "key", "what"), [
    ("vocab", "vocab.draft_vocab_size", "its vocab"),  # on its line in the config
    ("export/specforge", "export.formats", "its specforge export"),  # the default: no line to name
    ("report", "report.enabled", "its report"),
])
def test_a_user_folder_where_a_stage_writes_names_the_config_key_before_anything_is_sent(finished, folder, key, what):
    """run's refusal quoted ``-o`` and ``--force`` (flags run has not got), and came after
    generate; it names the config key that asks for the output, before anything is sent."""
    import shutil

    cfg, out = finished
    target = out / folder
    shutil.rmtree(target)
    target.mkdir()
    (target / "notes.txt").write_bytes(b"mine\n")
    with Store.open(out) as store:
        sent = store.change_counts()
    with pytest.raises(PipelineError) as caught:
        run_pipeline(cfg, echo=lambda _: None)
    lines = cfg.source.read_text(encoding="utf-8").splitlines()
    at = (f"{cfg.source}:{lines.index('draft_vocab_size = 512') + 1}" if folder == "vocab" else str(cfg.source))
    assert str(caught.value) == (
        f"{at}: {key}: {target}: folder is not empty and is not an earlier tokenbridge {folder.partition('/')[0]}; "
        f"nothing was written: move it away (run writes {what} there) or give [run] out another folder")
    assert caught.value.code == 2 and (target / "notes.txt").read_bytes() == b"mine\n"
    with Store.open(out) as store:
        assert store.change_counts() == sent


def test_an_export_folder_that_is_a_link_is_refused_as_a_stage_folder_that_is_one(finished, tmp_path):
    """``RUN/export`` as a link to a folder of the user's: run wrote its four exports into
    that folder, outside the run folder, where the same link at ``RUN/vocab`` or
    ``RUN/export/<format>`` is refused (a cold tester's). Refused alike, before anything is
    sent or written, and nothing in the linked folder is touched."""
    import shutil

    cfg, out = finished
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_bytes(b"mine\n")
    shutil.rmtree(out / "export")
    (out / "export").symlink_to(mine)
    with Store.open(out) as store:
        sent = store.change_counts()
    with pytest.raises(PipelineError) as caught:
        run_pipeline(cfg, echo=lambda _: None)
    assert str(caught.value) == (
        f"{cfg.source}: export.formats: {out / 'export'}: is a symbolic link (to {mine}); run writes its exports in "
        "the run folder itself, not through a link to another: nothing was written: move it away or give [run] out "
        "another folder")
    assert caught.value.code == 2 and sorted(os.listdir(mine)) == ["notes.txt"]
    with Store.open(out) as store:
        assert store.change_counts() == sent
