"""Scale: the whole pipeline (``tokenbridge run``) against the built-in emulator, then a rerun.

For each size, a fresh run folder and one config: N prompts, one clean emulator provider
with workload-shaped completions (``min_tokens``..``max_tokens`` log-uniform, about 3,770
tokens on average by default), every export format, the draft vocabulary and the report.
Each run is a child process that calls ``run_pipeline`` and records, per stage, the wall
time (from one stage's last line to the next's), the peak RSS of the process and its
workers (sampled from /proc every 50 ms), and at the end the disk use of each output.
Then the same command again (the rerun of a finished run): its time as a ratio of the
first run's post-generation time (everything after generate), and how many bytes it read
to digest files (target: none).

    python bench/bench_scale.py                       # 5,000 and 10,000 prompts
    python bench/bench_scale.py --prompts 300         # a quick look
    python bench/bench_scale.py --with-40k            # adds 40,000 (~25 GB of disk; long)
    python bench/bench_scale.py --write-results       # update bench/RESULTS.md "## Scale"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "kimi-k2.5"
DISTINCT_PROMPTS = 512
FORMATS = ("specforge", "speculators", "parquet", "conversations")


# --- the child: one `tokenbridge run`, instrumented ----------------------------------------


def _tree_rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` and its descendants (shared pages counted once per process)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return total


def _stage_of(line: str) -> str | None:
    """The stage whose last line this is (None for other lines)."""
    if line.startswith("generate: built-in emulator") or line.startswith("reconstruct: warning"):
        return None
    for fmt in FORMATS:
        if line.startswith(f"export {fmt}: "):
            return f"export:{fmt}"
    for stage in ("generate", "reconstruct", "vocab", "report"):
        if line.startswith(f"{stage}: "):
            return stage
    return None


def _child(config: Path, result: Path) -> None:
    from tokenbridge import digests
    from tokenbridge.generate import run as generate_run
    from tokenbridge.pipeline import load_run_config, run_pipeline

    hashed = {"bytes": 0, "files": 0}
    real_read = digests.read_digest

    def counting_read(path):
        d = real_read(path)
        hashed["bytes"] += d.file.size
        hashed["files"] += 1
        return d

    digests.read_digest = counting_read  # the pipeline's digest cache
    generate_run.read_digest = counting_read  # generate's check of exchanges.jsonl

    peak = {"kib": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak["kib"] = max(peak["kib"], _tree_rss_kib(os.getpid()))

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.monotonic()
    stages: list[dict] = []
    last = 0.0

    def echo(line: str) -> None:
        nonlocal last
        stage = _stage_of(line)
        if stage is None:
            return
        now = time.monotonic() - t0
        peak["kib"] = max(peak["kib"], _tree_rss_kib(os.getpid()))
        stages.append({"stage": stage, "s": now - last, "peak_rss_mib": peak["kib"] / 1024, "line": line[:200]})
        peak["kib"], last = 0, now

    results = run_pipeline(load_run_config(config), echo=echo)
    total = time.monotonic() - t0
    stages.append({"stage": "settle", "s": total - last, "peak_rss_mib": max(peak["kib"], _tree_rss_kib(os.getpid())) / 1024})
    stop.set()
    result.write_text(json.dumps({"total_s": total, "stages": stages, "hashed": hashed,
                                  "statuses": {r.name: r.status for r in results}}), encoding="utf-8")


# --- the parent -----------------------------------------------------------------------------


def _mean_completion(rows: list[dict]) -> float:
    return sum(r["completion_tokens"] for r in rows) / max(1, sum(r["done"] for r in rows))


def _write_inputs(folder: Path, n: int, min_tokens: int, max_tokens: int, concurrency: int, tokenizer: Path) -> Path:
    prompts = folder / "prompts.jsonl"
    with prompts.open("w", encoding="utf-8") as fh:
        for i in range(n):
            topic = i % DISTINCT_PROMPTS
            fh.write(json.dumps({"id": f"p{i}", "messages": [
                {"role": "user", "content": f"Question {topic}: explain, step by step and at length, how "
                                            f"topic number {topic} works."}]}) + "\n")
    emulator = folder / "emulator.toml"
    emulator.write_text(
        f'seed = 0\nlatency_ms = 0\nmin_tokens = {min_tokens}\nmax_tokens = {max_tokens}\n'
        'models = ["moonshotai/kimi-k2.5"]\n\n[[providers]]\nname = "clean/fp8"\nquantization = "fp8"\n'
        "latency_ms = 0\ntokens_per_s = 0\n", encoding="utf-8")
    config = folder / "run.toml"
    config.write_text(
        f'[run]\nout = "out"\ntokenizer = "{tokenizer}"\n\n[emulator]\nconfig = "{emulator}"\n\n'
        f'[generate]\nmodel = "moonshotai/kimi-k2.5"\nconcurrency = {concurrency}\nmax_tokens = {max_tokens + 1024}\n'
        'progress = "none"\nextra_body = { return_token_ids = true }\n'
        f'datasets = [ {{ name = "bench", path = "{prompts}" }} ]\n\n'
        f'[export]\nformats = {json.dumps(list(FORMATS))}\n\n[vocab]\ndraft_vocab_size = 32000\n',
        encoding="utf-8")
    return config


def _one_run(config: Path, label: str) -> dict:
    result = config.parent / f"{label}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, __file__, "--child", str(config), str(result)], check=True, env=env,
                   cwd=config.parent)
    return json.loads(result.read_text(encoding="utf-8"))


def _disk_mib(out: Path) -> dict[str, float]:
    def size(p: Path) -> int:
        if p.is_file():
            return p.stat().st_size
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

    parts = {"state.sqlite": sum(size(p) for p in out.glob("state.sqlite*")),
             "exchanges.jsonl": size(out / "exchanges.jsonl"), "reconstructed.jsonl": size(out / "reconstructed.jsonl")}
    parts.update({f"export/{fmt}": size(out / "export" / fmt) for fmt in FORMATS if (out / "export" / fmt).exists()})
    parts.update({"vocab": size(out / "vocab"), "report": size(out / "report")})
    parts["total"] = size(out)
    return {k: v / 2**20 for k, v in parts.items()}


def _completion_tokens(out: Path) -> tuple[int, int]:
    summary = json.loads((out / "generate.json").read_text(encoding="utf-8"))
    return summary["completion_tokens"], summary["done"]


def bench_size(n: int, args: argparse.Namespace, workdir: Path) -> dict:
    folder = workdir / f"scale-{n}"
    folder.mkdir(parents=True)
    config = _write_inputs(folder, n, args.min_tokens, args.max_tokens, args.concurrency, args.tokenizer)
    first = _one_run(config, "first")
    out = folder / "out"
    tokens, done = _completion_tokens(out)
    disk = _disk_mib(out)
    rerun = _one_run(config, "rerun")
    row = {"prompts": n, "done": done, "completion_tokens": tokens, "first": first, "rerun": rerun, "disk_mib": disk}
    post = sum(s["s"] for s in first["stages"] if s["stage"] != "generate")
    row["post_generation_s"] = post
    row["rerun_ratio"] = rerun["total_s"] / post
    print(json.dumps({k: v for k, v in row.items() if k not in ("first", "rerun")}, indent=1), flush=True)
    print("first:", [(s["stage"], round(s["s"], 2), round(s["peak_rss_mib"])) for s in first["stages"]],
          first["hashed"], flush=True)
    print("rerun:", [(s["stage"], round(s["s"], 2)) for s in rerun["stages"]], rerun["hashed"], rerun["statuses"],
          flush=True)
    if not args.keep:
        shutil.rmtree(folder)
    return row


def _table(rows: list[dict], args: argparse.Namespace) -> str:
    names = ["generate", "reconstruct", *(f"export:{f}" for f in FORMATS), "vocab", "report", "settle"]
    lines = [
        f"`python bench/bench_scale.py{' --with-40k' if 40000 in args.prompts else ''}` on {os.cpu_count()} CPU cores "
        f"(CPython {platform.python_version()}), {time.strftime('%Y-%m-%d')}: `tokenbridge run` (in a child process) on "
        f"the built-in emulator, one clean provider, completions {args.min_tokens}..{args.max_tokens} tokens "
        f"log-uniform (the emulator's lengths are approximate: {_mean_completion(rows):,.0f} tokens per completion "
        "measured), concurrency "
        f"{args.concurrency}, every export format, a {32000}-token draft vocabulary, the report. Then the same "
        "command again. Stage times are wall seconds from one stage's last line to the next's (generate includes the "
        "tokenizer load and the emulator's start; \"settle\" is the run's last step, which re-reads the outputs "
        "digested while still fresh, see `tokenbridge.digests`). Peak RSS: the process and its workers, sampled.",
        "",
        "| prompts | completion tokens | " + " | ".join(names) + " | post-generation s | peak RSS MiB | disk MiB |",
        "| ---: | ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: |",
    ]
    for r in rows:
        by = {s["stage"]: s for s in r["first"]["stages"]}
        peak = max(s["peak_rss_mib"] for s in r["first"]["stages"])
        lines.append(f"| {r['prompts']:,} | {r['completion_tokens']:,} | "
                     + " | ".join(f"{by[n]['s']:.1f}" if n in by else "-" for n in names)
                     + f" | {r['post_generation_s']:.1f} | {peak:,.0f} | {r['disk_mib']['total']:,.0f} |")
    lines += ["", "Rerun of the finished run (nothing new to send):", "",
              "| prompts | rerun s | of which generate s | rerun / first post-generation | bytes read to digest | "
              "stages skipped |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        by = {s["stage"]: s for s in r["rerun"]["stages"]}
        skipped = sum(v == "skipped" for v in r["rerun"]["statuses"].values())
        lines.append(f"| {r['prompts']:,} | {r['rerun']['total_s']:.2f} | {by['generate']['s']:.2f} | "
                     f"{r['rerun_ratio']:.4f} | {r['rerun']['hashed']['bytes']:,} | "
                     f"{skipped} of {len(r['rerun']['statuses']) - 1} |")
    lines += ["", "Disk use after the first run (MiB):", "",
              "| prompts | " + " | ".join(k for k in rows[0]["disk_mib"]) + " |",
              "| ---: | " + " | ".join("---:" for _ in rows[0]["disk_mib"]) + " |"]
    for r in rows:
        lines.append(f"| {r['prompts']:,} | " + " | ".join(f"{v:,.1f}" for v in r["disk_mib"].values()) + " |")
    return "\n".join(lines) + "\n"


def _write_results(text: str) -> None:
    body = RESULTS.read_text(encoding="utf-8")
    section = "## Scale\n\n" + text
    start = body.find("## Scale\n")
    if start < 0:
        body = body.rstrip("\n") + "\n\n" + section
    else:
        end = body.find("\n## ", start + 1)
        body = body[:start] + section + (body[end + 1:] if end >= 0 else "")
    RESULTS.write_text(body, encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, nargs="+", default=[5000, 10000])
    ap.add_argument("--with-40k", action="store_true", help="also 40,000 prompts")
    ap.add_argument("--min-tokens", type=int, default=1650)
    ap.add_argument("--max-tokens", type=int, default=6200)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    ap.add_argument("--workdir", type=Path, default=None, help="where run folders go (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if args.child:
        _child(Path(args.child[0]), Path(args.child[1]))
        return
    if args.with_40k and 40000 not in args.prompts:
        args.prompts.append(40000)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tb-scale-"))
    rows = [bench_size(n, args, workdir) for n in args.prompts]
    text = _table(rows, args)
    print(text)
    if args.write_results:
        _write_results(text)


if __name__ == "__main__":
    main()
