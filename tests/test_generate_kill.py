"""kill -9 of generate at every commit point, then a rerun: nothing lost, nothing twice, no temp files.
Also: the first Ctrl-C / SIGTERM drains, the second stops at once with exit 130 and no traceback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, write_prompts
from hostile_server import HostileServer

from tokenbridge.fsio import KILL_ENV
from tokenbridge.generate import (
    GenerateSettings,
    RequestSettings,
    Store,
    agenerate_run,
    generate_run,
)
from tokenbridge.generate.budget import estimate_prompt_tokens
from tokenbridge.generate.settings import DatasetSpec, Prices

# asserts on the wall clock or on timings (sleeps, rates, deadlines): run alone, after the
# rest of the suite runs on every core (`make test`), so a busy machine cannot fail them
pytestmark = pytest.mark.serial

KEPT_FILES = {".lock", "state.sqlite", "generate.json", "exchanges.jsonl"}
#: The CLI with the first signal's drain as long as a "hang" reply (an hour): a second
#: signal that waited for the drain would never let the child exit within the test's
#: bound, so "stops at once" is checked without timing anything.
_ENDLESS_DRAIN = ("import sys; import tokenbridge.generate.run as run; run.DRAIN_S = 3600.0; "
                  "from tokenbridge.cli import main; sys.argv[0] = 'tokenbridge'; main()")
#: How long a child may take in all before the test gives up on it (a bound, not a measure).
_CHILD_LIMIT_S = 90


def _cmd(prompts: Path, run: Path, url: str, *extra: str, endless_drain: bool = False) -> list[str]:
    head = ["-c", _ENDLESS_DRAIN] if endless_drain else ["-m", "tokenbridge.cli"]
    return [sys.executable, *head, "generate", f"k={prompts}", "--out", str(run), "--base-url", url,
            "--model", "m", "--max-tokens", "8", *extra]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != KILL_ENV}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _generate_in_child(settings: GenerateSettings, run: Path, crash_at: int) -> int:
    """Run generate in a forked child (no interpreter start-up: the kill loop stays fast) that
    SIGKILLs itself at its ``crash_at``-th commit point; its exit status, -9 when killed."""
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 99
        try:
            os.environ[KILL_ENV] = f"generate:*:{crash_at}"
            code = generate_run(settings, run).exit_code
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def test_kill_9_at_every_commit_point_then_rerun_loses_and_duplicates_nothing(tmp_path):
    n = 2
    spec = DatasetSpec("k", write_prompts(tmp_path, n))
    killed_at = []
    with HostileServer() as srv:
        settings = GenerateSettings(datasets=(spec,), request=RequestSettings(model="m", max_tokens=8),
                                    base_url=srv.url, concurrency=1, progress="none")
        for point in range(1, 40):
            run = tmp_path / f"run{point}"
            srv.attempts.clear()
            code = _generate_in_child(settings, run, point)
            if code == 0:  # past the last commit point: nothing left to kill
                break
            assert code == -signal.SIGKILL, (point, code)
            killed_at.append(point)
            again = asyncio.run(agenerate_run(settings, run))
            assert again.exit_code == 0, (point, again)
            rows = [json.loads(x) for x in (run / "exchanges.jsonl").read_bytes().splitlines()]
            assert [r["id"] for r in rows] == [f"k-{i}" for i in range(n)], point  # every prompt exactly once
            assert all(srv.attempts[f"q{i}"] in (1, 2) for i in range(n)), (point, srv.attempts)  # resent at most once
            assert again.done + again.already_done == n and again.pending == 0
            with Store.open(run) as store:
                assert store.status_counts() == {"done": n}
                assert store._conn.execute("SELECT COUNT(*) FROM responses").fetchone() == (n,)
            assert {p.name for p in run.iterdir()} == KEPT_FILES, (point, sorted(p.name for p in run.iterdir()))
        else:
            pytest.fail("the run never finished without a kill")
    # 3 before sending, a stage + a commit per batch, end of run, 2 per atomic file
    assert len(killed_at) >= 3 + 2 * n + 1 + 4, killed_at


def _interrupt(tmp_path: Path, sig: int, times: int, mode: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Start generate (4 prompts, 2 at a time), send ``sig`` once two requests are in flight and,
    once generate has printed that it stopped sending, again (``times`` 2); "gate" replies are
    released only then. With two signals the drain is endless (:data:`_ENDLESS_DRAIN`)."""
    prompts = write_prompts(tmp_path, 4)
    run = tmp_path / "run"
    with HostileServer() as srv:
        for i in range(4):
            srv.plan[f"q{i}"] = [mode]
        proc = subprocess.Popen(_cmd(prompts, run, srv.url, "--progress", "plain", "-c", "2", endless_drain=times == 2),
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            for _ in range(_CHILD_LIMIT_S * 50):  # bounded poll: two requests in flight
                if sum(srv.attempts.values()) >= 2 or proc.poll() is not None:
                    break
                time.sleep(0.02)
            assert sum(srv.attempts.values()) == 2, (srv.attempts, proc.poll())
            proc.send_signal(sig)
            err_head = b""
            assert proc.stderr is not None
            for line in proc.stderr:  # the first signal handled (bounded: generate exits after its drain time)
                err_head += line
                if line.startswith(b"interrupted: sending stopped"):
                    break
            if times == 2:  # a second signal sent before the first is handled would merge with it
                proc.send_signal(sig)
            srv.gate.set()
            out, err = proc.communicate(timeout=_CHILD_LIMIT_S)
        finally:
            if proc.poll() is None:  # only when an assertion or the bound above failed
                proc.kill()
                proc.communicate()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err_head + err)
    return result, json.loads((run / "generate.json").read_text())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_at_once_with_130_and_no_traceback(tmp_path, sig):
    res, summary = _interrupt(tmp_path, sig, 2, "hang")  # exits at all: it did not wait out the hour's drain
    err = res.stderr.decode()
    assert res.returncode == 130 and "Traceback" not in err, err
    assert "interrupted: sending stopped; waiting up to 3600 s for the 2 request(s) in flight" in err
    assert "interrupted again: stopping now" in err
    assert "stopped: interrupted: 0 of 4 samples kept, 4 pending (rerun the same command to continue)" in err
    assert summary["pending"] == 4 and summary["exit_code"] == 130
    assert summary["errors"] == {"interrupted": 2}  # the two that went out are on the books
    with Store.open(tmp_path / "run") as store:
        assert [(a.sample_id, a.n, a.error_class) for s in ("k-0", "k-1") for a in store.attempts(s)] == [
            ("k-0", 1, "interrupted"), ("k-1", 1, "interrupted")]
        assert store._conn.execute("SELECT COUNT(*) FROM in_flight").fetchone() == (0,)


def test_a_first_signal_drains_in_flight_requests_and_keeps_them(tmp_path):
    res, summary = _interrupt(tmp_path, signal.SIGINT, 1, "gate")
    err = res.stderr.decode()
    assert res.returncode == 130 and "Traceback" not in err, err
    assert "interrupted: sending stopped; waiting up to 60 s for the 2 request(s) in flight" in err
    assert "stopped: interrupted: 2 of 4 samples kept, 2 pending (rerun the same command to continue)" in err
    assert (summary["done"], summary["pending"]) == (2, 2)


def test_the_drain_after_a_first_interrupt_is_bounded(tmp_path):
    from tokenbridge.generate.budget import Budget
    from tokenbridge.generate.engine import Engine, WorkItem

    async def main(srv: HostileServer):
        settings = GenerateSettings(request=RequestSettings(model="m", max_tokens=8), base_url=srv.url, concurrency=2,
                                    progress="none")
        with Store.open(tmp_path / "run") as store:
            store.add_samples([(f"k-{i}", "k", "", json.dumps({"model": "m", "messages": [
                {"role": "user", "content": f"q{i}"}]})) for i in range(4)])
            engine = Engine(settings, None, store, Budget(None, None))
            task = asyncio.create_task(engine.run([WorkItem.from_stored(s) for s in store.samples()]))
            for _ in range(3000):  # both requests at the server (bounded wait): a slot taken is not yet one sent
                if engine.in_flight == 2 and sum(srv.attempts.values()) == 2:
                    break
                await asyncio.sleep(0.01)
            engine.request_stop(drain_s=0.2)
            stats = await asyncio.wait_for(task, 20)  # not the hanging requests' hour
            return stats, store.status_counts()

    with HostileServer() as srv:
        for i in range(4):
            srv.plan[f"q{i}"] = ["hang"]
        stats, counts = asyncio.run(main(srv))
    assert (stats.done, stats.stop_reason, counts) == (0, "interrupted", {"pending": 4})
    assert stats.requests == 2  # nothing sent after the interrupt


# --- a request that went out stays on the books whatever ends the run --------------------------

_PRICES = Prices(prompt=1.0, completion=1.0)


def _reservation(store: Store, sample_id: str) -> float:
    """What the budget reserves for a sample's request: its worst case at :data:`_PRICES`."""
    (request,) = [s.request for s in store.samples([sample_id])]
    return _PRICES.cost(estimate_prompt_tokens(request), 8)


def test_requests_in_flight_at_an_abort_are_booked_as_possible_spend(tmp_path):
    from tokenbridge.generate.budget import Budget
    from tokenbridge.generate.engine import Engine, WorkItem

    async def main(url: str):
        settings = GenerateSettings(request=RequestSettings(model="m", max_tokens=8), base_url=url, concurrency=2,
                                    progress="none", max_cost=1.0, prices=_PRICES)
        with Store.open(tmp_path / "run") as store:
            store.add_samples([(f"k-{i}", "k", "", json.dumps({"model": "m", "max_tokens": 8, "messages": [
                {"role": "user", "content": f"q{i}"}]})) for i in range(4)])
            engine = Engine(settings, None, store, Budget(1.0, _PRICES))
            task = asyncio.create_task(engine.run([WorkItem.from_stored(s) for s in store.samples()]))
            for _ in range(2000):  # both requests out (bounded wait)
                if sum(srv.attempts.values()) == 2:
                    break
                await asyncio.sleep(0.01)
            engine.abort()  # what a second Ctrl-C, or SIGTERM after the drain, does
            stats = await asyncio.wait_for(task, 20)
            reserved = [_reservation(store, f"k-{i}") for i in range(2)]
            rows = [(a.sample_id, a.n, a.error_class, a.cost, a.possible_cost) for i in range(4)
                    for a in store.attempts(f"k-{i}")]
            return stats, reserved, rows, store.possible_cost(), store.status_counts()

    with HostileServer() as srv:
        for i in range(4):
            srv.plan[f"q{i}"] = ["hang"]
        stats, reserved, rows, possible, counts = asyncio.run(main(srv.url))
    assert (stats.requests, stats.errors, counts) == (2, {"interrupted": 2}, {"pending": 4})
    assert rows == [("k-0", 1, "interrupted", None, pytest.approx(reserved[0])),
                    ("k-1", 1, "interrupted", None, pytest.approx(reserved[1]))]
    assert stats.possible == possible == pytest.approx(sum(reserved)) and possible > 0  # a resume's budget starts there


@pytest.mark.parametrize("mode", ["whole_then_hold", "whole_then_hold_sse"])
def test_an_answer_that_came_whole_before_an_abort_is_kept_not_bought_again(tmp_path, mode):
    """The server sent the whole answer and held the connection (a Content-Length too long, a
    stream with its finish and usage but no [DONE]): an abort threw the bytes away and booked
    the request as interrupted at its reservation (0 without a cap), the sample stayed pending
    and the rerun paid again (a cold tester's). It is kept as a cut transfer's answer is."""
    from tokenbridge.generate.budget import Budget
    from tokenbridge.generate.engine import Engine, WorkItem

    async def main(url: str):
        settings = GenerateSettings(request=RequestSettings(model="m", max_tokens=8), base_url=url, concurrency=2,
                                    progress="none", stream=mode.endswith("sse"))
        with Store.open(tmp_path / "run") as store:
            store.add_samples([(f"k-{i}", "k", "", json.dumps({"model": "m", "max_tokens": 8, "messages": [
                {"role": "user", "content": f"q{i}"}]})) for i in range(2)])
            engine = Engine(settings, None, store, Budget(None, None))
            task = asyncio.create_task(engine.run([WorkItem.from_stored(s) for s in store.samples()]))
            for _ in range(2000):  # both answers sent whole, both connections held (bounded wait)
                if sum(srv.attempts.values()) == 2 and srv.whole.is_set():
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # the second body read too
            engine.abort()  # a second Ctrl-C, or the first's drain running out
            stats = await asyncio.wait_for(task, 20)
            rows = [(a.sample_id, a.error_class, a.cost) for i in range(2) for a in store.attempts(f"k-{i}")]
            return stats, rows, store.status_counts(), store.total_cost()

    with HostileServer() as srv:
        for i in range(2):
            srv.plan[f"q{i}"] = [f"{mode}:0.25"]
        stats, rows, counts, spent = asyncio.run(main(srv.url))
    assert counts == {"done": 2} and stats.errors == {}, (counts, rows)
    assert rows == [("k-0", None, 0.25), ("k-1", None, 0.25)] and spent == pytest.approx(0.5)


def _abort_one(tmp_path: Path, mode: str, *, max_attempts: int = 6):
    """One sample sent to a ``mode`` reply, aborted once its body is out: (stats, attempt rows, statuses)."""
    from tokenbridge.generate.budget import Budget
    from tokenbridge.generate.engine import Engine, WorkItem

    async def main(url: str):
        settings = GenerateSettings(request=RequestSettings(model="m", max_tokens=8), base_url=url, concurrency=2,
                                    progress="none", max_attempts=max_attempts)
        with Store.open(tmp_path / "run") as store:
            store.add_samples([("k-0", "k", "", json.dumps({"model": "m", "max_tokens": 8, "messages": [
                {"role": "user", "content": "q0"}]}))])
            engine = Engine(settings, None, store, Budget(None, None))
            task = asyncio.create_task(engine.run([WorkItem.from_stored(s) for s in store.samples()]))
            for _ in range(2000):  # the body out, the connection held (bounded wait)
                if srv.whole.is_set():
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            engine.abort()
            stats = await asyncio.wait_for(task, 20)  # a hang here is the failure
            rows = [(a.error_class, a.cost, a.body is not None) for a in store.attempts("k-0")]
            return stats, rows, store.status_counts()

    with HostileServer() as srv:
        srv.plan["q0"] = [mode]
        return asyncio.run(main(srv.url))


def test_a_part_of_an_answer_at_an_abort_leaves_the_sample_pending_on_its_last_attempt(tmp_path):
    """Its bytes and booking go to the attempt row, but the sample was marked failed ("gave
    up after 1 attempts") where the abort leaves every other pending (a cold reviewer's)."""
    stats, rows, counts = _abort_one(tmp_path, "half_then_hold", max_attempts=1)
    assert counts == {"pending": 1} and stats.failed == 0 and stats.errors == {"interrupted": 1}
    assert rows == [("interrupted", None, True)]


def test_a_bug_in_keeping_what_came_at_an_abort_does_not_hang_the_run(tmp_path, monkeypatch):
    """A bug in the salvage replaced the cancellation: the worker swallowed it and waited for
    more work, and the run never ended (a cold reviewer's fault injection)."""
    from tokenbridge.generate import engine as E

    def broken(self, *args):
        raise ValueError("a bug in the salvage")
    monkeypatch.setattr(E.Engine, "_salvaged", broken)
    stats, rows, counts = _abort_one(tmp_path, "whole_then_hold")
    assert counts == {"pending": 1} and stats.internal_errors == 1


def _kill_9_once_sent(settings: GenerateSettings, run: Path, srv: HostileServer, sent: int) -> None:
    """Run generate in a forked child and kill -9 it once ``sent`` requests reached ``srv``."""
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            generate_run(settings, run)
        finally:
            os._exit(99)
    try:
        for _ in range(2000):  # the requests out (bounded wait), then kill -9
            if sum(srv.attempts.values()) == sent:
                break
            time.sleep(0.01)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_requests_in_flight_at_a_kill_9_are_booked_when_the_next_run_begins(tmp_path):
    spec = DatasetSpec("k", write_prompts(tmp_path, 4))
    run = tmp_path / "run"
    with HostileServer() as srv:
        srv.plan["q0"] = srv.plan["q1"] = ["hang", "ok"]  # the first two hang until the kill, then answer
        settings = GenerateSettings(datasets=(spec,), request=RequestSettings(model="m", max_tokens=8),
                                    base_url=srv.url, concurrency=2, progress="none", max_cost=1.0, prices=_PRICES)
        _kill_9_once_sent(settings, run, srv, 2)
        assert dict(srv.attempts) == {"q0": 1, "q1": 1}
        with Store.open(run) as store:  # what the killed run left: the two requests, recorded before they went out
            reserved = [_reservation(store, f"k-{i}") for i in range(2)]
            assert store.possible_cost() == pytest.approx(sum(reserved))
        again = asyncio.run(agenerate_run(settings, run))
    assert (again.exit_code, again.done, again.requests) == (0, 4, 4)
    assert (again.spent_total, again.spent_possible) == (pytest.approx(4 * 0.0001), pytest.approx(sum(reserved)))
    with Store.open(run) as store:
        rows = [(a.sample_id, a.n, a.error_class, a.cost, a.possible_cost) for i in range(2)
                for a in store.attempts(f"k-{i}")]
        assert store._conn.execute("SELECT COUNT(*) FROM in_flight").fetchone() == (0,)
    assert rows == [("k-0", 1, "unanswered", None, pytest.approx(reserved[0])), ("k-0", 2, None, 0.0001, None),
                    ("k-1", 1, "unanswered", None, pytest.approx(reserved[1])), ("k-1", 2, None, 0.0001, None)]


def test_requests_killed_in_flight_without_prices_are_not_said_to_cost_nothing(tmp_path, capsys):
    """Without [prices] nothing priced their reservations, and the next run said they were
    "booked at their reservations as possibly billed ($0.0000 in all)" though the server
    charged for them (a cold tester's): what they cost is unknown, and it says so."""
    spec = DatasetSpec("k", write_prompts(tmp_path, 2))
    run = tmp_path / "run"
    with HostileServer() as srv:
        srv.plan["q0"] = ["hang", "ok"]
        settings = GenerateSettings(datasets=(spec,), request=RequestSettings(model="m", max_tokens=8),
                                    base_url=srv.url, concurrency=1, progress="none")
        _kill_9_once_sent(settings, run, srv, 1)
        capsys.readouterr()
        again = asyncio.run(agenerate_run(settings, run))
    assert (again.exit_code, again.done, again.spent_possible) == (0, 2, 0.0)
    assert ("1 request(s) sent by an earlier run that ended without storing their answers (killed?) may have been "
            "billed: no [prices] priced their reservations, so what they cost is unknown and not counted") in \
        " ".join(capsys.readouterr().err.split())


# --- Ctrl-C / SIGTERM before the first request: loading the prompts, starting the run ------


def test_ctrl_c_while_the_prompts_load_stops_at_once(tmp_path, monkeypatch):
    """Inside ``asyncio.run`` a SIGINT only cancelled the task at its next ``await``: a
    150,000-row load ran to its end, stored every sample and exited 6.5 s later, its run
    row left open. The load (made to take 30 s here, the signal at its start) now stops
    at the signal: KeyboardInterrupt, nothing stored, no run folder made."""
    import tokenbridge.generate.run as run_mod

    loaded = run_mod._load_rows

    def slow_load(*args):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the load starts
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # Python work the signal can interrupt
            pass
        return loaded(*args)

    monkeypatch.setattr(run_mod, "_load_rows", slow_load)
    settings = GenerateSettings(datasets=(DatasetSpec("k", write_prompts(tmp_path, 3)),), base_url="http://127.0.0.1:9/v1",
                                request=RequestSettings(model="m"), progress="none")
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        generate_run(settings, tmp_path / "run")
    assert time.monotonic() - started < 20
    assert not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers of before


@pytest.mark.parametrize(("point", "sig"), [("generate:samples added", signal.SIGINT),
                                            ("generate:run begun", signal.SIGINT),
                                            ("generate:run begun", signal.SIGTERM)])
def test_a_signal_while_the_run_starts_stops_it_in_one_line_with_its_run_closed(tmp_path, point, sig):
    """The CLI stopped at ``point`` (SIGSTOP, timing-free), signalled, resumed: exit 130 and
    one line, no request sent, the samples stored whole and pending, and the run's row (when
    one was opened) closed as interrupted, not NULL. SIGTERM killed the process outright.
    The same command then sends every sample once."""
    from outputs_support import wait_stopped

    prompts = write_prompts(tmp_path, 3)
    run = tmp_path / "run"
    with HostileServer() as srv:
        proc = subprocess.Popen(_cmd(prompts, run, srv.url, "--progress", "none"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env=_env(**{KILL_ENV: f"{point}:1", "TOKENBRIDGE_TEST_KILL_SIGNAL": "SIGSTOP"}))
        try:
            wait_stopped(proc)
            proc.send_signal(sig)
            proc.send_signal(signal.SIGCONT)
            _, err = proc.communicate(timeout=_CHILD_LIMIT_S)
        finally:
            if proc.poll() is None:  # only when the bound above failed
                proc.kill()
                proc.communicate()
        assert proc.returncode == 130, err
        assert err.strip().splitlines() == [
            f"error: interrupted; what was stored in {run} is kept: rerun the same command to continue"]
        assert sum(srv.attempts.values()) == 0
        with Store.open(run) as store:
            assert store.status_counts() == {"pending": 3}
            runs = store._conn.execute("SELECT outcome, finished_at IS NOT NULL FROM runs").fetchall()
        assert runs == ([] if point == "generate:samples added" else [("interrupted", 1)])
        again = subprocess.run(_cmd(prompts, run, srv.url, "--progress", "none"), env=_env(), capture_output=True,
                               text=True, timeout=_CHILD_LIMIT_S)
        assert again.returncode == 0, again.stderr
        assert dict(srv.attempts) == {"q0": 1, "q1": 1, "q2": 1}
