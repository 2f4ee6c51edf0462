"""tokenbridge.lanes: byte ranges that read every line once, handed out so each worker
keeps to a stretch of its own, results back in file order, failures that surface."""

from __future__ import annotations

import json
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbridge import lanes
from tokenbridge.exchanges import iter_lines
from tokenbridge.lanes import InputChanged, Snapshot, _lines_before, _Ranges, map_lines, owned_lines, text_lines
from tokenbridge.reconstruct import _chunk_lines

_LINES = st.lists(st.tuples(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"")),
                            st.sampled_from([b"\n", b"\r\n", b"\r", b"\n\n", b"\r\r\n"])), max_size=30)


@settings(max_examples=300, deadline=None)
@given(_LINES, st.booleans(), st.lists(st.integers(0, 2000), max_size=12))
def test_any_partition_into_ranges_reads_every_line_once(tmp_path_factory, lines, trailing, cuts):
    data = b"".join(text + end for text, end in lines) + (b"tail" if trailing else b"")
    path = tmp_path_factory.mktemp("l") / "in.jsonl"
    path.write_bytes(data)
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(data)}), len(data)]
    fd = os.open(path, os.O_RDONLY)
    try:
        pieces = [owned_lines(fd, a, b) for a, b in zip(bounds, bounds[1:])]
    finally:
        os.close(fd)
    assert b"".join(p for _, p in pieces) == data
    for start, piece in pieces:
        assert data[start:start + len(piece)] == piece
        assert start == 0 or data[start - 1:start] == b"\n" or not piece  # a piece starts where a line does
        assert not piece or piece.endswith(b"\n") or start + len(piece) == len(data)
    # numbering: a piece's first line is one past the lines text mode ends before it
    got, line = [], 1
    for _, piece in pieces:
        got += list(_chunk_lines((line, piece)))
        line += text_lines(piece)
    assert [(n, _text(t)) for n, t in got] == list(iter_lines(path))


def _text(line: memoryview | str) -> str:
    return line if isinstance(line, str) else str(line, "utf-8", "surrogateescape")


def test_lines_before_counts_a_crlf_cut_by_a_block_once(tmp_path, monkeypatch):
    data = b"a" * ((1 << 20) - 1) + b"\r\n" + b"b\rc\n"
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    for offset in (0, 5, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, len(data)):
        assert _lines_before(str(path), offset) == text_lines(data[:offset]), offset


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5_000_000), st.integers(1, 4), st.randoms(use_true_random=False))
def test_ranges_partition_the_file_and_keep_each_worker_on_its_stretch(size, workers, rnd):
    ranges = _Ranges(size, workers)
    taken: list[tuple[int, int, int]] = []
    live = list(range(workers))
    while live:
        w = rnd.choice(live)
        got = ranges.take(w)
        if got is None:
            live.remove(w)
            continue
        taken.append((w, *got))
    spans = sorted((a, b) for _, a, b in taken)
    assert all(b > a for a, b in spans)
    assert [(0, 0), *spans][-1][1] == size  # reaches the end...
    assert all(prev[1] == nxt[0] for prev, nxt in zip([(0, 0), *spans], spans))  # ...with no gap or overlap
    assert all(b - a <= max(lanes.RANGE_BYTES, lanes.MIN_RANGE_BYTES) for a, b in spans)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3), st.randoms(use_true_random=False))
def test_a_slow_worker_never_has_more_than_a_stretch_a_worker_waiting_on_it(workers, rnd):
    """One worker takes a range only now and then: the others' ranges past its front (the
    results that wait for it) stay within a stretch a worker, plus the ranges in flight."""
    stretch = 1 << 20
    ranges = _Ranges(40 << 20, workers + 1, stretch)
    slow = workers  # the last worker
    ranges.take(slow)
    while (got := ranges.take(rnd.randrange(workers) if rnd.random() < 0.97 else slow)) is not None:
        front = min((s.front for s in ranges.stretches if s is not None and s.front < s.end), default=got[1])
        assert got[1] - front <= (workers + 1) * stretch + stretch


def test_each_worker_starts_on_its_own_share_and_the_last_ranges_are_small():
    ranges = _Ranges(4_000_000, 2)
    first = [ranges.take(0), ranges.take(1)]
    assert first == [(0, lanes.RANGE_BYTES), (2_000_000, 2_000_000 + lanes.RANGE_BYTES)]
    order = []
    while (got := ranges.take(len(order) % 2)) is not None:
        order.append(got)
    assert all(b - a <= lanes.MIN_RANGE_BYTES for a, b in order[-4:])
    # a stretch bigger than STRETCH_BYTES is never given to one worker at once
    big = _Ranges(10 * lanes.STRETCH_BYTES, 2)
    big.take(0)
    big.take(1)
    assert [s.end - s.front + lanes.RANGE_BYTES for s in big.stretches if s] == [lanes.STRETCH_BYTES] * 2


def _init(tag: str) -> None:
    os.environ["LANES_TEST_TAG"] = tag


def _count(data: bytes) -> tuple[int, str]:
    return data.count(b"\n"), os.environ["LANES_TEST_TAG"]


def test_results_come_back_in_file_order_with_their_first_line(tmp_path, monkeypatch):
    monkeypatch.setattr(lanes, "RANGE_BYTES", 64)
    monkeypatch.setattr(lanes, "MIN_RANGE_BYTES", 64)
    rnd = random.Random(3)
    lines = [b"x" * rnd.randrange(0, 150) + b"\n" for _ in range(400)]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(lines))
    out = list(map_lines(str(path), 3, _init, ("set up",), _count))
    assert [first for first, _ in out] == [1 + sum(n for _, (n, _) in out[:k]) for k in range(len(out))]
    assert sum(n for _, (n, _) in out) == 400
    assert {tag for _, (_, tag) in out} == {"set up"}


def _fail_on_z(data: bytes) -> int:
    if b"z" in data:
        raise ZeroDivisionError("a bug on z")
    return 0


def test_a_worker_exception_surfaces_with_its_traceback_and_first_line(tmp_path, monkeypatch):
    monkeypatch.setattr(lanes, "RANGE_BYTES", 16)
    monkeypatch.setattr(lanes, "MIN_RANGE_BYTES", 16)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\r\n" * 20 + b"z\n" + b"b\n" * 20)
    seen = []
    with pytest.raises(ZeroDivisionError, match="a bug on z") as info:
        list(map_lines(str(path), 2, _init, ("x",), _fail_on_z, on_error=lambda exc, first: seen.append(first)))
    assert "_fail_on_z" in str(info.value.__cause__)
    # the failing range starts on a line at or before the z line (21), after the lines before it
    assert len(seen) == 1 and 15 <= seen[0] <= 21


def _die(data: bytes) -> int:
    os._exit(3)


def test_a_worker_that_dies_stops_the_run_instead_of_hanging(tmp_path, monkeypatch):
    """With ranges still queued to it (its socket unread: the parent's recv sees a reset,
    its send a broken pipe), the run ends with the one error that says what happened."""
    monkeypatch.setattr(lanes, "RANGE_BYTES", 16)
    monkeypatch.setattr(lanes, "MIN_RANGE_BYTES", 16)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\n" * 2000)
    for _ in range(5):
        with pytest.raises(lanes.WorkerDied, match=r"^a reconstruct worker exited \(code 3\) before finishing its "
                                                   r"work; nothing partial was kept$"):
            list(map_lines(str(path), 2, _init, ("x",), _die))


def _killed(data: bytes) -> int:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does
    return 0


def test_a_worker_killed_by_a_signal_is_named_as_such_not_as_a_bug(tmp_path):
    """A worker SIGKILLed (the out-of-memory killer) ended the run with a RuntimeError the CLI
    printed as a traceback and "a bug in tokenbridge" (a cold tester's): it is one line."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\n" * 100)
    with pytest.raises(lanes.WorkerDied) as info:
        list(map_lines(str(path), 2, _init, ("x",), _killed))
    assert str(info.value) == ("a reconstruct worker was killed by SIGKILL (most often the system's out-of-memory "
                               "killer: give it more memory, or fewer --workers) before finishing its work; nothing "
                               "partial was kept")


class _TwoArgs(Exception):
    def __init__(self, a: str, b: str):
        super().__init__(f"{a}/{b}")


def _fail_unpicklably(data: bytes) -> int:
    exc = _TwoArgs("bad", "thing")  # pickles, but cannot be rebuilt from its args
    exc.__dict__["seen"] = 7
    exc.add_note("a note that travels")
    raise exc


def test_an_exception_that_cannot_be_rebuilt_arrives_as_its_type_and_text(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\n" * 10)
    seen = []
    with pytest.raises(RuntimeError, match=r"^_TwoArgs: bad/thing") as info:
        list(map_lines(str(path), 2, _init, ("x",), _fail_unpicklably, on_error=lambda exc, first: seen.append(first)))
    assert info.value.__notes__ == ["a note that travels"] and info.value.__dict__["seen"] == 7
    assert "_fail_unpicklably" in str(info.value.__cause__)
    assert seen == [1]


def _bad_init(tag: str) -> None:
    raise LookupError(f"no tokenizer {tag}")


def test_a_failed_set_up_surfaces_as_itself(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\n" * 10)
    with pytest.raises(LookupError, match="no tokenizer here") as info:
        list(map_lines(str(path), 2, _bad_init, ("here",), _count))
    assert "_bad_init" in str(info.value.__cause__)


def test_a_failed_set_up_surfaces_as_itself_when_the_worker_is_gone_before_its_first_range(tmp_path, monkeypatch):
    """The parent sent the first ranges to a worker that had already failed and exited: the
    send's broken pipe was reported as a dead worker, hiding the error the worker had sent
    (seen under load as a flaky suite test)."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\n" * 10)
    real = lanes._feed

    def after_exit(ranges, i, w):
        w.process.join(10)  # the worker failed its set-up, sent why and exited
        real(ranges, i, w)

    monkeypatch.setattr(lanes, "_feed", after_exit)
    with pytest.raises(LookupError, match="no tokenizer here") as info:
        list(map_lines(str(path), 2, _bad_init, ("here",), _count))
    assert "_bad_init" in str(info.value.__cause__)


def test_a_pipe_is_refused_and_reconstruct_reads_it_in_one_process(tmp_path, kimi):
    from tokenbridge.reconstruct import reconstruct_file

    from test_reconstruct_speed_paths import _records

    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        list(map_lines(str(fifo), 2, _init, ("x",), _count))
    data = ("\n".join(_records(kimi)) + "\n").encode()
    (tmp_path / "in.jsonl").write_bytes(data)
    reconstruct_file(tmp_path / "in.jsonl", tmp_path / "file.jsonl", kimi, workers=1)
    pid = os.fork()
    if pid == 0:  # the writer end of the pipe
        with open(fifo, "wb") as fh:
            fh.write(data)
        os._exit(0)
    summary = reconstruct_file(fifo, tmp_path / "pipe.jsonl", kimi, workers=2)
    os.waitpid(pid, 0)
    assert (tmp_path / "pipe.jsonl").read_bytes() == (tmp_path / "file.jsonl").read_bytes()
    assert summary.to_dict()["records"] == 18


def test_ranges_inside_one_long_line_read_only_themselves(tmp_path, monkeypatch):
    """A CR-only file is one \\n-line: every range but the first owns nothing, and reads
    only its own bytes looking for a line start (not on to the end of the file)."""
    data = b"x" * 99 + b"\r"
    path = tmp_path / "in.jsonl"
    path.write_bytes(data * 20_000)  # 2 MB, no \n
    read = []
    real = os.pread

    def counting(fd: int, n: int, offset: int) -> bytes:
        out = real(fd, n, offset)
        read.append(len(out))
        return out

    monkeypatch.setattr(lanes.os, "pread", counting)
    fd = os.open(path, os.O_RDONLY)
    try:
        pieces = [owned_lines(fd, a, min(a + 16_384, 2_000_000)) for a in range(0, 2_000_000, 16_384)]
    finally:
        os.close(fd)
    assert b"".join(p for _, p in pieces) == data * 20_000
    assert sum(read) <= 2 * 2_000_000 + 16_384


def test_an_empty_file_starts_nothing_and_yields_nothing(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"")
    assert list(map_lines(str(path), 2, _init, ("x",), _count)) == []


_ORPHAN = """
import os, sys, time
from tokenbridge import lanes
def init(): pass
def work(data):
    os.write(1, f"{os.getpid()}\\n".encode())  # one write: two workers' prints can interleave their parts
    time.sleep(0.05)
    return len(data)
lanes.RANGE_BYTES = lanes.MIN_RANGE_BYTES = 100
for _ in lanes.map_lines(sys.argv[1], 2, init, (), work):
    pass
"""


def test_workers_end_when_their_parent_is_killed(tmp_path):
    """A forked worker must not hold the parent's end of any pipe: then a SIGKILLed parent
    is an EOF to its workers, and they exit instead of waiting forever."""
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\n" * 100_000)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN, str(path)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    pids = set()
    while len(pids) < 2:
        pids.add(int(proc.stdout.readline()))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_running(p) for p in pids):
            time.sleep(0.05)
        assert not any(_running(p) for p in pids)
    finally:  # a failing run leaves no orphans behind
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@settings(max_examples=200, deadline=None)
@given(lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=30),
       trailing=st.booleans(), frac=st.floats(0, 1.2))
def test_one_process_reads_a_size_as_a_range_does(tmp_path_factory, lines, trailing, frac):
    """Given a size (the file as it was when the run began), one process reads the lines that
    start before it and the one it cuts whole, as the range ``[0, size)`` does: a file that
    grows reads alike on any number of workers and in both passes (a cold tester's)."""
    from tokenbridge.reconstruct import _chunks

    data = b"\n".join(lines) + (b"\n" if trailing and lines else b"")
    path = tmp_path_factory.mktemp("s") / "in.jsonl"
    path.write_bytes(data)
    size = min(len(data), int(len(data) * frac))
    fd = os.open(path, os.O_RDONLY)
    try:
        _, want = owned_lines(fd, 0, size)
    finally:
        os.close(fd)
    snapshot = Snapshot.of(str(path))
    snapshot = Snapshot(snapshot.path, snapshot.shown, snapshot.dev, snapshot.ino, size)
    assert b"".join(piece for _, piece in _chunks(path, 3, max_bytes=7, snapshot=snapshot)) == want


def test_a_file_that_grows_is_read_as_it_was_by_both_passes_and_any_worker_count(tmp_path, kimi, monkeypatch):
    """Each pass took the file's size anew (one process read to its end): records appended
    while the run read the file were judged by traits the first pass found without them, and
    one and two workers wrote different outputs (a cold tester's)."""
    import tokenbridge.reconstruct as R
    from conftest import EXAMPLE_EXCHANGES
    from tokenbridge.reconstruct import reconstruct_file

    src = tmp_path / "in.jsonl"
    original = EXAMPLE_EXCHANGES.read_bytes() * 20  # over 256 kB: a second worker has work
    real = R._run_chunks
    outputs = []
    for workers in (1, 2):
        src.write_bytes(original)

        def growing(*args, **kwargs):
            for n, result in enumerate(real(*args, **kwargs)):
                if n == 0:  # more records come while the run reads the file
                    with open(src, "ab") as fh:
                        fh.write(EXAMPLE_EXCHANGES.read_bytes().replace(b'"id": "ex-', b'"id": "late-'))
                yield result

        monkeypatch.setattr(R, "_run_chunks", growing)
        summary = reconstruct_file(src, tmp_path / f"out{workers}.jsonl", kimi, workers=workers)
        outputs.append((tmp_path / f"out{workers}.jsonl").read_bytes())
        assert b'"late-' not in outputs[-1] and summary.records + len(summary.bad_lines) == 8 * 20
    assert outputs[0] == outputs[1]


def _uncounted_run(kimi, path, n: int = 25, tag: str = "lazy") -> None:
    """``n`` records from a provider that leaves its end token out of ``completion_tokens``:
    a trait the first pass finds, so reconstruct reads the file a second time."""
    from tokenbridge.chat import DIALECTS

    request = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "Say something."}]}
    prompt = len(kimi.encode(DIALECTS["kimi-k2.5"].render_request(request)))
    lines = []
    for i in range(n):
        reasoning, content = f"Thinking about {i}.", f"Answer {i}."
        completion = len(kimi.encode(reasoning)) + 1 + len(kimi.encode(content)) + 1
        message = {"role": "assistant", "reasoning_content": reasoning, "content": content}
        lines.append(json.dumps({"id": f"{tag}-{i}", "request": request, "response": {
            "provider": "lazy", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion - 1}}}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _between_passes(monkeypatch, change):
    """Make ``change()`` happen when reconstruct's first pass is done, before its second."""
    import tokenbridge.reconstruct as R

    real, passes = R._reconstruct_pass, []

    def pass_then_change(*args, **kwargs):
        summary = real(*args, **kwargs)
        passes.append(summary)
        if len(passes) == 1:
            change()
        return summary

    monkeypatch.setattr(R, "_reconstruct_pass", pass_then_change)
    return passes


def test_an_uncounted_end_makes_a_second_pass(tmp_path, kimi, monkeypatch):
    """The premise of the two tests below: this run is read twice, and reads alike twice."""
    from tokenbridge.reconstruct import reconstruct_file

    _uncounted_run(kimi, tmp_path / "in.jsonl")
    passes = _between_passes(monkeypatch, lambda: None)
    summary = reconstruct_file(tmp_path / "in.jsonl", tmp_path / "out.jsonl", kimi, workers=2)
    assert len(passes) == 2 and summary.traits["lazy"].end_uncounted and summary.status == {"ok": 25}


@pytest.mark.parametrize("workers", [1, 2])
def test_an_input_renamed_over_between_passes_stops_the_run_and_keeps_no_output(tmp_path, kimi, monkeypatch, workers):
    """Both passes (and every worker) opened the input by path: a file renamed over it after
    the first pass was read by the second as the same input, its rows judged by the first
    file's traits and written as one output (25 rows of the other file). Every open must now
    find the file the run started on."""
    from tokenbridge.reconstruct import reconstruct_file

    src, dst, other = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "other.jsonl"
    _uncounted_run(kimi, src)
    _uncounted_run(kimi, other, tag="new")
    dst.write_bytes(b"the user's old output\n")
    _between_passes(monkeypatch, lambda: os.replace(other, src))
    with pytest.raises(InputChanged, match=r"in\.jsonl: another file took its name while it was being read"):
        reconstruct_file(src, dst, kimi, workers=workers)
    assert dst.read_bytes() == b"the user's old output\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


@pytest.mark.parametrize("workers", [1, 2])
def test_an_input_cut_short_between_passes_stops_the_run_rather_than_dropping_its_tail(tmp_path, kimi, monkeypatch,
                                                                                       workers):
    """A file truncated after the first pass ended the second early without a word: its last
    records were neither rows nor bad lines."""
    from tokenbridge.reconstruct import reconstruct_file

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _uncounted_run(kimi, src)
    size = src.stat().st_size
    _between_passes(monkeypatch, lambda: os.truncate(src, size // 3))
    with pytest.raises(InputChanged, match=rf"in\.jsonl: cut short while it was being read \({size:,} bytes at "
                                           rf"the start, {size // 3:,} now\)"):
        reconstruct_file(src, dst, kimi, workers=workers)
    assert not dst.exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_an_input_cut_short_during_a_pass_is_refused_too(tmp_path, kimi, monkeypatch, workers):
    """Cut while a pass reads it (after the check at open): the read that comes up short says so."""
    import tokenbridge.reconstruct as R
    from tokenbridge.reconstruct import reconstruct_file

    src = tmp_path / "in.jsonl"
    _uncounted_run(kimi, src, n=400)
    size = src.stat().st_size
    monkeypatch.setattr(lanes, "RANGE_BYTES", 16 * 1024)
    # cut once the pass has begun: in this process after its first chunk; with workers, when the
    # parent first hands out ranges (a worker that opened the file by then reads short ranges,
    # one that had not finds it short at its open: spawned workers, where threads run, see no patch)
    module, name = (R, "_work") if workers == 1 else (lanes, "_feed")
    real = getattr(module, name)

    def cutting(*args):
        if os.stat(src).st_size == size:
            os.truncate(src, size // 2)
        return real(*args)

    monkeypatch.setattr(module, name, cutting)
    with pytest.raises(InputChanged, match=r"in\.jsonl: cut short while it was being read"):
        reconstruct_file(src, tmp_path / "out.jsonl", kimi, workers=workers, chunk_lines=8)


def _cut_on_first(data: bytes) -> int:
    """Work that truncates the file (``LANES_TEST_TAG``) to half, once: the worker opened and
    checked it before, so only its reads come up short."""
    path = os.environ["LANES_TEST_TAG"]
    if os.stat(path).st_size == 10_000:
        os.truncate(path, 5_000)
    return len(data)


def test_a_range_that_comes_up_short_after_the_open_is_refused(tmp_path, monkeypatch):
    """The worker's own check at open passed; the file shrank while it read: the range it
    reads next ends before the range does, and that is said, not read as fewer lines."""
    monkeypatch.setattr(lanes, "RANGE_BYTES", 1024)
    monkeypatch.setattr(lanes, "MIN_RANGE_BYTES", 1024)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"x" * 99 + b"\n" * 1 + (b"y" * 99 + b"\n") * 99)
    size = path.stat().st_size
    with pytest.raises(InputChanged, match=rf"in\.jsonl: cut short while it was being read \({size:,} bytes at the "
                                           rf"start, {size // 2:,} now\)"):
        list(map_lines(str(path), 1, _init, (str(path),), _cut_on_first))
