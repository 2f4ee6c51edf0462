"""What the generation benchmarks share: an emulator in its own process, the prompts, one
``generate_run`` against it, and writing a section of ``bench/RESULTS.md``.

``bench_generate.py`` and ``bench_limiter.py`` import it (each is run as a script from the
repository, so this folder is on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "kimi-k2.5"
MODEL = "moonshotai/kimi-k2.5"
DISTINCT_PROMPTS = 64  # the emulator caches per prompt, so its own cost stays small and flat


def messages(i: int) -> list[dict[str, str]]:
    """The chat of benchmark request ``i``."""
    return [{"role": "user", "content": f"Benchmark prompt number {i % DISTINCT_PROMPTS}: say something short."}]


def write_prompts(path: Path, n: int) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "messages": messages(i)}) + "\n")
    return path


def spawn_emulator(config: str, latency_ms: float, tokenizer: str, path: Path) -> subprocess.Popen[str]:
    """Start an emulator with the TOML ``config`` (written to ``path``); its output goes to
    ``path`` with the suffix ``.log`` (a pipe nobody reads would fill and stall it)."""
    path.write_text(config, encoding="utf-8")
    cmd = [sys.executable, "-m", "tokenbridge.cli", "emulator", "--port", "0", "--latency-ms", str(latency_ms),
           "--config", str(path), "--tokenizer", tokenizer]
    with path.with_suffix(".log").open("w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)


def emulator_url(proc: subprocess.Popen[str], path: Path, timeout_s: float = 120.0) -> str:
    """The base URL the emulator started by :func:`spawn_emulator` printed first."""
    log = path.with_suffix(".log")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        first = log.read_text(encoding="utf-8").partition("\n")[0]
        if "http://" in first:
            return "http://" + first.split("http://", 1)[1].split()[0]
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"emulator did not start: {log.read_text(encoding='utf-8')[-2000:]}")


def stop_emulator(proc: subprocess.Popen[str], path: Path) -> str:
    """Stop it; what it said past its "serving on" line (worth seeing when not empty)."""
    proc.terminate()
    proc.wait(10)
    return "\n".join(path.with_suffix(".log").read_text(encoding="utf-8").splitlines()[1:])


@contextlib.contextmanager
def _limiter_start(start: int | None) -> Iterator[None]:
    """Engines built inside start their limiter at ``start`` slots (None: the default slow start)."""
    if start is None:
        yield
        return
    from tokenbridge.generate import engine

    with mock.patch.object(engine, "AdaptiveLimiter", functools.partial(engine.AdaptiveLimiter, start=start)):
        yield


def run_generate(url: str, n: int, concurrency: int, workdir: Path, *, max_tokens: int = 64,
                 limiter_start: int | None = None, **settings: Any) -> Any:  # Any: GenerateSettings' own fields
    """``n`` benchmark prompts through a full ``generate_run`` (SQLite store, exchanges.jsonl)
    into ``workdir/run``; its summary. ``settings`` are further GenerateSettings fields."""
    from tokenbridge.generate import GenerateSettings, RequestSettings, generate_run
    from tokenbridge.generate.settings import DatasetSpec

    workdir.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(workdir / "prompts.jsonl", n)
    config = GenerateSettings(
        datasets=(DatasetSpec("bench", prompts),),
        request=RequestSettings(model=MODEL, max_tokens=max_tokens),
        base_url=url,
        concurrency=concurrency,
        progress="none",
        **settings,
    )
    with _limiter_start(limiter_start):
        return generate_run(config, workdir / "run")


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def write_results(head: str, text: str) -> None:
    """Replace the section of bench/RESULTS.md that starts with ``head`` (or append it)."""
    old = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "# Benchmarks\n"
    if head in old:
        start = old.index(head)
        nxt = old.find("\n## ", start + len(head))
        new = old[:start] + text.rstrip("\n") + "\n" + (old[nxt:] if nxt >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    from tokenbridge import fsio

    fsio.write_text(RESULTS, new)
