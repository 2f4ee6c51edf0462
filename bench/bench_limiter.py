"""Adaptive concurrency under 429s: request rate, in flight and 429 share, against fault-free.

Each scenario has its own emulator process on loopback (1 s latency by default: the
rates are then set by latency, not by this machine's CPU, which 256 requests in flight
at 200 ms saturate on 2 shared cores); a full ``generate_run`` (256 allowed in flight,
slow start from 16) sends to it, scenarios interleaved round by round so drift on a
shared machine hits them alike:

* ``fault-free``: the baseline;
* ``fault-free, no slow start``: the limiter starting at 256, what slow start costs;
* ``5% random 429s``: the provider answers 5% of requests 429 (with Retry-After), at any load;
* ``30% mixed faults``: the emulator's ``fault_rate`` 0.3 (429, 502/503, error bodies,
  cut streams, malformed JSON, and slow answers that pass the client's timeout);
* ``hard cap C`` for each of ``--caps``: the provider serves C requests at once and
  answers 429 above it.

Figures come from the run's own store: the rate is successes per second between the
10th and 90th percentile of success times (the steady part: no start-up, no retry tail),
mean in flight is the attempts' summed time in that stretch over its length, and the
429 share is over every attempt of the run (whole run, start-up included) and over the
attempts sent in the stretch (steady). "Whole s" is first send to last answer. The whole
run is also cut in three (``_phases``): the ramp (slow start, until in flight first reaches
95% of its steady level), the backlog (until the last first attempt is sent: "in flight,
backlog" is first send to there, where the limiter decides what is in flight) and the
drain (fewer requests than slots left: the last answers and the retry tail); each part's
slot-seconds short of the steady level is its share of the steady-to-whole gap.

    python bench/bench_limiter.py                  # 3 rounds, 3000 samples per run
    python bench/bench_limiter.py --quick          # 1 round, 600 samples, caps 16 and 64 at 200 ms
    python bench/bench_limiter.py --write-results  # also update bench/RESULTS.md "## Limiter"
"""

from __future__ import annotations

import argparse
import os
import platform
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from generate_loop import TOKENIZER, emulator_url, median, run_generate, spawn_emulator, stop_emulator, write_results

NO_SLOW_START = "fault-free, no slow start"


def _scenarios(caps: list[int]) -> dict[str, tuple[str, int | None]]:
    """Scenario name -> (emulator config TOML, the limiter's start: None is the default slow start)."""
    common = "min_tokens = 8\nmax_tokens = 24\nretry_after_s = 1\nslow_s = 5.0\n"
    provider = '[[providers]]\nname = "clean/fp8"\n'
    out: dict[str, tuple[str, int | None]] = {
        "fault-free": (common + provider, None),
        NO_SLOW_START: (common + provider, 1 << 30),
        "5% random 429s": (common + provider + "[providers.faults]\nrate_limit = 0.05\n", None),
        "30% mixed faults": ("fault_rate = 0.3\n" + common + provider, None),
    }
    for cap in caps:
        out[f"hard cap {cap}"] = (common + provider + f"max_concurrency = {cap}\n", None)
    return out


def _run(url: str, n: int, concurrency: int, workdir: Path, start: int | None) -> dict[str, Any]:
    summary = run_generate(
        url, n, concurrency, workdir, limiter_start=start,
        timeout_s=2.0,  # the emulator's slow answers (latency + 5 s) become timeouts
        backoff_max_s=2.0,  # a short retry tail (Retry-After still wins); the figures skip the tail anyway
        max_attempts=4,
    )
    return {**_measure(workdir / "run" / "state.sqlite"), "done": summary.done, "failed": summary.failed}


def _measure(db: Path) -> dict[str, float]:
    con = sqlite3.connect(db)
    rows = con.execute("SELECT started_at, latency_s, http_status, error_class, n FROM attempts").fetchall()
    con.close()
    ok_ends = sorted(s + lat for s, lat, status, err, _ in rows if status == 200 and err is None)
    t10, t90 = ok_ends[len(ok_ends) // 10], ok_ends[(len(ok_ends) * 9) // 10]
    span = t90 - t10
    busy = _busy([(s, s + (lat or 0.0)) for s, lat, *_ in rows], t10, t90)
    in_stretch = sum(1 for t in ok_ends if t10 < t <= t90)
    sent_in_stretch = [r for r in rows if t10 <= r[0] <= t90]
    first, last = min(r[0] for r in rows), max(r[0] + (r[1] or 0.0) for r in rows)
    return {
        "req_s": in_stretch / span,
        "in_flight": busy / span,
        "share_429": sum(1 for r in rows if r[2] == 429) / len(rows),
        "steady_429": sum(1 for r in sent_in_stretch if r[2] == 429) / max(1, len(sent_in_stretch)),
        "whole_s": last - first,
        "whole_in_flight": sum(r[1] or 0.0 for r in rows) / (last - first),
        "attempts": len(rows),
        **_phases(rows, busy / span),
    }


def _busy(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """The attempts' summed time within [lo, hi]."""
    return sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in spans)


def _phases(rows: list[tuple[Any, ...]], steady: float) -> dict[str, float]:
    """The whole run cut where the limiter's part ends: the ramp (first send until in flight
    first reaches 95% of the steady level: slow start, and the cut's way down to a cap), the
    backlog (until the last first attempt is sent: while it lasts the limiter decides what is in
    flight), the drain (the last answers and the retries' tail: fewer requests than slots are
    left, which no limiter can fill). Each part's slot-seconds short of the steady level is its
    share of the gap between the steady and the whole-run figure."""
    spans = sorted((s, s + (lat or 0.0)) for s, lat, *_ in rows)
    first, last = spans[0][0], max(end for _, end in spans)
    last_first = max(r[0] for r in rows if r[4] == 1)
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    level, ramp_end = 0, last_first
    for at, step in edges:
        level += step
        if level >= 0.95 * steady:
            ramp_end = min(at, last_first)
            break
    parts = {"ramp": (first, ramp_end), "backlog": (ramp_end, last_first), "drain": (last_first, last)}
    short = {name: max(0.0, steady * (hi - lo) - _busy(spans, lo, hi)) for name, (lo, hi) in parts.items()}
    gap = sum(short.values()) or 1.0
    return {
        "backlog_in_flight": _busy(spans, first, last_first) / max(1e-9, last_first - first),
        "ramp_s": ramp_end - first, "drain_s": last - last_first,
        **{f"gap_{name}": short[name] / gap for name in parts},
    }


def _cell(values: list[float], fmt: str) -> str:
    return f"{median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--caps", default="16,64,200", help="the hard-cap scenarios' max_concurrency, comma-separated")
    ap.add_argument("--latency-ms", type=float, default=1000.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round of 600 samples, caps 16 and 64, 200 ms")
    ap.add_argument("--tokenizer", default=str(TOKENIZER))
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.rounds, args.caps, args.latency_ms = 600, 1, "16,64", 200.0
    caps = [int(c) for c in args.caps.split(",") if c.strip()]
    os.environ.setdefault("OPENROUTER_API_KEY", "bench-key")
    scenarios = _scenarios(caps)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in scenarios}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tb-bench-limiter-") as tmp:
        work = Path(tmp)
        paths = {name: work / f"emu{i}.toml" for i, name in enumerate(scenarios)}
        procs = {name: spawn_emulator(config, args.latency_ms, args.tokenizer, paths[name])
                 for name, (config, _) in scenarios.items()}  # started together: they load in parallel
        try:
            urls = {name: emulator_url(proc, paths[name]) for name, proc in procs.items()}
            for r in range(args.rounds):
                for i, (name, (_, start)) in enumerate(scenarios.items()):
                    t_run = time.perf_counter()
                    res = _run(urls[name], args.samples, args.concurrency, work / f"s{i}-r{r}", start)
                    runs[name].append(res)
                    print(f"round {r + 1} {name}: {res['req_s']:.0f} req/s, {res['in_flight']:.1f} in flight, "
                          f"429 share {res['share_429']:.1%} (steady {res['steady_429']:.1%}), whole "
                          f"{res['whole_s']:.1f} s, {res['backlog_in_flight']:.1f} in flight while the backlog "
                          f"lasted, ramp {res['ramp_s']:.1f} s, drain {res['drain_s']:.1f} s, gap ramp/backlog/drain "
                          f"{res['gap_ramp']:.0%}/{res['gap_backlog']:.0%}/{res['gap_drain']:.0%}, "
                          f"done {res['done']}, failed {res['failed']} "
                          f"({time.perf_counter() - t_run:.0f} s)", file=sys.stderr, flush=True)
        finally:
            for name, proc in procs.items():
                said = stop_emulator(proc, paths[name])
                if said:
                    print(f"emulator for {name} said:\n" + "\n".join(said.splitlines()[-20:]), file=sys.stderr)
    total_s = time.perf_counter() - t0
    print(_table(runs, caps, args, total_s))
    if args.write_results:
        write_results("## Limiter", _table(runs, caps, args, total_s))


def _table(runs: dict[str, list[dict[str, float]]], caps: list[int], args: argparse.Namespace, total_s: float) -> str:
    def med(name: str, key: str) -> float:
        return median([x[key] for x in runs[name]])

    base = med("fault-free", "req_s")
    base_whole = med(NO_SLOW_START, "whole_s")
    lines = [
        "## Limiter",
        "",
        f"`python bench/bench_limiter.py --samples {args.samples} --rounds {args.rounds} --caps {args.caps}` on "
        f"{os.cpu_count()} CPU cores ({platform.python_implementation()} {platform.python_version()}): "
        f"{args.concurrency} allowed in flight, {args.latency_ms:g} ms emulator latency, one emulator process per "
        f"scenario, scenarios interleaved per round ({total_s:.0f} s in all). Rate: successes/s between the 10th "
        "and 90th percentile of success times; in flight: attempts' time in that stretch over its length (steady) "
        "or in the whole run, first send to last answer (whole); 429 share: of every attempt of the run (whole) "
        "and of those sent in the stretch (steady). Median (min-max) over the rounds; ratios: median over the "
        "fault-free median (rate) and over the no-slow-start median (whole-run time).",
        "",
        "| scenario | req/s | ratio vs fault-free | in flight, steady | in flight, whole | in flight, backlog "
        "| 429 share, whole run | 429 share, steady | whole s | x no slow start | done / failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rs in runs.items():
        lines.append(
            f"| {name} | {_cell([x['req_s'] for x in rs], '.0f')} | {med(name, 'req_s') / base:.2f}x | "
            f"{_cell([x['in_flight'] for x in rs], '.1f')} | {_cell([x['whole_in_flight'] for x in rs], '.1f')} | "
            f"{_cell([x['backlog_in_flight'] for x in rs], '.1f')} | "
            f"{_cell([x['share_429'] for x in rs], '.1%')} | {_cell([x['steady_429'] for x in rs], '.1%')} | "
            f"{_cell([x['whole_s'] for x in rs], '.1f')} | {med(name, 'whole_s') / base_whole:.2f}x | "
            f"{sum(int(x['done']) for x in rs)} / {sum(int(x['failed']) for x in rs)} |"
        )
    lines += [
        "",
        "Where the whole run's in flight went (\"in flight, backlog\" is first send to the last first attempt's "
        "send: after it fewer requests than slots are left). Ramp: first send until in flight first reaches 95% of "
        "its steady level; drain: the last first send to the last answer (the last answers and the retries' tail, "
        "a 429's retry waiting out its Retry-After). Gap: each part's slot-seconds short of the steady level, as "
        "shares of the gap between the steady and the whole-run figure.",
        "",
        "| scenario | ramp s | backlog s | drain s | gap: ramp | gap: backlog | gap: drain |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rs in runs.items():
        lines.append(
            f"| {name} | {_cell([x['ramp_s'] for x in rs], '.1f')} | "
            f"{_cell([x['whole_s'] - x['ramp_s'] - x['drain_s'] for x in rs], '.1f')} | "
            f"{_cell([x['drain_s'] for x in rs], '.1f')} | {_cell([x['gap_ramp'] for x in rs], '.0%')} | "
            f"{_cell([x['gap_backlog'] for x in rs], '.0%')} | {_cell([x['gap_drain'] for x in rs], '.0%')} |"
        )
    targets = [f"5% random 429s >= 0.8x fault-free ({med('5% random 429s', 'req_s') / base:.2f}x)",
               f"30% mixed >= 0.5x ({med('30% mixed faults', 'req_s') / base:.2f}x)"]
    for cap in caps:
        name = f"hard cap {cap}"
        targets.append(f"hard cap {cap}: >= {0.8 * cap:.1f} in flight ({med(name, 'in_flight'):.1f} steady, "
                       f"{med(name, 'whole_in_flight'):.1f} whole, {med(name, 'backlog_in_flight'):.1f} while the "
                       f"backlog lasted) with <= 5% answered 429 "
                       f"({med(name, 'share_429'):.1%} of the whole run)")
    targets.append(f"fault-free with slow start: {med('fault-free', 'whole_s') / base_whole:.2f}x the whole-run "
                   f"time without, {med('fault-free', 'req_s') / med(NO_SLOW_START, 'req_s'):.2f}x its steady rate")
    return "\n".join(lines + ["", "Targets: " + "; ".join(targets) + "."]) + "\n"


if __name__ == "__main__":
    main()
