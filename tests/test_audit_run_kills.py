"""``tokenbridge run`` killed (SIGKILL) at EVERY commit point of every stage, then rerun.

Issue 7's "done when": kill -9 at every commit point, then the rerun loses nothing,
duplicates nothing and leaves no temp file. The run starts from nothing (generate
included, against the built-in emulator) and the child kills itself at the n-th
commit point it passes, whichever it is (``TOKENBRIDGE_TEST_KILL_AT=*:n``), for
n = 1, 2, ... until a child gets through without being killed; so the points are all of
them, counted by the code itself, not a list kept here. Forked children (no interpreter
start-up, the tokenizer already loaded) keep the loop inside the CI budget.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from conftest import write_run_config
from outputs_support import leftovers, snapshot
from tokenbridge import fsio
from tokenbridge.generate import Store
from tokenbridge.pipeline import load_run_config, run_pipeline

#: What differs between two identical runs: generate's own bookkeeping (and SQLite's
#: side files, see below), the report (its time), pipeline.json (it fingerprints
#: exchanges.jsonl, whose meta holds times and the emulator's port) and the random
#: fingerprint `datasets` writes for the speculators export.
_VARYING = ("state.sqlite", "state.sqlite-shm", "state.sqlite-wal", "generate.json", "report/report.html",
            "report/report.json", "export/speculators/state.json", "pipeline.json")
#: Per-request values in an exchange: when, how long, which port, the emulator's reply id,
#: and the attempt count (a request in flight at the kill is sent again: checked apart).
_WHEN = ("started_at", "finished_at", "latency_s", "base_url", "attempts")


def _small_config(root: Path, kimi_dir: Path) -> Path:
    """The pipeline test's config with 4 samples: every kind of commit point, fewer repeats."""
    cfg = write_run_config(root, kimi_dir)
    cfg.write_text(cfg.read_text().replace("limit = 12", "limit = 3").replace("limit = 4", "limit = 1"),
                   encoding="utf-8")
    return cfg


def _outputs(run: Path) -> dict[str, bytes]:
    out = {k: v.replace(str(run).encode(), b"RUN") for k, v in snapshot(run).items() if k not in _VARYING}
    out["exchanges.jsonl"] = b"".join(_timeless(line) for line in out["exchanges.jsonl"].splitlines())
    return out


def _timeless(line: bytes) -> bytes:
    row = json.loads(line)
    row["meta"] = {k: v for k, v in row["meta"].items() if k not in _WHEN}
    row["response"] = {k: v for k, v in row["response"].items() if k not in ("id", "created")}
    return json.dumps(row, sort_keys=True).encode() + b"\n"


def _attempts(run: Path) -> list[int]:
    return [json.loads(line)["meta"]["attempts"] for line in (run / "exchanges.jsonl").read_bytes().splitlines()]


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_bytes().splitlines()]


def _run_in_children(runs: list[tuple[Path, int | None]]) -> list[int]:
    """``run`` of each config in a forked child, all at once (each in a folder of its own,
    its emulator on a port of its own: the machine's cores share the loop), that SIGKILLs
    itself at its ``crash_at``-th commit point; their exit statuses, in order (-9 when
    killed, 0 when it got through)."""
    pids = []
    for cfg, crash_at in runs:
        pid = os.fork()
        if pid == 0:  # child: never returns into pytest
            code = 99
            try:
                os.environ.pop(fsio.KILL_ENV, None)
                os.environ.pop(fsio.KILL_SIGNAL_ENV, None)
                if crash_at is not None:
                    os.environ[fsio.KILL_ENV] = f"*:{crash_at}"
                fsio._passes.clear()
                run_pipeline(load_run_config(cfg), echo=lambda _: None)
                code = 0
            except BaseException:  # noqa: BLE001 - reported by the exit status
                code = 98
            finally:
                os._exit(code)
        pids.append(pid)
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    return codes


#: Commit points killed at once (one child per core of a CI machine).
_AT_ONCE = 2


def test_run_killed_at_every_commit_point_then_rerun_loses_duplicates_and_leaves_nothing(kimi, kimi_dir,
                                                                                         tmp_path):
    ref_root = tmp_path / "ref"
    ref_root.mkdir()
    # in this process: every module (and the tokenizer) the forked children then share is loaded once
    run_pipeline(load_run_config(_small_config(ref_root, kimi_dir)), echo=lambda _: None)
    reference = ref_root / "out"
    want = _outputs(reference)
    want_ids = _ids(reference / "exchanges.jsonl")
    assert len(want_ids) == 4 and _ids(reference / "reconstructed.jsonl") == want_ids
    assert {"export/specforge/train.jsonl", "vocab/d2t.npy", "report/report.html"} <= set(snapshot(reference))

    killed: list[int] = []
    finished = False
    for first in range(1, 200, _AT_ONCE):
        batch = []
        for point in range(first, first + _AT_ONCE):
            (tmp_path / f"k{point}").mkdir()
            batch.append((point, _small_config(tmp_path / f"k{point}", kimi_dir)))
        codes = _run_in_children([(cfg, point) for point, cfg in batch])
        cut = []
        for (point, cfg), code in zip(batch, codes):
            if code == 0:  # past the last commit point: every later one gets through too
                finished = True
                break
            assert code == -signal.SIGKILL, (point, code)
            cut.append((point, cfg))
        assert _run_in_children([(cfg, None) for _, cfg in cut]) == [0] * len(cut), cut  # the reruns
        for point, _ in cut:
            _check_rerun(tmp_path / f"k{point}", point, want, want_ids, reference)
        killed += [point for point, _ in cut]
        if finished:
            break
    else:
        pytest.fail("the run never finished without a kill")
    # generate, reconstruct, 4 exports, vocab, report, and pipeline.json between them
    assert len(killed) >= 50, killed
    assert killed == list(range(1, len(killed) + 1))


def _check_rerun(root: Path, point: int, want: dict[str, bytes], want_ids: list[str], reference: Path) -> None:
    """A run killed at ``point`` and rerun: what an uninterrupted run gives, nothing twice, nothing left over."""
    run = root / "out"
    # 0 lost, 0 duplicated: every sample exactly once, in the store and in every file
    assert _ids(run / "exchanges.jsonl") == want_ids, point
    assert _ids(run / "reconstructed.jsonl") == want_ids, point
    with Store.open(run) as store:
        assert store.status_counts() == {"done": len(want_ids)}, point
        assert store._conn.execute("SELECT COUNT(*) FROM responses").fetchone() == (len(want_ids),), point
        cut = dict(store._conn.execute(  # requests the kill cut off: on the books as "unanswered" attempts
            "SELECT sample_id, COUNT(*) FROM attempts WHERE error_class = 'unanswered' GROUP BY sample_id"))
    # a request cut off by the kill keeps its attempt and is sent once more, never more
    assert all(n == 1 for n in cut.values()), (point, cut)
    assert all(a - cut.get(i, 0) in (w, w + 1) for i, a, w in zip(want_ids, _attempts(run), _attempts(reference))), \
        point
    # the same bytes as an uninterrupted run, and 0 temp files anywhere
    assert _outputs(run) == want, (point, sorted(k for k in set(want) | set(_outputs(run))
                                                 if want.get(k) != _outputs(run).get(k)))
    assert leftovers(root) == [], (point, leftovers(root))
