"""``tokenbridge run`` under stress: a second run, kill -9, SIGTERM, a failed generate, stale outputs.

One uninterrupted run on the built-in emulator is the reference; every scenario starts
from a copy of its generate state (so nothing is sent again) and must end with the same
bytes (paths aside) and no temp file. Timing-free: children stop or kill themselves at
named points (``TOKENBRIDGE_TEST_KILL_AT``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from conftest import LEAKY_EMULATOR, write_run_config
from outputs_support import cli, kill_env, leftovers, snapshot, start_cli, wait_stopped
from tokenbridge.interrupt import STOPPED
from tokenbridge.pipeline import PipelineError, load_run_config, run_pipeline

_GENERATE_FILES = ("state.sqlite", "exchanges.jsonl", "generate.json")


@pytest.fixture(scope="module")
def reference(kimi_dir, tmp_path_factory) -> Path:
    """The run folder of one uninterrupted ``run``."""
    root = tmp_path_factory.mktemp("reference")
    run_pipeline(load_run_config(write_run_config(root, kimi_dir)), echo=lambda _: None)
    return root / "out"


def _resumed_copy(reference: Path, tmp_path: Path, kimi_dir: Path) -> Path:
    """A config whose run folder holds the reference's generate state only."""
    cfg = write_run_config(tmp_path, kimi_dir)
    (tmp_path / "out").mkdir()
    for name in _GENERATE_FILES:
        shutil.copy2(reference / name, tmp_path / "out" / name)
    return cfg


#: Files that differ between two identical runs: generate's own bookkeeping, the report
#: (it carries the time it was made) and the random fingerprint `datasets` writes.
_VARYING = ("state.sqlite", "generate.json", "report/report.html", "report/report.json",
            "export/speculators/state.json",
            # SQLite's own WAL and index: whether they outlive a run depends on when its last
            # connection closes (seen left by the in-process reference after test_pipeline_rerun)
            "state.sqlite-wal", "state.sqlite-shm")


def _outputs(run: Path) -> dict[str, bytes]:
    out = {k: v.replace(str(run).encode(), b"RUN") for k, v in snapshot(run).items() if k not in _VARYING}
    if "pipeline.json" in out:  # its digest cache and the stages' output identities hold inodes and times,
        doc = json.loads(out["pipeline.json"])  # which differ between two runs
        doc.pop("digests", None)
        for stage, entry in doc.items():
            entry.pop("output", None)
            if stage.startswith("export:") or stage in ("vocab", "report"):  # they hold the run folder's path
                entry.pop("fingerprint", None)
        out["pipeline.json"] = json.dumps(doc, sort_keys=True).encode()
    return out


def test_second_run_on_the_same_folder_is_refused(reference, tmp_path, kimi_dir):
    cfg = _resumed_copy(reference, tmp_path, kimi_dir)
    first = start_cli("run", str(cfg), env=kill_env("state:staged", 1, "SIGSTOP"))
    try:
        wait_stopped(first)  # holds the run folder, between two stages
        second = cli("run", str(cfg))
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert second.returncode == 7, second.stderr
    assert second.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'out'}: run folder in use by pid {first.pid} (another tokenbridge process: "
        f"tokenbridge run); wait for it to finish or set another [run] out in {cfg}"
    ]
    assert _outputs(tmp_path / "out") == _outputs(reference) and leftovers(tmp_path) == []


@pytest.mark.parametrize("point", ["state:staged:1"])
def test_run_killed_then_rerun_matches_an_uninterrupted_run(reference, tmp_path, kimi_dir, point):
    cfg = _resumed_copy(reference, tmp_path, kimi_dir)
    name, nth = point.rsplit(":", 1)
    killed = cli("run", str(cfg), env=kill_env(name, int(nth)))
    assert killed.returncode == -9, killed.stderr
    rerun = cli("run", str(cfg))
    assert rerun.returncode == 0, rerun.stderr
    assert _outputs(tmp_path / "out") == _outputs(reference) and leftovers(tmp_path) == []


def test_run_stopped_by_sigterm_between_stages(reference, tmp_path, kimi_dir):
    cfg = _resumed_copy(reference, tmp_path, kimi_dir)
    proc = start_cli("run", str(cfg), env=kill_env("export:row", 1, "SIGSTOP"))
    wait_stopped(proc)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == STOPPED and "Traceback" not in err
    assert leftovers(tmp_path) == [] and not list((tmp_path / "out" / "export").iterdir())


def test_run_stops_when_generate_cannot_rewrite_exchanges(reference, tmp_path, kimi_dir, monkeypatch):
    from tokenbridge.generate import run as generate_run

    cfg = _resumed_copy(reference, tmp_path, kimi_dir)

    def disk_full(out_dir, ids):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(generate_run, "_write_exchanges", disk_full)
    with pytest.raises(PipelineError, match="later stages were not run on a stale exchanges.jsonl") as err:
        run_pipeline(load_run_config(cfg), echo=lambda _: None)
    assert err.value.code == 6
    assert not (tmp_path / "out" / "reconstructed.jsonl").exists()


def test_no_usable_rows_removes_the_old_exports_and_says_so(tmp_path, kimi_dir):
    """A rerun whose rows are all rejected must not leave the last run's export as a result."""
    emu = tmp_path / "leaky.toml"
    emu.write_text(LEAKY_EMULATOR, encoding="utf-8")
    lenient = '[export]\nformats = ["specforge"]\ninclude_flagged = true\n'
    text = write_run_config(tmp_path, kimi_dir, lenient, emulator=emu).read_text()
    path = tmp_path / "leaky-run.toml"
    path.write_text(text.replace("[vocab]", '[reconstruct]\nseverity = { eos_in_text = "warning" }\n\n[vocab]'),
                    encoding="utf-8")
    first = {r.name: r.status for r in run_pipeline(load_run_config(path), echo=lambda _: None)}
    out = tmp_path / "out"
    assert first["export:specforge"] == "ran" and (out / "export" / "specforge" / "train.jsonl").is_file()
    assert first["vocab"] == "ran"

    path.write_text(text.replace("include_flagged = true", "include_flagged = false"), encoding="utf-8")  # no ok row
    lines: list[str] = []
    second = {r.name: r.status for r in run_pipeline(load_run_config(path), echo=lines.append)}
    assert second["export:specforge"] == "empty" and second["vocab"] == "empty"
    assert not (out / "export" / "specforge").exists() and not (out / "vocab").exists()
    assert f"export specforge: nothing to export (no ok rows); removed the previous {out / 'export' / 'specforge'} " \
           "(it was made from older data)" in lines
    assert f"vocab: nothing to count (no usable rows); removed the previous {out / 'vocab'} (it was made from older data)" \
           in lines
