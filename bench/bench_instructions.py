"""Reconstruct's CPU instructions against raw tiktoken's, counted by valgrind: a figure the
shared, noisy machine cannot move.

Wall and CPU seconds on this 2-vCPU machine swing by 1.5x from one minute to the next
(stolen time, the other vCPU's load), which hides a 5% change. Instructions retired do not
swing: the same program on the same input retires the same count to a fraction of a
percent. So each variant runs once under ``valgrind --tool=callgrind`` and what it costs is
its count less the count of the same process stopped before the measured step (imports,
tokenizer load, corpus build: all outside the ratio):

* raw: tiktoken ``encode`` of each sample's whole text (prompt + completion, all markers
  allowed): what ``bench_reconstruct.py`` calls raw;
* reconstruct: ``reconstruct_file`` on one process (parse, render, encode, the whole gate,
  rows written), from this tree and, with ``--baseline-src``, from another checkout's src/.

Instructions are not time (a cache miss costs no instruction, a vectorised loop few); the
ratio says how much work reconstruct does beyond the encode, not how fast it runs.

    python bench/bench_instructions.py [--chars 1000000] [--baseline-src OTHER/src]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_reconstruct import DEFAULT_TOKENIZER, build_exchanges, build_workload_exchanges

ROOT = Path(__file__).resolve().parents[1]

# One process per count: the step runs when argv[3] is "1", else the process stops before it.
_RECONSTRUCT = (
    "import sys\n"
    "from tokenbridge.tokenizer import load_tokenizer\n"
    "from tokenbridge.reconstruct import reconstruct_file\n"
    "tok = load_tokenizer(sys.argv[2])\n"
    "if sys.argv[3] == '1':\n"
    "    reconstruct_file(sys.argv[1], sys.argv[1] + '.out.jsonl', tok, workers=1)\n"
)
_RAW = (
    "import sys\n"
    f"sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
    "from pathlib import Path\n"
    "import bench_reconstruct as B\n"
    "from tokenbridge.tokenizer import load_tokenizer\n"
    "tok = load_tokenizer(sys.argv[2])\n"
    "texts = B._texts(Path(sys.argv[1]), tok)\n"
    "enc = B.raw_encoder(Path(sys.argv[2]))\n"
    "if sys.argv[3] == '1':\n"
    "    for t in texts:\n"
    "        enc.encode(t, allowed_special='all')\n"
)


def instructions(code: str, corpus: Path, tokenizer: Path, run: bool, src: Path) -> int:
    """Instructions retired by one fresh interpreter running ``code`` (callgrind's count)."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", code,
         str(corpus), str(tokenizer), "1" if run else "0"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(src)},
    )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def step(code: str, corpus: Path, tokenizer: Path, src: Path) -> int:
    return instructions(code, corpus, tokenizer, True, src) - instructions(code, corpus, tokenizer, False, src)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=1_000_000, help="characters per corpus (valgrind runs ~50x slower)")
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--baseline-src", type=Path, default=None, help="another checkout's src/, counted the same way")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: this benchmark counts instructions with callgrind")
    from tokenbridge.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    src = ROOT / "src"
    lines = [f"instructions retired (callgrind), {args.chars:,} characters a corpus; ratios against raw tiktoken encode",
             "", "| corpus | records | raw | reconstruct | ratio | baseline reconstruct | ratio | this tree / baseline |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        corpora = {"bench": Path(tmp) / "bench.jsonl", "workload": Path(tmp) / "workload.jsonl"}
        build_exchanges(corpora["bench"], tok, args.chars)
        build_workload_exchanges(corpora["workload"], tok, args.chars)
        for name, path in corpora.items():
            records = sum(1 for _ in path.open(encoding="utf-8"))
            raw = step(_RAW, path, args.tokenizer, src)
            ours = step(_RECONSTRUCT, path, args.tokenizer, src)
            cells = [name, f"{records}", f"{raw / 1e6:,.0f}M", f"{ours / 1e6:,.0f}M", f"{ours / raw:.3f}"]
            if args.baseline_src:
                base = step(_RECONSTRUCT, path, args.tokenizer, args.baseline_src)
                cells += [f"{base / 1e6:,.0f}M", f"{base / raw:.3f}", f"{ours / base:.3f}"]
            else:
                cells += ["", "", ""]
            lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
