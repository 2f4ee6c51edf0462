"""Start-up time of the CLI: ``tokenbridge --help`` and ``import tokenbridge``, wall clock.

Each round runs ``python -c pass`` (the interpreter alone, the baseline), then
``python -m tokenbridge.cli --help``, then ``python -c "import tokenbridge"``, so machine
noise hits all three alike; medians and ranges over the rounds. ``--src`` points at
another checkout's ``src`` to compare two trees in one sitting.

    python bench/bench_startup.py --rounds 10 [--src OTHER/src]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _wall(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the src folder whose tokenbridge is timed")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(args.src)}
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "tokenbridge --help": [sys.executable, "-m", "tokenbridge.cli", "--help"],
        "import tokenbridge": [sys.executable, "-c", "import tokenbridge"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.rounds):
        for name, cmd in commands.items():
            times[name].append(_wall(cmd, env))
    base = statistics.median(times["python -c pass"])
    print(f"{args.src} ({args.rounds} rounds, interleaved)")
    print("| command | median ms | range ms | median / python -c pass |")
    print("| --- | ---: | ---: | ---: |")
    for name, runs in times.items():
        med = statistics.median(runs)
        print(f"| {name} | {med * 1000:.0f} | {min(runs) * 1000:.0f}-{max(runs) * 1000:.0f} | {med / base:.1f} |")


if __name__ == "__main__":
    main()
