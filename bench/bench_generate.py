"""Generation throughput: tokenbridge's engine vs a bare aiohttp loop vs the openai SDK.

All three send the same chat requests to one emulator (50 ms latency by default) at the
same concurrency; each client runs in its own process, so its peak RSS is its own. The
tokenbridge figure is a full ``generate_run`` (prompt loading, SQLite store with durable
commits, exchanges.jsonl), not the bare send loop.

    python bench/bench_generate.py                    # 3000 requests, 512 concurrent
    python bench/bench_generate.py --write-results    # also update bench/RESULTS.md "## Generation"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from generate_loop import (MODEL, TOKENIZER, emulator_url, messages, run_generate, spawn_emulator, stop_emulator,
                           write_results)


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


# --- clients (each runs in a child process) ----------------------------------------------


async def _bare_aiohttp(url: str, n: int, conc: int, max_tokens: int) -> int:
    import aiohttp

    ok = 0
    sem = asyncio.Semaphore(conc)
    connector = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=connector, headers={"Authorization": "Bearer bench"}) as session:

        async def one(i: int) -> None:
            nonlocal ok
            body = {"model": MODEL, "messages": messages(i), "max_tokens": max_tokens, "usage": {"include": True}}
            async with sem, session.post(url + "/chat/completions", json=body) as resp:
                data = json.loads(await resp.read())
                ok += resp.status == 200 and bool(data.get("choices"))

        await asyncio.gather(*(one(i) for i in range(n)))
    return ok


async def _openai_sdk(url: str, n: int, conc: int, max_tokens: int) -> int:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="bench", max_retries=0)  # the SDK's default httpx client
    ok = 0
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> None:
        nonlocal ok
        async with sem:
            try:
                r = await client.chat.completions.create(model=MODEL, messages=messages(i), max_tokens=max_tokens,
                                                         extra_body={"usage": {"include": True}})
                ok += bool(r.choices)
            except Exception:  # noqa: BLE001 - counted as not ok
                pass

    await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    return ok


def _tokenbridge(url: str, n: int, conc: int, max_tokens: int, workdir: Path) -> tuple[int, float]:
    summary = run_generate(url, n, conc, workdir, max_tokens=max_tokens)
    return summary.done, summary.send_s


def _child(args: argparse.Namespace) -> None:
    # imports are not part of the timing (each client imports only what it uses, for RSS)
    __import__({"aiohttp": "aiohttp", "openai": "openai", "tokenbridge": "tokenbridge.generate"}[args.client])
    t0 = time.perf_counter()
    cpu0 = _cpu_s()
    send_s = None
    if args.client == "aiohttp":
        ok = asyncio.run(_bare_aiohttp(args.url, args.requests, args.concurrency, args.max_tokens))
    elif args.client == "openai":
        ok = asyncio.run(_openai_sdk(args.url, args.requests, args.concurrency, args.max_tokens))
    else:
        ok, send_s = _tokenbridge(args.url, args.requests, args.concurrency, args.max_tokens, Path(args.workdir))
    elapsed = time.perf_counter() - t0
    cpu = _cpu_s() - cpu0
    send_s = send_s or elapsed
    print(json.dumps({"client": args.client, "ok": ok, "elapsed_s": elapsed, "send_s": send_s, "req_s": ok / send_s,
                      "cpu_ms_per_req": 1000 * cpu / max(ok, 1), "rss_mb": _rss_mb()}))


# --- parent: emulator + the three clients -------------------------------------------------


def _median(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda r: r["req_s"])
    return {**ordered[len(ordered) // 2], "rounds": len(runs)}


def _run_client(client: str, url: str, args: argparse.Namespace, workdir: Path, round_no: int) -> dict:
    sub = workdir / f"{client}-{round_no}"
    sub.mkdir()
    env = {**os.environ, "OPENROUTER_API_KEY": "bench-key"}
    cmd = [sys.executable, __file__, "--child", "--client", client, "--url", url, "--requests", str(args.requests),
           "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens), "--workdir", str(sub)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{client} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tokenizer", default=str(TOKENIZER))
    ap.add_argument("--rounds", type=int, default=3, help="rounds of tokenbridge and aiohttp (median kept)")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    with tempfile.TemporaryDirectory(prefix="tb-bench-") as tmp:
        work = Path(tmp)
        cfg = work / "emulator.toml"
        emu = spawn_emulator("min_tokens = 8\nmax_tokens = 24\n", args.latency_ms, args.tokenizer, cfg)
        try:
            url = emulator_url(emu, cfg)
            asyncio.run(_bare_aiohttp(url, min(args.requests, 1000), args.concurrency, args.max_tokens))  # warm caches
            rounds: dict[str, list[dict]] = {"tokenbridge": [], "aiohttp": [], "openai": []}
            for i in range(args.rounds):  # interleaved, so drift on a shared machine hits both alike
                for client in ("tokenbridge", "aiohttp") + (("openai",) if i == 0 else ()):
                    rounds[client].append(_run_client(client, url, args, work, i))
        finally:
            said = stop_emulator(emu, cfg)
            if said:
                print(f"the emulator said:\n{said[-3000:]}", file=sys.stderr)
    results = [_median(runs) for runs in rounds.values()]
    by = {r["client"]: r for r in results}
    ratio = by["tokenbridge"]["req_s"] / by["aiohttp"]["req_s"]
    lines = [
        "## Generation",
        "",
        f"`python bench/bench_generate.py --requests {args.requests} --concurrency {args.concurrency} "
        f"--latency-ms {args.latency_ms:g}` on {os.cpu_count()} CPU cores ({platform.python_implementation()} "
        f"{platform.python_version()}): the emulator in its own process, each client in its own process, "
        f"median of {args.rounds} interleaved rounds (openai: 1 round). \"Sending\" is first request to last "
        "stored response; for tokenbridge \"whole call\" adds loading the prompts, the store and writing "
        "exchanges.jsonl.",
        "",
        "| client | ok | sending s | req/s | whole call s | CPU ms/request | peak RSS MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    names = {"tokenbridge": "tokenbridge `generate_run` (SQLite store, durable commits)", "aiohttp": "bare aiohttp loop",
             "openai": "openai SDK `AsyncOpenAI` (default client)"}
    for r in results:
        lines.append(f"| {names[r['client']]} | {r['ok']} | {r['send_s']:.2f} | {r['req_s']:.0f} | "
                     f"{r['elapsed_s']:.2f} | {r['cpu_ms_per_req']:.2f} | {r['rss_mb']:.0f} |")
    whole = by["tokenbridge"]["ok"] / by["tokenbridge"]["elapsed_s"] / by["aiohttp"]["req_s"]
    lines += ["", f"tokenbridge / bare aiohttp: {ratio:.2f}x while sending (target >= 0.8x), {whole:.2f}x for the "
              f"whole call; openai SDK / bare aiohttp: {by['openai']['req_s'] / by['aiohttp']['req_s']:.2f}x."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write_results:
        write_results("## Generation", text)


if __name__ == "__main__":
    main()
