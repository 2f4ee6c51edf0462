"""Measure an emulator's request rate: ``python -m tokenbridge.emulator.loadtest URL``.

Sends non-streamed requests with fresh messages (no cache hits) at a fixed concurrency
and prints requests per second. Run the emulator in another process (``tokenbridge
emulator --port P``) so the figure is the server's, not this client's event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import aiohttp


async def measure(base_url: str, requests: int, concurrency: int, token_ids: bool = False) -> float:
    """Requests per second for ``requests`` fresh non-streamed chat completions."""
    nonce = os.urandom(4).hex()
    gate = asyncio.Semaphore(concurrency)
    failures = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one(i: int) -> None:
            nonlocal failures
            body = {
                "model": "moonshotai/kimi-k2.5",
                "messages": [{"role": "user", "content": f"Question {i} ({nonce}): explain topic {i} in detail"}],
                "return_token_ids": token_ids,
            }
            async with gate, session.post(f"{base_url}/chat/completions", json=body) as resp:
                await resp.read()
                failures += resp.status != 200

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        elapsed = time.perf_counter() - start
    if failures:
        print(f"warning: {failures} requests did not get HTTP 200")
    return requests / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url", help="e.g. http://127.0.0.1:8000/api/v1")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--token-ids", action="store_true", help="ask for return_token_ids")
    args = parser.parse_args()
    rate = asyncio.run(measure(args.base_url, args.requests, args.concurrency, args.token_ids))
    print(f"{args.requests} requests at concurrency {args.concurrency}: {rate:.0f} req/s")


if __name__ == "__main__":
    main()
