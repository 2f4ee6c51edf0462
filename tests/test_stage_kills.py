"""kill -9 at the commit points of every writer, then rerun.

Seeded and timing-free: the child process kills itself at the n-th passage of a named
point (``TOKENBRIDGE_TEST_KILL_AT``, :func:`tokenbridge.fsio.kill_point`). After the kill
the output is the old one or a complete new one, never a mix; after the rerun it is
byte-identical to an uninterrupted run and no temp file is left anywhere.

The commit points shared by every output (a file staged / renamed, a folder staged /
swapped, the fallback swap's half-way point) are killed through :mod:`tokenbridge.fsio`
itself in a light child; each stage is then killed in its own write loop and at one
shared point through the CLI.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from outputs_support import SRC, cli, kill_env, leftovers, snapshot

from tokenbridge.export import build_vocab, export_file
from tokenbridge.fsio import clean_stale_temps
from tokenbridge.report import collect_run


def _killed(res) -> None:
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr)


def _ok(res) -> None:
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)


# --- the shared commit points, through fsio ---------------------------------------------

_WRITER = """
import sys
from pathlib import Path
from tokenbridge import fsio
if sys.argv[3] == "no-exchange":
    fsio._exchange = lambda a, b: False
target, version = Path(sys.argv[1]), sys.argv[2]
if sys.argv[3] == "file":
    fsio.write_text(target, version * 1000)
else:
    with fsio.publish_dir(target) as tmp:
        (tmp / "a.txt").write_text(version)
        (tmp / "b.txt").write_text(version * 2)
"""


def _write(target: Path, version: str, how: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WRITER, str(target), version, how], capture_output=True, text=True,
                          env={"PYTHONPATH": SRC, **(env or {})}, timeout=60)


@pytest.mark.parametrize("point", ["file:staged", "file:renamed"])
def test_file_killed_at_commit_then_rewritten(tmp_path, point):
    target = tmp_path / "out.txt"
    _ok(_write(target, "1", "file"))
    _killed(_write(target, "2", "file", env=kill_env(point)))
    assert target.read_text() in ("1" * 1000, "2" * 1000)
    assert len(leftovers(tmp_path)) == (point == "file:staged")  # the dead writer's temp, until the next start
    _ok(_write(target, "2", "file"))
    assert target.read_text() == "2" * 1000 and leftovers(tmp_path) == []


@pytest.mark.parametrize(("point", "how"), [("dir:staged", "exchange"), ("dir:swapped", "exchange"),
                                            ("dir:staged", "no-exchange"), ("dir:half-swapped", "no-exchange"),
                                            ("dir:swapped", "no-exchange")])
def test_folder_killed_at_commit_is_old_or_new_set(tmp_path, point, how):
    target = tmp_path / "out"
    _ok(_write(target, "1", how))
    old = snapshot(target)
    _killed(_write(target, "2", how, env=kill_env(point)))
    clean_stale_temps(tmp_path)  # what the next start does first
    assert snapshot(target) in (old, {"a.txt": b"2", "b.txt": b"22"})
    assert leftovers(tmp_path) == []
    _ok(_write(target, "2", how))
    assert snapshot(target) == {"a.txt": b"2", "b.txt": b"22"} and leftovers(tmp_path) == []


# --- each stage, through the CLI ---------------------------------------------------------


def test_reconstruct_killed_mid_file_then_rerun(stage_inputs, kimi_dir, tmp_path):
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out" / "r.jsonl"

    def reconstruct(dst: Path, env=None):
        return cli("reconstruct", str(stage_inputs / "exchanges.jsonl"), "-o", str(dst), "-t", str(kimi_dir), env=env)

    _ok(reconstruct(ref))
    _killed(reconstruct(out, env=kill_env("reconstruct:record", 3)))
    assert not out.exists() and len(leftovers(tmp_path)) == 1
    _ok(reconstruct(out))
    assert out.read_bytes() == ref.read_bytes() and leftovers(tmp_path) == []


@pytest.mark.parametrize("point", ["export:row:2", "export:swapped:1"])
def test_export_killed_then_rerun(stage_inputs, tmp_path, point):
    ref, out = tmp_path / "ref", tmp_path / "out"

    def export(src: Path, dst: Path, env=None):
        return cli("export", str(src), "-o", str(dst), "--format", "specforge", env=env)

    export_file(stage_inputs / "reconstructed.jsonl", ref, "specforge")
    export_file(stage_inputs / "first-half.jsonl", out, "specforge")  # an older export the new one replaces
    old = snapshot(out)
    new = {k: v.replace(str(ref).encode(), str(out).encode()) for k, v in snapshot(ref).items()}
    name, nth = point.rsplit(":", 1)
    _killed(export(stage_inputs / "reconstructed.jsonl", out, env=kill_env(name, int(nth))))
    assert snapshot(out) in (old, new)  # the old set or the new one, never a mix
    _ok(export(stage_inputs / "reconstructed.jsonl", out))
    assert snapshot(out) == new and leftovers(tmp_path) == []


def test_vocab_killed_between_its_files_keeps_one_set(stage_inputs, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"

    def vocab(n: int, dst: Path, env=None):
        return cli("vocab", str(stage_inputs / "reconstructed.jsonl"), "-n", str(n), "-o", str(dst),
                   "--target-vocab-size", "163840", env=env, no_torch=True)

    build_vocab(stage_inputs / "reconstructed.jsonl", 256, ref, 163840)
    build_vocab(stage_inputs / "reconstructed.jsonl", 64, out, 163840)  # d2t/t2d of another size: must never mix
    old = snapshot(out)
    _killed(vocab(256, out, env=kill_env("vocab:written")))
    assert snapshot(out) == old
    _ok(vocab(256, out))
    new, want = snapshot(out), snapshot(ref)
    # the child had no torch: the .pt files are written without it, byte-identical to the in-process build
    assert sorted(new) == [".tokenbridge-output", "d2t.npy", "t2d.npy", "token_freq.pt", "vocab.json",
                           "vocab_mapping.pt"]
    assert new["d2t.npy"] == want["d2t.npy"] != old["d2t.npy"] and new["t2d.npy"] == want["t2d.npy"]
    assert new["vocab_mapping.pt"] == want["vocab_mapping.pt"] != old["vocab_mapping.pt"]
    assert leftovers(tmp_path) == []


def test_report_killed_between_its_files_then_rerun(stage_inputs, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(stage_inputs / "reconstructed.jsonl", run / "reconstructed.jsonl")
    _killed(cli("report", str(run), env=kill_env("report:written")))
    assert not (run / "report").exists()
    _ok(cli("report", str(run)))
    data = json.loads((run / "report" / "report.json").read_text(encoding="utf-8"))
    want = json.loads(json.dumps(collect_run(run)))
    assert {**data, "generated_at": 0} == {**want, "generated_at": 0}
    assert sorted(snapshot(run / "report")) == [".tokenbridge-output", "report.html", "report.json"]
    assert leftovers(tmp_path) == []
