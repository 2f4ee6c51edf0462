"""Live progress during a real run against the emulator: plain lines every ``log_interval_s``
and a refreshed bar on a terminal, from the first request to the last, fresh and resumed.

The display used to be started before the engine knew its total and so never started at
all: a 13 s run with ``log_interval_s = 1`` printed only its final line."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from tokenbridge.emulator import EmulatorConfig, running_emulator
from tokenbridge.generate import GenerateSettings, RequestSettings, generate_run
from tokenbridge.generate.progress import Reporter
from tokenbridge.generate.run import ExitCode
from tokenbridge.generate.secrets import ApiKey
from tokenbridge.generate.settings import DatasetSpec

# asserts on the wall clock or on timings (sleeps, rates, deadlines): run alone, after the
# rest of the suite runs on every core (`make test`), so a busy machine cannot fail them
pytestmark = pytest.mark.serial

MODEL = "moonshotai/kimi-k2.5"
KEY = ApiKey("X", "sk-or-v1-TOKENBRIDGE-FAKE-KEY-progress-0001")
INTERVAL_S = 0.2
# 100 ms a request, 2 at a time: 24 samples take at least 1.2 s, about six intervals
LATENCY_MS, CONCURRENCY = 100, 2
LINE = re.compile(
    r"\[generate\] (?P<done>\d+)/(?P<total>\d+) done, (?P<failed>\d+) failed, "
    r"\d+\.\d req/(?:s|min|h), [\d,]+ out tok/(?:s|min|h), \$\d+\.\d{4} spent, "
    r"in flight (?P<inflight>\d+)/2, errors: none, ETA (?P<eta>\d+:\d\d:\d\d|--:--:--)"
)


def _prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"s{i}", "prompt": f"Say {i}."}) + "\n" for i in range(n)),
                    encoding="utf-8")
    return path


def _settings(url: str, prompts: Path, limit: int | None = None) -> GenerateSettings:
    return GenerateSettings(datasets=(DatasetSpec("d", prompts, limit=limit),),
                            request=RequestSettings(model=MODEL, max_tokens=64), base_url=url,
                            concurrency=CONCURRENCY, progress="plain", log_interval_s=INTERVAL_S)


def _run_plain(url: str, prompts: Path, run: Path, limit: int | None = None) -> tuple[list[str], Reporter]:
    out = io.StringIO()
    reporter = Reporter("plain", interval_s=INTERVAL_S, out=out)
    summary = generate_run(_settings(url, prompts, limit), run, key=KEY, reporter=reporter)
    assert summary.exit_code == ExitCode.OK
    return out.getvalue().splitlines(), reporter


def _check_lines(lines: list[str], total: int) -> None:
    """Every line in the exact format; lines before the last while samples were still
    going; counts that never go back; the last one the finished run."""
    parsed = [LINE.fullmatch(line) for line in lines]
    assert all(parsed), lines
    assert len(lines) >= 3, lines  # at least two while it ran, then the final line
    done = [int(m["done"]) for m in parsed if m]
    assert all(int(m["total"]) == total and m["failed"] == "0" for m in parsed if m), lines
    assert done == sorted(done) and done[-1] == total, lines
    assert any(0 < d < total for d in done[:-1]), lines  # seen mid-run, not only at the end
    last = parsed[-1]
    assert last is not None and last["inflight"] == "0" and last["eta"] == "0:00:00", lines


@pytest.fixture(scope="module")
def url(kimi):
    config = EmulatorConfig(latency_ms=LATENCY_MS, min_tokens=5, max_tokens=20, retry_after_s=0)
    with running_emulator(config, tokenizer=kimi) as base_url:
        yield base_url


def test_plain_progress_lines_come_every_interval_while_generate_runs(tmp_path, url):
    lines, _ = _run_plain(url, _prompts(tmp_path / "p.jsonl", 24), tmp_path / "run")
    _check_lines(lines, 24)
    assert len(lines) >= 4, lines  # >= 1.2 s at one line per 0.2 s: several, not only the last


def test_a_resumed_run_shows_progress_of_what_is_left_and_nothing_when_nothing_is(tmp_path, url):
    prompts, run = _prompts(tmp_path / "p.jsonl", 24), tmp_path / "run"
    first, _ = _run_plain(url, prompts, run, limit=8)
    _check_lines(first, 8)
    resumed, _ = _run_plain(url, prompts, run)  # 8 already done: 16 to send
    _check_lines(resumed, 16)
    again, reporter = _run_plain(url, prompts, run)  # all done: no "0/0" line, no display loop left running
    assert again == [] and reporter._runner is None


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_refreshed_with_rate_and_eta_while_generate_runs(tmp_path, url, monkeypatch):
    """At 80 columns: the detail on one line with the bar made the bar, the count and the
    ETA give way; the bar now has its own line, the detail the next."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("LINES", "24")
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    out = _Terminal()
    reporter = Reporter("auto", interval_s=INTERVAL_S, out=out)
    assert reporter.mode == "rich"
    summary = generate_run(_settings(url, _prompts(tmp_path / "p.jsonl", 24), None), tmp_path / "run",
                           key=KEY, reporter=reporter)
    assert summary.exit_code == ExitCode.OK
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # the redraws, without cursor moves
    rows = [row.rstrip() for row in re.split(r"[\r\n]+", text) if row.strip()]
    bars = [re.fullmatch(r"generate [━╸╺ ]+ +(\d+)/24 \d:\d\d:\d\d", row) for row in rows if row.startswith("generate")]
    assert bars and all(bars), rows
    counts = [int(m[1]) for m in bars if m]
    assert len(counts) >= 3 and any(0 < n < 24 for n in counts) and counts[-1] == 24, rows  # redrawn mid-run
    details = [row for row in rows if not row.startswith("generate")]
    assert len(details) >= 3 and all(
        re.fullmatch(r"0 failed \d+\.\d req/(s|min|h) [\d,]+ tok/\1 \$\d+\.\d{4} inflight \d+/2 errors: none "
                     r"ETA (\d+:\d\d:\d\d|--:--:--)", row) for row in details), rows
    assert details[-1].endswith("inflight 0/2 errors: none ETA 0:00:00"), rows
