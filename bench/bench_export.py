"""The stages after reconstruct against reconstruct itself, per stage and as one pass.

Builds N exchange records shaped like the real workload (Kimi K2.5 thinking answers of
~3,770 completion tokens: ~2,600 of reasoning, ~1,170 of content; the prompt a question
with, every third record, a system prompt), reconstructs them (timed), then times what
comes after on the same ``reconstructed.jsonl``:

* ``before``: the per-stage path of another source tree (default: ``main``, extracted with
  ``git archive`` into a temp folder): ``export_file`` for each of the four formats,
  ``build_vocab`` and ``build_report``, each in its own process (so each stage's peak RSS
  is its own), each reading the file again;
* ``after``: this tree's one pass (``run_pass`` with the four exports and the vocabulary,
  the report's ``RowStats`` fed from it, then ``build_report(rows=...)``), in one process;
  and, for the per-stage RSS, this tree's standalone speculators export.

Rounds are interleaved (reconstruct, before, after, reconstruct, ...); medians and ranges
are printed, and every post-reconstruct time as a ratio to the same round's reconstruct.
The speculators export's disk is sampled every 20 ms during the export (peak bytes under
its parent folder / final size).

A second, small run (``--small`` records, the head of the same file) in every round gives
each path's fixed cost (start-up work, imports, the report's figures); the ratios are also
given extrapolated to ``--at`` rows (default 40,000) on the line through the two sizes.

    python bench/bench_export.py [--records 3000] [--small 100] [--rounds 3] [--before-ref main] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_reconstruct import _cjk_sentences, _corpus_sources, machine  # the same corpus

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "kimi-k2.5"
FORMATS = ("specforge", "speculators", "parquet", "conversations")
DRAFT_VOCAB = 32000


def build_exchanges(path: Path, tok, n: int, seed: int = 0) -> dict:
    """``n`` exchange records with exact usage (so the rows are ``ok``); returns token totals."""
    from tokenbridge.chat import resolve_dialect

    rng = random.Random(seed)
    code, prose = _corpus_sources()
    prose_text = " ".join(" ".join(p.split()) for p in prose)
    code_text = "\n".join(code)
    cjk = _cjk_sentences(tok, rng, 2000)
    dialect = resolve_dialect(tok)
    completion_total = prompt_total = 0
    with path.open("w", encoding="utf-8") as fh:
        for k in range(n):
            a = rng.randrange(len(prose_text) - 20_000)
            question = prose_text[a: a + rng.randint(300, 1500)]
            reasoning = prose_text[a + 2000: a + 2000 + rng.randint(9_000, 12_000)]
            if rng.random() < 0.2:
                reasoning += "".join(rng.choice(cjk) for _ in range(rng.randint(5, 30)))
            b = rng.randrange(len(code_text) - 8_000)
            content = "Here is the code:\n\n```python\n" + code_text[b: b + rng.randint(3_000, 4_500)] + "\n```\n"
            msgs = [{"role": "user", "content": question}]
            if k % 3 == 0:
                msgs.insert(0, {"role": "system", "content": "You are a careful assistant. Answer with code."})
            prompt = dialect.render_prompt(msgs)
            parts = dialect.completion_parts({"reasoning": reasoning, "content": content}, "stop", True)
            n_completion = sum(1 if kind in ("think_end", "end") else len(tok.encode(t)) for kind, t in parts)
            n_prompt = len(tok.encode(prompt))
            completion_total += n_completion
            prompt_total += n_prompt
            provider = ("alpha/fp8", "beta/int4", "gamma/fp8")[k % 3]
            record = {
                "id": f"bench-{k:06d}", "dataset": ("b3", "b4")[k % 2],
                "request": {"model": "moonshotai/kimi-k2.5", "messages": msgs},
                "response": {
                    "id": f"gen-{k}", "provider": provider, "model": "moonshotai/kimi-k2.5",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "reasoning": reasoning, "content": content}}],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion},
                },
                "meta": {"provider": provider, "latency_s": 30.0 + k % 17, "cost": 0.01,
                         "started_at": 1_700_000_000 + k, "finished_at": 1_700_000_030 + k},
            }
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    return {"records": n, "completion_tokens": completion_total, "prompt_tokens": prompt_total}


# Each snippet runs in a fresh process with PYTHONPATH set to the tree under test and
# prints one JSON line: its wall time (imports and tokenizer load excluded) and peak RSS.
_PRELUDE = """
import json, os, resource, sys, threading, time
from pathlib import Path
args = json.loads(sys.argv[1])
def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
def _cpu(who=resource.RUSAGE_SELF):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime
def _du(folder):
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total
class DiskPeak(threading.Thread):
    def __init__(self, folder):
        super().__init__(daemon=True); self.folder, self.peak, self.stop = folder, 0, False
    def run(self):
        while not self.stop:
            self.peak = max(self.peak, _du(self.folder)); time.sleep(0.02)
"""

_RECONSTRUCT = _PRELUDE + """
from tokenbridge.reconstruct import reconstruct_file
from tokenbridge.tokenizer import load_tokenizer
tok = load_tokenizer(args["tokenizer"])
t, c = time.perf_counter(), _cpu() + _cpu(resource.RUSAGE_CHILDREN)
s = reconstruct_file(args["src"], args["dst"], tok)
dt, cpu = time.perf_counter() - t, _cpu() + _cpu(resource.RUSAGE_CHILDREN) - c
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps({"seconds": dt, "cpu_s": cpu, "rss_mb": _rss_mb(), "rss_worker_mb": kids, "status": s.to_dict()["status"]}))
"""

_STAGE = _PRELUDE + """
import tokenbridge.export, tokenbridge.report  # imports outside the timing, as in a long run
from tokenbridge.export import build_vocab, export_file
from tokenbridge.report import build_report
src, out, stage = Path(args["src"]), Path(args["out"]), args["stage"]
disk = None
t, c = time.perf_counter(), _cpu()
if stage == "vocab":
    build_vocab(src, args["draft"], out / "vocab", args["vocab_size"])
elif stage == "report":
    build_report(out)
else:
    (out / "export").mkdir(parents=True, exist_ok=True)
    disk = DiskPeak(out / "export"); disk.start()
    export_file(src, out / "export" / stage, stage)
    disk.stop = True; disk.join()
dt = time.perf_counter() - t
res = {"seconds": dt, "cpu_s": _cpu() - c, "rss_mb": _rss_mb()}
if disk is not None:
    res.update(disk_peak=disk.peak, disk_final=_du(out / "export" / stage))
print(json.dumps(res))
"""

_ONE_PASS = _PRELUDE + """
import tokenbridge.export, tokenbridge.report
from tokenbridge.export import ExportJob, VocabJob, run_pass
from tokenbridge.report import RowStats, build_report
src, out = Path(args["src"]), Path(args["out"])
t, c = time.perf_counter(), _cpu()
stats = RowStats()
jobs = [ExportJob(fmt, out / "export" / fmt) for fmt in args["formats"]]
res = run_pass(src, exports=jobs, vocab=VocabJob(args["draft"], out / "vocab", args["vocab_size"]), stats=stats)
build_report(out, rows=stats)
dt, cpu = time.perf_counter() - t, _cpu() - c
print(json.dumps({"seconds": dt, "cpu_s": cpu, "rss_mb": _rss_mb(), "rows": [e.rows_exported for e in res.exports]}))
"""


def _run(code: str, tree: Path, **args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(args, default=str)], capture_output=True, text=True,
                         env=env)
    if out.returncode:
        raise SystemExit(f"bench step failed ({tree}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _tree_of(ref: str, into: Path) -> Path:
    """``ref``'s ``src`` folder, extracted with ``git archive`` (the checkout is not touched)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def _fresh(run_dir: Path, data: Path) -> None:
    """A run folder holding only exchanges.jsonl and reconstructed.jsonl (hard links)."""
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    for name in ("exchanges.jsonl", "reconstructed.jsonl"):
        os.link(data / name, run_dir / name)


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _round(data: Path, tmp: Path, before_tree: Path, after_tree: Path, tokenizer: Path, common: dict) -> dict:
    """reconstruct, then before (per stage), then after (one pass), on ``data``."""
    rec = _run(_RECONSTRUCT, after_tree, tokenizer=str(tokenizer), src=str(data / "exchanges.jsonl"),
               dst=str(data / "reconstructed.jsonl"))
    row: dict = {"reconstruct": rec, "before": {}, "after_stage": {}}
    for stage in (*FORMATS, "vocab", "report"):
        run_dir = tmp / "before-run"
        _fresh(run_dir, data)
        row["before"][stage] = _run(_STAGE, before_tree, src=str(run_dir / "reconstructed.jsonl"),
                                    out=str(run_dir), stage=stage, **common)
    run_dir = tmp / "after-run"
    _fresh(run_dir, data)
    row["after"] = _run(_ONE_PASS, after_tree, src=str(run_dir / "reconstructed.jsonl"), out=str(run_dir),
                        formats=list(FORMATS), **common)
    _fresh(run_dir, data)
    row["after_stage"]["speculators"] = _run(_STAGE, after_tree, src=str(run_dir / "reconstructed.jsonl"),
                                             out=str(run_dir), stage="speculators", **common)
    row["before_total"] = sum(s["seconds"] for s in row["before"].values())
    row["before_cpu"] = sum(s["cpu_s"] for s in row["before"].values())
    return row


def _at(n: float, small: tuple[int, float], big: tuple[int, float]) -> float:
    """Seconds at ``n`` rows on the line through (rows, seconds) at two sizes: a fixed cost
    (process start-up work, imports, the report's figures) plus a cost per row."""
    (n0, t0), (n1, t1) = small, big
    per_row = (t1 - t0) / (n1 - n0)
    return t0 + (n - n0) * per_row


def main() -> None:  # noqa: PLR0915 - a benchmark's script: one measured step after another
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--small", type=int, default=100, help="records of the small run that gives the fixed costs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before-ref", default="main", help="git ref whose per-stage path is 'before'")
    ap.add_argument("--data", type=Path, help="folder to keep the built records in (reused when present)")
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--at", type=int, default=40_000, help="rows to extrapolate the ratios to")
    args = ap.parse_args()
    after_tree = ROOT / "src"
    sys.path.insert(0, str(after_tree))
    from tokenbridge.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = args.data or tmp / "data"
        data.mkdir(parents=True, exist_ok=True)
        exchanges = data / "exchanges.jsonl"
        meta_path = data / "meta.json"
        if not meta_path.exists() or json.loads(meta_path.read_text()).get("records") != args.records:
            meta = build_exchanges(exchanges, tok, args.records)
            meta_path.write_text(json.dumps(meta))
        meta = json.loads(meta_path.read_text())
        small = tmp / "small"
        small.mkdir()
        with exchanges.open("rb") as fh, (small / "exchanges.jsonl").open("wb") as out:
            for _, line in zip(range(args.small), fh):
                out.write(line)
        before_tree = _tree_of(args.before_ref, tmp / "before")
        common = {"draft": DRAFT_VOCAB, "vocab_size": tok.vocab_size}
        rounds: list[dict] = []
        smalls: list[dict] = []
        for r in range(args.rounds):
            smalls.append(_round(small, tmp, before_tree, after_tree, args.tokenizer, common))
            rounds.append(_round(data, tmp, before_tree, after_tree, args.tokenizer, common))
            row = rounds[-1]
            print(f"round {r + 1}: reconstruct {row['reconstruct']['seconds']:.1f} s, before {row['before_total']:.1f} s, "
                  f"after {row['after']['seconds']:.1f} s", file=sys.stderr)
        size = (data / "reconstructed.jsonl").stat().st_size

    recon = [r["reconstruct"]["seconds"] for r in rounds]
    before = [r["before_total"] for r in rounds]
    after = [r["after"]["seconds"] for r in rounds]
    lines = [
        f"data: {meta['records']} records, {meta['completion_tokens'] / meta['records']:.0f} completion + "
        f"{meta['prompt_tokens'] / meta['records']:.0f} prompt tokens each; reconstructed.jsonl {size / 1e6:.0f} MB "
        f"({size / meta['records'] / 1e3:.1f} KB a row); status {rounds[-1]['reconstruct']['status']}",
        f"machine: {machine()}; {args.rounds} interleaved rounds, "
        "median (min-max)",
        "",
        "| step | seconds | x reconstruct (same round) | peak RSS MB |",
        "|---|---:|---:|---:|",
        f"| reconstruct ({os.cpu_count()} workers) | {_med(recon)} | 1.00 | "
        f"{rounds[-1]['reconstruct']['rss_mb']:.0f} main + {rounds[-1]['reconstruct']['rss_worker_mb']:.0f} worker |",
    ]
    for stage in (*FORMATS, "vocab", "report"):
        secs = [r["before"][stage]["seconds"] for r in rounds]
        ratio = [s / c for s, c in zip(secs, recon)]
        name = f"export {stage}" if stage in FORMATS else stage
        lines.append(f"| before ({args.before_ref}): {name} | {_med(secs)} | {_med(ratio)} | "
                     f"{max(r['before'][stage]['rss_mb'] for r in rounds):.0f} |")
    lines.append(f"| **before: all six stages** | {_med(before)} | {_med([b / c for b, c in zip(before, recon)])} | |")
    lines.append(f"| **after: one pass (4 exports + vocab + report)** | {_med(after)} | "
                 f"{_med([a / c for a, c in zip(after, recon)])} | {max(r['after']['rss_mb'] for r in rounds):.0f} |")
    spec_after = [r["after_stage"]["speculators"] for r in rounds]
    lines.append(f"| after: export speculators alone | {_med([s['seconds'] for s in spec_after])} | "
                 f"{_med([s['seconds'] / c for s, c in zip(spec_after, recon)])} | {max(s['rss_mb'] for s in spec_after):.0f} |")
    lines.append("")
    lines.append(f"after / before, post-reconstruct wall: {_med([a / b for a, b in zip(after, before)])}")
    # fixed cost + cost per row, from the small and the full run of the same round
    n0, n1 = args.small, meta["records"]

    def line_at(key):
        return [_at(args.at, (n0, key(s)), (n1, key(b))) for s, b in zip(smalls, rounds)]

    rec_at = line_at(lambda r: r["reconstruct"]["seconds"])
    before_at = line_at(lambda r: r["before_total"])
    after_at = line_at(lambda r: r["after"]["seconds"])
    fixed = [(s["reconstruct"]["seconds"], s["before_total"], s["after"]["seconds"]) for s in smalls]
    lines.append(f"fixed costs (the {n0}-record run): reconstruct {_med([f[0] for f in fixed])} s, before "
                 f"{_med([f[1] for f in fixed])} s, after {_med([f[2] for f in fixed])} s")
    lines.append(f"extrapolated to {args.at:,} rows (fixed + per row, per round): before "
                 f"{_med([b / c for b, c in zip(before_at, rec_at)])}x reconstruct, after "
                 f"{_med([a / c for a, c in zip(after_at, rec_at)])}x")
    # CPU seconds hold up under a loaded machine: on 2 idle cores reconstruct's wall is at best its CPU / 2
    # (2 workers), the one pass's is its CPU (one process), so these are the idle-machine ratios' lower bound
    # for reconstruct's speed, i.e. the one pass's ratio is at most this
    workers = os.cpu_count() or 1
    cpu_rec = [r["reconstruct"]["cpu_s"] / workers for r in rounds]
    lines.append(f"CPU seconds: reconstruct {_med([r['reconstruct']['cpu_s'] for r in rounds])}, before "
                 f"{_med([r['before_cpu'] for r in rounds])}, after {_med([r['after']['cpu_s'] for r in rounds])}; "
                 f"on {workers} idle cores (reconstruct = its CPU / {workers}): before "
                 f"{_med([r['before_cpu'] / c for r, c in zip(rounds, cpu_rec)])}x, after "
                 f"{_med([r['after']['cpu_s'] / c for r, c in zip(rounds, cpu_rec)])}x")
    cpu_at = [(_at(args.at, (n0, s["reconstruct"]["cpu_s"] / workers), (n1, b["reconstruct"]["cpu_s"] / workers)),
               _at(args.at, (n0, s["after"]["cpu_s"]), (n1, b["after"]["cpu_s"]))) for s, b in zip(smalls, rounds)]
    lines.append(f"same, extrapolated to {args.at:,} rows: after {_med([a / r for r, a in cpu_at])}x")
    for label, runs in (("before", [r["before"]["speculators"] for r in rounds]), ("after", spec_after)):
        peak = max(s["disk_peak"] / s["disk_final"] for s in runs)
        lines.append(f"speculators disk during export, {label}: peak {max(s['disk_peak'] for s in runs) / 1e6:.0f} MB, "
                     f"final {runs[-1]['disk_final'] / 1e6:.0f} MB, peak/final {peak:.2f}")
    rss = [(s["before"]["speculators"]["rss_mb"], s["after_stage"]["speculators"]["rss_mb"], s["after"]["rss_mb"])
           for s in smalls]
    lines.append(f"peak RSS at {n0} records: before speculators {max(x[0] for x in rss):.0f} MB, after speculators "
                 f"{max(x[1] for x in rss):.0f} MB, after one pass {max(x[2] for x in rss):.0f} MB")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
