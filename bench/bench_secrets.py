"""What masking the key costs on every kept answer, against parsing that answer.

The engine runs ``scrub_bytes`` and ``mask_scattered`` on each body it keeps (and
``scattered_key`` on a stream's raw bytes), in its event loop. Bodies: an answer of ~32 kB
(reasoning and content from the Python reference topics, as JSON) and one of ~1 MB, for
three shapes of key (OpenRouter's hex, an OpenAI project key, an Anthropic key). Baseline in
the same round: ``orjson.loads`` of the same body, which every kept answer also costs.
Rounds interleave the functions; medians and ranges of the per-round medians.
``--src`` runs the same measurements from another checkout's ``src`` in the same rounds.

    python bench/bench_secrets.py [--rounds 5] [--src OTHER/src]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, secrets, sys, time
import orjson
from pydoc_data.topics import topics
from tokenbridge.generate.secrets import mask_scattered, scattered_key, scrub_bytes

prose = "".join(topics[k] for k in sorted(topics))
def body(n):
    half = n // 2
    return json.dumps({"choices": [{"message": {"reasoning": prose[:half], "content": prose[half:2 * half]}}]}).encode()
bodies = {"32kB": body(32_000), "1MB": body(1_000_000)}
keys = {"hex": "sk-or-v1-" + secrets.token_hex(32), "openai": "sk-proj-" + secrets.token_urlsafe(120),
        "anthropic": "sk-ant-api03-" + secrets.token_urlsafe(70)}
def best(f, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts) // 2] * 1e3
out = {}
for bname, b in bodies.items():
    n = 9 if bname == "32kB" else 3
    out[f"{bname} orjson.loads"] = best(lambda: orjson.loads(b), n)
    for kname, k in keys.items():
        out[f"{bname} {kname} scrub_bytes"] = best(lambda: scrub_bytes(b, k), n)
        out[f"{bname} {kname} mask_scattered"] = best(lambda: mask_scattered(b, k), n)
        out[f"{bname} {kname} scattered_key"] = best(lambda: scattered_key(b, k), n)
print(json.dumps(out))
"""


def _round(src: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--src", type=Path, default=None, help="another checkout's src/ to measure in the same rounds")
    args = ap.parse_args()
    trees = {"this tree": ROOT / "src", **({"other tree": args.src.resolve()} if args.src else {})}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, src in trees.items():
            runs[name].append(_round(src))
    for name, rounds in runs.items():
        print(f"\n{name} ({trees[name]}), ms per call, median (range) of {args.rounds} rounds; x orjson.loads")
        for what in rounds[0]:
            vals = [r[what] for r in rounds]
            base = statistics.median(r[f"{what.split()[0]} orjson.loads"] for r in rounds)
            med = statistics.median(vals)
            print(f"  {what:34s} {med:9.3f} ({min(vals):.3f}-{max(vals):.3f})  x{med / base:6.2f}")


if __name__ == "__main__":
    main()
