"""Adaptive concurrency under 429s: request rate and mean in flight, against fault-free.

Each scenario has its own emulator process on loopback (1 s latency by default: the
rates are then set by latency, not by this machine's CPU, which 256 requests in flight
at 200 ms saturate on 2 shared cores); a
full ``generate_run`` (256 allowed in flight) sends to it, scenarios interleaved round
by round so drift on a shared machine hits them alike:

* ``fault-free``: the baseline;
* ``5% random 429s``: the provider answers 5% of requests 429 (with Retry-After), at any load;
* ``30% mixed faults``: the emulator's ``fault_rate`` 0.3 (429, 502/503, error bodies,
  cut streams, malformed JSON, and slow answers that pass the client's timeout);
* ``hard cap C``: the provider serves C requests at once and answers 429 above it.

Figures come from the run's own store: the rate is successes per second between the
10th and 90th percentile of success times (the steady part: no start-up, no retry tail),
mean in flight is the attempts' summed time in that stretch over its length, and the
429 share is over every attempt of the run (start-up included: starting at 256 against a
cap of C costs 256 - C refusals once) and over the attempts sent in the stretch.

    python bench/bench_limiter.py                  # 3 rounds, 3000 samples per run
    python bench/bench_limiter.py --quick          # 1 round, 600 samples (< 60 s)
    python bench/bench_limiter.py --write-results  # also update bench/RESULTS.md "## Limiter"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
MODEL = "moonshotai/kimi-k2.5"
DISTINCT_PROMPTS = 64  # the emulator caches per prompt, so its own cost stays small and flat


def _scenarios(cap: int) -> dict[str, str]:
    """Scenario name -> emulator config (TOML)."""
    common = "min_tokens = 8\nmax_tokens = 24\nretry_after_s = 1\nslow_s = 5.0\n"
    provider = '[[providers]]\nname = "clean/fp8"\n'
    return {
        "fault-free": common + provider,
        "5% random 429s": common + provider + "[providers.faults]\nrate_limit = 0.05\n",
        "30% mixed faults": "fault_rate = 0.3\n" + common + provider,
        f"hard cap {cap}": common + provider + f"max_concurrency = {cap}\n",
    }


def _spawn_emulator(config: str, latency_ms: float, tokenizer: str, path: Path) -> subprocess.Popen:
    """Start an emulator whose output goes to ``path.log`` (a pipe nobody reads would fill and stall it)."""
    path.write_text(config, encoding="utf-8")
    cmd = [sys.executable, "-m", "tokenbridge.cli", "emulator", "--port", "0", "--latency-ms", str(latency_ms),
           "--config", str(path), "--tokenizer", tokenizer]
    with path.with_suffix(".log").open("w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)


def _url_of(proc: subprocess.Popen, path: Path, timeout_s: float = 120.0) -> str:
    log = path.with_suffix(".log")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        first = log.read_text(encoding="utf-8").partition("\n")[0]
        if "http://" in first:
            return "http://" + first.split("http://", 1)[1].split()[0]
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"emulator did not start: {log.read_text(encoding='utf-8')[-2000:]}")


def _run(url: str, n: int, concurrency: int, workdir: Path) -> dict:
    from tokenbridge.generate import GenerateSettings, RequestSettings, generate_run
    from tokenbridge.generate.settings import DatasetSpec

    workdir.mkdir()
    prompts = workdir / "prompts.jsonl"
    with prompts.open("w", encoding="utf-8") as f:
        for i in range(n):
            text = f"Benchmark prompt number {i % DISTINCT_PROMPTS}: say something short."
            f.write(json.dumps({"id": i, "messages": [{"role": "user", "content": text}]}) + "\n")
    settings = GenerateSettings(
        datasets=(DatasetSpec("bench", prompts),),
        request=RequestSettings(model=MODEL, max_tokens=64),
        base_url=url,
        concurrency=concurrency,
        progress="none",
        timeout_s=2.0,  # the emulator's slow answers (latency + 5 s) become timeouts
        backoff_max_s=2.0,  # a short retry tail (Retry-After still wins); the figures skip the tail anyway
        max_attempts=4,
    )
    summary = generate_run(settings, workdir / "run")
    return {**_measure(workdir / "run" / "state.sqlite"), "done": summary.done, "failed": summary.failed}


def _measure(db: Path) -> dict:
    con = sqlite3.connect(db)
    rows = con.execute("SELECT started_at, latency_s, http_status, error_class FROM attempts").fetchall()
    con.close()
    ok_ends = sorted(s + lat for s, lat, status, err in rows if status == 200 and err is None)
    t10, t90 = ok_ends[len(ok_ends) // 10], ok_ends[(len(ok_ends) * 9) // 10]
    span = t90 - t10
    busy = sum(max(0.0, min(s + (lat or 0.0), t90) - max(s, t10)) for s, lat, _, _ in rows)
    in_stretch = sum(1 for t in ok_ends if t10 < t <= t90)
    sent_in_stretch = [r for r in rows if t10 <= r[0] <= t90]
    return {
        "req_s": in_stretch / span,
        "in_flight": busy / span,
        "share_429": sum(1 for r in rows if r[2] == 429) / len(rows),
        "steady_429": sum(1 for r in sent_in_stretch if r[2] == 429) / max(1, len(sent_in_stretch)),
        "attempts": len(rows),
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _write_results(text: str) -> None:
    old = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "# Benchmarks\n"
    head = "## Limiter"
    if head in old:
        start = old.index(head)
        nxt = old.find("\n## ", start + len(head))
        new = old[:start] + text.rstrip("\n") + "\n" + (old[nxt:] if nxt >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    RESULTS.write_text(new, encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--cap", type=int, default=64, help="the hard-cap scenario's max_concurrency")
    ap.add_argument("--latency-ms", type=float, default=1000.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round of 600 samples")
    ap.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "tokenizers" / "kimi-k2.5"))
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.rounds = 600, 1
    os.environ.setdefault("OPENROUTER_API_KEY", "bench-key")
    scenarios = _scenarios(args.cap)
    runs: dict[str, list[dict]] = {name: [] for name in scenarios}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tb-bench-limiter-") as tmp:
        work = Path(tmp)
        paths = {name: work / f"emu{i}.toml" for i, name in enumerate(scenarios)}
        procs = {name: _spawn_emulator(config, args.latency_ms, args.tokenizer, paths[name])
                 for name, config in scenarios.items()}  # started together: they load in parallel
        try:
            urls = {name: _url_of(proc, paths[name]) for name, proc in procs.items()}
            for r in range(args.rounds):
                for i, name in enumerate(scenarios):
                    t_run = time.perf_counter()
                    res = _run(urls[name], args.samples, args.concurrency, work / f"s{i}-r{r}")
                    runs[name].append(res)
                    print(f"round {r + 1} {name}: {res['req_s']:.0f} req/s, {res['in_flight']:.1f} in flight, "
                          f"429 share {res['share_429']:.1%} (steady {res['steady_429']:.1%}), "
                          f"done {res['done']}, failed {res['failed']} ({time.perf_counter() - t_run:.0f} s)",
                          file=sys.stderr, flush=True)
        finally:
            for name, proc in procs.items():
                proc.terminate()
                proc.wait(10)
                tail = paths[name].with_suffix(".log").read_text(encoding="utf-8").splitlines()[1:]
                if tail:  # anything past the "serving on" line is worth seeing
                    print(f"emulator for {name} said:\n" + "\n".join(tail[-20:]), file=sys.stderr)
    total_s = time.perf_counter() - t0
    base = _median([x["req_s"] for x in runs["fault-free"]])
    lines = [
        "## Limiter",
        "",
        f"`python bench/bench_limiter.py --samples {args.samples} --rounds {args.rounds}` on {os.cpu_count()} CPU "
        f"cores ({platform.python_implementation()} {platform.python_version()}): {args.concurrency} allowed in "
        f"flight, {args.latency_ms:g} ms emulator latency, one emulator process per scenario, scenarios "
        f"interleaved per round ({total_s:.0f} s in all). Rate: successes/s between the 10th and 90th percentile "
        "of success times; in flight: attempts' time in that stretch over its length; 429 share: of every "
        "attempt of the run (whole) and of those sent in the stretch (steady). Median (min-max) over the rounds; "
        "ratio: median rate over the fault-free median.",
        "",
        "| scenario | req/s | ratio vs fault-free | mean in flight | 429 share, whole run | 429 share, steady | done / failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rs in runs.items():
        rate = [x["req_s"] for x in rs]
        fl = [x["in_flight"] for x in rs]
        sh = [x["share_429"] for x in rs]
        st = [x["steady_429"] for x in rs]
        lines.append(
            f"| {name} | {_median(rate):.0f} ({min(rate):.0f}-{max(rate):.0f}) | {_median(rate) / base:.2f}x | "
            f"{_median(fl):.1f} ({min(fl):.1f}-{max(fl):.1f}) | {_median(sh):.1%} ({min(sh):.1%}-{max(sh):.1%}) | "
            f"{_median(st):.1%} ({min(st):.1%}-{max(st):.1%}) | "
            f"{sum(x['done'] for x in rs)} / {sum(x['failed'] for x in rs)} |"
        )
    cap_name = f"hard cap {args.cap}"
    lines += ["", "Targets: 5% random 429s >= 0.8x fault-free "
              f"({_median([x['req_s'] for x in runs['5% random 429s']]) / base:.2f}x); 30% mixed >= 0.5x "
              f"({_median([x['req_s'] for x in runs['30% mixed faults']]) / base:.2f}x); hard cap {args.cap}: "
              f">= {0.8 * args.cap:.1f} in flight ({_median([x['in_flight'] for x in runs[cap_name]]):.1f}) "
              f"with <= 5% answered 429 ({_median([x['share_429'] for x in runs[cap_name]]):.1%} of the whole run, "
              f"{_median([x['steady_429'] for x in runs[cap_name]]):.1%} steady)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write_results:
        _write_results(text)


if __name__ == "__main__":
    main()
