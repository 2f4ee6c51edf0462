"""Reconstruction throughput against the raw tokenizer, in one run on the same text.

Two corpora of >=10M characters each: ``bench`` (one-turn exchanges, prose questions,
mixed prose/CJK reasoning and code answers) and ``workload`` (the production shape: long
reasoning completions of ~3,770 tokens, multi-turn conversations sharing a few system
prompts and their earlier turns). For each, in interleaved rounds:
  1. raw tiktoken encode of each sample's whole text, single thread (the limit a
     re-tokenizer could reach), wall and CPU seconds; and the same texts split over two
     forked processes (the 2-core limit as this machine gives it);
  2. ``tokenbridge reconstruct`` end to end (JSONL in -> gated JSONL out) on all cores
     and on one, wall seconds and the CPU seconds of main process and workers;
then once: the ids check, what ``input_ids``/``loss_mask`` cost, the transformers
fast-tokenizer path (TikTokenConverter), and peak memory at two input sizes (flat means
streaming works).

Text: what ships with the interpreter (standard-library sources for code, the Python
reference topics for English prose), plus CJK sentences built from the tokenizer's own
Han tokens; generated deterministically, nothing downloaded.

    python bench/bench_reconstruct.py [--chars 10000000] [--rounds 3] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "kimi-k2.5"


def machine() -> str:
    """Cores, CPU model and Python: ratios against raw move with the CPU (raw is Rust,
    the rest of reconstruct Python), so a figure is only comparable on the same model."""
    model = "CPU model unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({model}), Python {sys.version.split()[0]}"


def _corpus_sources() -> tuple[list[str], list[str]]:
    """Code: the standard library's own modules. Prose: the Python reference topics
    (``pydoc_data``). Both ship with the interpreter, so the corpus is the same on every
    machine with this Python."""
    from pydoc_data.topics import topics

    stdlib = sysconfig.get_paths()["stdlib"]
    code = [Path(p).read_text(encoding="utf-8", errors="replace") for p in sorted(glob.glob(f"{stdlib}/*.py"))]
    prose = [topics[k] for k in sorted(topics) if len(topics[k]) > 2000]
    return code, prose


def _cjk_sentences(tok, rng: random.Random, n: int) -> list[str]:
    han = []
    for i in range(tok.max_ordinary_id + 1):
        try:
            s = tok.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            continue
        if s and all("\u4e00" <= ch <= "\u9fff" for ch in s):
            han.append(s)
    out = []
    for _ in range(n):
        words = [rng.choice(han) for _ in range(rng.randint(8, 30))]
        out.append("".join(w + (rng.choice("，、") if rng.random() < 0.15 else "") for w in words) + "。")
    return out


def build_exchanges(path: Path, tok, target_chars: int, seed: int = 0) -> int:
    """Write exchange records totalling ``target_chars`` of prompt + completion text."""
    from tokenbridge.chat import resolve_dialect

    rng = random.Random(seed)
    code, prose = _corpus_sources()
    cjk = _cjk_sentences(tok, rng, 4000)
    dialect = resolve_dialect(tok)
    total = 0
    k = 0
    with path.open("w", encoding="utf-8") as fh:
        while total < target_chars:
            src = rng.choice(prose)
            a = rng.randrange(max(1, len(src) - 1500))
            question = src[a : a + rng.randint(200, 1500)]
            reasoning = " ".join(rng.choice(prose)[: rng.randint(800, 6000)].split("\n"))
            if rng.random() < 0.3:
                reasoning += "".join(rng.choice(cjk) for _ in range(rng.randint(3, 20)))
            body = rng.choice(code)
            b = rng.randrange(max(1, len(body) - 4000))
            content = "Here is the code:\n\n```python\n" + body[b : b + rng.randint(500, 6000)] + "\n```\n"
            msgs = [{"role": "user", "content": question}]
            prompt = dialect.render_prompt(msgs)
            parts = dialect.completion_parts({"reasoning": reasoning, "content": content}, "stop", True)
            n_completion = sum(1 if kind in ("think_end", "end") else len(tok.encode(t)) for kind, t in parts)
            record = {
                "id": f"bench-{k}",
                "dataset": "bench",
                "request": {"model": "moonshotai/kimi-k2.5", "messages": msgs},
                "response": {
                    "id": f"gen-{k}", "provider": "bench", "model": "moonshotai/kimi-k2.5",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "reasoning": reasoning, "content": content}}],
                    "usage": {"prompt_tokens": len(tok.encode(prompt)), "completion_tokens": n_completion},
                },
            }
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            total += len(prompt) + sum(len(t) for _, t in parts)
            k += 1
    return total


_TOOLS = [
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the reference documentation and return the best passages.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "What to look for"},
            "limit": {"type": "integer", "description": "How many passages (1-20)"}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "run_python", "description": "Run a Python snippet in a sandbox and return stdout and stderr.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "The program text"},
            "timeout_s": {"type": "number", "description": "Wall-clock limit in seconds"}}, "required": ["code"]}}},
]


def build_workload_exchanges(path: Path, tok, target_chars: int, seed: int = 0) -> dict:
    """The production shape: long reasoning completions (~3,770 tokens each on average),
    multi-turn conversations whose exchanges share one of a few system prompts (a third
    with tool declarations) and each earlier turn, several conversations interleaved.

    Returns what the corpus holds (records, characters, mean completion tokens)."""
    from tokenbridge.chat import resolve_dialect

    rng = random.Random(seed)
    code, prose = _corpus_sources()
    cjk = _cjk_sentences(tok, rng, 2000)
    dialect = resolve_dialect(tok)
    systems = []
    for i in range(12):
        src = rng.choice(prose)
        a = rng.randrange(max(1, len(src) - 6000))
        systems.append((f"You are assistant #{i}. Follow these guidelines.\n\n" + src[a : a + rng.randint(1500, 6000)],
                        _TOOLS if i % 3 == 0 else None))

    def completion() -> tuple[str, str]:
        want, reasoning = rng.randint(9000, 20600), ""
        while len(reasoning) < want:  # topics are shorter than a long reasoning: join several
            reasoning += " ".join(rng.choice(prose)[: want - len(reasoning)].split("\n")) + " "
        if rng.random() < 0.3:
            reasoning += "".join(rng.choice(cjk) for _ in range(rng.randint(5, 40)))
        body = rng.choice(code)
        b = rng.randrange(max(1, len(body) - 3000))
        content = "Here is the code:\n\n```python\n" + body[b : b + rng.randint(300, 3000)] + "\n```\n"
        return reasoning, content

    active: list[dict] = []
    total = k = n_completion = 0
    with path.open("w", encoding="utf-8") as fh:
        while total < target_chars:
            while len(active) < 8:
                system, tools = rng.choice(systems)
                active.append({"msgs": [{"role": "system", "content": system}], "tools": tools, "left": rng.randint(1, 6)})
            conv = rng.choice(active)
            src = rng.choice(prose)
            a = rng.randrange(max(1, len(src) - 1200))
            msgs = [*conv["msgs"], {"role": "user", "content": src[a : a + rng.randint(100, 1200)]}]
            reasoning, content = completion()
            request = {"model": "moonshotai/kimi-k2.5", "messages": msgs}
            if conv["tools"]:
                request["tools"] = conv["tools"]
            prompt = dialect.render_request(request)
            parts = dialect.completion_parts({"reasoning": reasoning, "content": content}, "stop", True)
            n = sum(1 if kind in ("think_end", "end") else len(tok.encode(t)) for kind, t in parts)
            record = {
                "id": f"work-{k}",
                "dataset": "workload",
                "request": request,
                "response": {
                    "id": f"gen-{k}", "provider": "bench", "model": "moonshotai/kimi-k2.5",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "reasoning": reasoning, "content": content}}],
                    "usage": {"prompt_tokens": len(tok.encode(prompt)), "completion_tokens": n},
                },
            }
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            total += len(prompt) + sum(len(t) for _, t in parts)
            n_completion += n
            k += 1
            conv["msgs"] = [*msgs, {"role": "assistant", "content": content}]
            conv["left"] -= 1
            if conv["left"] == 0:
                active.remove(conv)
    return {"records": k, "chars": total, "completion_tokens_mean": n_completion / max(k, 1)}


def _texts(path: Path, tok) -> list[str]:
    from tokenbridge.chat import resolve_dialect

    dialect = resolve_dialect(tok)
    texts = []
    for line in path.open(encoding="utf-8"):
        rec = json.loads(line)
        msg = rec["response"]["choices"][0]["message"]
        parts = dialect.completion_parts(msg, "stop", True)
        texts.append(dialect.render_request(rec["request"]) + "".join(t for _, t in parts))
    return texts


def _encode_calls(path: Path, tok) -> list[tuple[str, list[str]]]:
    """Per record, the texts reconstruct encodes: the rendered prompt and each completion part."""
    from tokenbridge.chat import resolve_dialect

    dialect = resolve_dialect(tok)
    calls = []
    for line in path.open(encoding="utf-8"):
        rec = json.loads(line)
        choice = rec["response"]["choices"][0]
        parts = dialect.completion_parts(choice["message"], choice.get("finish_reason"), dialect.thinking(rec["request"]))
        calls.append((dialect.render_request(rec["request"]), [t for kind, t in parts if kind not in ("think_start", "think_end", "end")]))
    return calls


def bench_encode_alone(calls: list[tuple[str, list[str]]], tok) -> float:
    """CPU seconds of reconstruct's own encoding and nothing else: each prompt through
    ``encode_prompt`` (its piece cache starting empty, as in a fresh process) and each
    completion part through ``encode``. What is left of reconstruct's CPU is the rest."""
    tok._prompt_cache.__init__(tok._prompt_cache.max_bytes)
    c = time.process_time()
    for prompt, parts in calls:
        tok.encode_prompt(prompt)
        for text in parts:
            tok.encode(text)
    return time.process_time() - c


def raw_encoder(tokenizer_dir: Path):
    """tiktoken built directly from the model files: the limit a re-tokenizer could reach."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from tokenbridge.tokenizer import KIMI_PAT_STR, load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    return tiktoken.Encoding(
        "raw", pat_str=KIMI_PAT_STR, mergeable_ranks=load_tiktoken_bpe(str(tokenizer_dir / "tiktoken.model")),
        special_tokens={t: i for i, t in tok.marker_ids.items()},
    )


def bench_raw_tiktoken(texts: list[str], enc) -> dict:
    """Raw encode of each sample's whole text, one thread: wall and CPU seconds. The ids
    are dropped as they come, as the two-process split and reconstruct (which writes
    them out) do: holding 9M of them as Python ints cost raw ~7% at 40M characters, which
    flattered every ratio against it and put the 2-core limit over 2 (2.13-2.18x)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for text in texts:
        enc.encode(text, allowed_special="all")
    return {"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0}


#: What a forked raw-encode worker encodes: (texts, encoder), set before the pool forks.
_RAW_SHARE: dict[str, object] = {}


def _raw_half(i: int) -> float:
    texts, enc = _RAW_SHARE["texts"], _RAW_SHARE["enc"]
    t0 = time.perf_counter()
    for text in texts[i::2]:  # type: ignore[index]
        enc.encode(text, allowed_special="all")  # type: ignore[attr-defined]
    return time.perf_counter() - t0


def bench_raw_two_processes(texts: list[str], enc) -> float:
    """The 2-core limit, measured: raw encode of the same texts split evenly over two
    forked processes (started and warmed before the clock starts; no I/O, no results
    sent back). Wall seconds. On a VM whose two vCPUs share a physical core or get
    stolen time this is well under 2x single-thread raw; reconstruct's share of it is
    what overlap and overhead cost, apart from what the machine cannot give."""
    import multiprocessing as mp

    _RAW_SHARE.update(texts=texts, enc=enc)
    with mp.get_context("fork").Pool(2) as pool:
        pool.map(_raw_half, [0, 1])  # warm: both forked and the encoder touched
        t0 = time.perf_counter()
        pool.map(_raw_half, [0, 1], chunksize=1)
        return time.perf_counter() - t0


def bench_transformers(texts: list[str], tokenizer_dir: Path) -> tuple[float, list[list[int]]] | None:
    try:
        from tokenizers import AddedToken
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        return None
    from tokenbridge.tokenizer import KIMI_PAT_STR, load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    backend = TikTokenConverter(vocab_file=str(tokenizer_dir / "tiktoken.model"), pattern=KIMI_PAT_STR).converted()
    backend.add_special_tokens([AddedToken(tok.marker_ids[i], special=True, normalized=False) for i in sorted(tok.marker_ids)])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend)
    t0 = time.perf_counter()
    ids = [fast.encode(t, add_special_tokens=False) for t in texts]
    return time.perf_counter() - t0, ids


def bench_reconstruct(src: Path, tokenizer_dir: Path, workers: int, code_dir: Path | None = None) -> dict:
    """Run reconstruct in a fresh process; report wall time (tokenizer load apart: a
    fixed ~0.3 s per process), CPU seconds of the main process and of the workers, and
    peak RSS (main + workers).

    The output is written fresh, as a first run writes it: the previous round's is removed
    first (untimed). Replacing an existing output adds the kernel's freeing of the old file
    to the final rename (14-16 ms for 75 MB here), which is not reconstruct's work."""
    log = f"{src}.busy.{workers}"
    Path(f"{src}.out.jsonl").unlink(missing_ok=True)
    code = (
        "import functools, json, os, resource, sys, time\n"
        "import tokenbridge.reconstruct as R\n"
        "from tokenbridge.reconstruct import reconstruct_file\n"
        "from tokenbridge.tokenizer import load_tokenizer\n"
        "# each chunk's wall span in its worker, to see how busy the workers were (idle cores only)\n"
        f"LOG = {log!r}\n"
        "_work = R._work\n"
        "@functools.wraps(_work)\n"
        "def timed(chunk):\n"
        "    t0 = time.perf_counter(); out = _work(chunk); t1 = time.perf_counter()\n"
        "    with open(LOG, 'a') as fh: fh.write(f'{os.getpid()} {t0} {t1}\\n')\n"
        "    return out\n"
        "R._work = timed\n"
        "open(LOG, 'w').close()\n"
        "def cpu(who):\n"
        "    r = resource.getrusage(who)\n"
        "    return r.ru_utime + r.ru_stime\n"
        "t = time.perf_counter()\n"
        f"tok = load_tokenizer({str(tokenizer_dir)!r})\n"
        "load = time.perf_counter() - t\n"
        "c_main, c_kids = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)\n"
        "t = time.perf_counter()\n"
        f"s = reconstruct_file({str(src)!r}, {str(src) + '.out.jsonl'!r}, tok, workers={workers})\n"
        "dt = time.perf_counter() - t\n"
        "spans = {}\n"
        "for line in open(LOG):\n"
        "    pid, a, b = line.split(); spans.setdefault(pid, []).append((float(a), float(b)))\n"
        "busy = sum(b - a for v in spans.values() for a, b in v) / (max(len(spans), 1) * dt)\n"
        "tail = (t + dt - min(max(b for _, b in v) for v in spans.values())) / dt if len(spans) > 1 else 0.0\n"
        "c_main, c_kids = cpu(resource.RUSAGE_SELF) - c_main, cpu(resource.RUSAGE_CHILDREN) - c_kids\n"
        "# VmHWM: ru_maxrss keeps the high-water mark of the forked bench process across exec\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')]\n"
        "main = int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "print(json.dumps({'seconds': dt, 'load_s': load, 'cpu_main': c_main, 'cpu_workers': c_kids, 'busy': busy,\n"
        "                  'tail': tail,\n"
        "                  'rss_main_mb': main / 1024, 'rss_worker_mb': kids / 1024, 'summary': s.to_dict()}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(code_dir)} if code_dir else None
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def derived_fields_cost(out_path: Path) -> dict:
    """What ``input_ids`` and ``loss_mask`` cost, measured on reconstruct's own output:
    their share of the file's bytes, and the CPU seconds they add to encoding the rows,
    spliced as reconstruct writes them (``rows.encode_lean_row``) and built and serialised
    as lists (what it did before); writing the bytes comes on top."""
    import orjson

    from tokenbridge.rows import DERIVED_COLUMNS, encode_lean_row

    rows = [orjson.loads(line) for line in out_path.open("rb")]
    total = sum(len(orjson.dumps(r)) + 1 for r in rows)
    lean = [{k: v for k, v in r.items() if k not in DERIVED_COLUMNS} for r in rows]
    derived = total - sum(len(orjson.dumps(r)) + 1 for r in lean)
    best = {"lists": float("inf"), "spliced": float("inf"), "none": float("inf")}
    for _ in range(3):
        c = time.process_time()
        for r in lean:
            p, q = r["prompt_ids"], r["completion_ids"]
            orjson.dumps({**r, "input_ids": [*p, *q], "loss_mask": [0] * len(p) + [1] * len(q)})
        best["lists"] = min(best["lists"], time.process_time() - c)
        c = time.process_time()
        for r in lean:
            encode_lean_row(r)
        best["spliced"] = min(best["spliced"], time.process_time() - c)
        c = time.process_time()
        for r in lean:
            orjson.dumps(r)
        best["none"] = min(best["none"], time.process_time() - c)
    return {"bytes": total, "derived_bytes": derived, "cpu_lists": best["lists"] - best["none"],
            "cpu_spliced": best["spliced"] - best["none"]}


def _median_range(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:  # noqa: PLR0915 - a benchmark's script: one measured step after another
    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=10_000_000, help="characters per corpus")
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (raw, then reconstruct, per corpus)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="another checkout's src/ to run reconstruct from too, in the same rounds (before/after)")
    args = ap.parse_args()

    from tokenbridge.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    enc = raw_encoder(args.tokenizer)
    loadavg = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        corpora: dict[str, dict] = {}
        big = Path(tmp) / "bench.jsonl"
        corpora["bench"] = {"path": big, "chars": build_exchanges(big, tok, args.chars)}
        work = Path(tmp) / "workload.jsonl"
        corpora["workload"] = {"path": work, **build_workload_exchanges(work, tok, args.chars)}
        small = Path(tmp) / "half.jsonl"
        half_chars = build_exchanges(small, tok, args.chars // 2, seed=1)
        for c in corpora.values():
            c["texts"] = _texts(c["path"], tok)
            c["calls"] = _encode_calls(c["path"], tok)
            assert sum(map(len, c["texts"])) == c["chars"]
            c["runs"] = []

        worker_counts = sorted({args.workers, 1}, reverse=True)
        for rnd in range(args.rounds):
            order = list(corpora) if rnd % 2 == 0 else list(reversed(corpora))
            for name in order:
                c = corpora[name]
                run = {"raw": bench_raw_tiktoken(c["texts"], enc), "raw2": bench_raw_two_processes(c["texts"], enc),
                       "encode_alone": bench_encode_alone(c["calls"], tok)}
                for w in worker_counts:
                    run[w] = bench_reconstruct(c["path"], args.tokenizer, w)
                    if args.baseline_src:
                        run[f"baseline {w}"] = bench_reconstruct(c["path"], args.tokenizer, w, args.baseline_src)
                c["runs"].append(run)
        rec_half = bench_reconstruct(small, args.tokenizer, args.workers)
        for c in corpora.values():
            c["raw_ids"] = [enc.encode(t, allowed_special="all") for t in c["texts"]]  # untimed
            # reconstruct's ids must be the raw encoder's ids, sample for sample
            out = Path(str(c["path"]) + ".out.jsonl")
            ours = [json.loads(line)["input_ids"] for line in out.open(encoding="utf-8")]
            c["same"] = sum(a == b for a, b in zip(ours, c["raw_ids"]))
            c["tokens"] = sum(map(len, c["raw_ids"]))
            c["derived"] = derived_fields_cost(out)
        hf = None if args.skip_transformers else bench_transformers(corpora["bench"]["texts"], args.tokenizer)
    loadavg_end = os.getloadavg()

    w = args.workers
    lines = [
        f"machine: {machine()}; load average "
        f"{loadavg[0]:.1f} at start, {loadavg_end[0]:.1f} at end; {args.rounds} interleaved rounds",
        "",
    ]
    for name, c in corpora.items():
        desc = f"{len(c['texts'])} records, {c['chars']:,} characters, {c['tokens']:,} tokens"
        if "completion_tokens_mean" in c:
            desc += f", {c['completion_tokens_mean']:,.0f} completion tokens a record"
        lines.append(f"corpus {name}: {desc}")
    lines += [
        "",
        "Medians (ranges) over the rounds; each ratio is against raw tiktoken in the same round.",
        "CPU efficiency = CPU seconds (main + workers) / wall seconds; raw's is its own process's.",
        "",
        "Workers busy = the share of the run's wall time the workers spent inside chunks (1.0: never waiting);",
        "tail = the share of the run after the first worker took its last chunk's result home (the other one idle).",
        "",
        "2-core limit = raw single-thread s / raw split over 2 forked processes s (same texts, same round);",
        "share of limit = reconstruct's ratio vs raw / the 2-core limit (1.0: as fast as raw on both cores).",
        "",
        "| corpus | raw s | raw CPU efficiency | 2-core limit | reconstruct, workers | s | ratio vs raw | share of limit "
        "| CPU efficiency | CPU s / raw CPU s | main-process CPU share | workers busy | tail |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = [k for wc in worker_counts for k in ([wc, f"baseline {wc}"] if args.baseline_src else [wc])]
    for name, c in corpora.items():
        raw_s = [r["raw"]["seconds"] for r in c["runs"]]
        raw_eff = [r["raw"]["cpu"] / r["raw"]["seconds"] for r in c["runs"]]
        for wc in keys:
            rec = [r[wc] for r in c["runs"]]
            cpu = [x["cpu_main"] + x["cpu_workers"] for x in rec]
            lines.append(
                f"| {name} | {_median_range(raw_s)} | {_median_range(raw_eff)} | "
                f"{_median_range([r['raw']['seconds'] / r['raw2'] for r in c['runs']])} | {wc} | "
                f"{_median_range([x['seconds'] for x in rec])} | "
                f"{_median_range([r['raw']['seconds'] / r[wc]['seconds'] for r in c['runs']])} | "
                f"{_median_range([r['raw2'] / r[wc]['seconds'] for r in c['runs']])} | "
                f"{_median_range([cp / x['seconds'] for cp, x in zip(cpu, rec)])} | "
                f"{_median_range([cp / r['raw']['cpu'] for cp, r in zip(cpu, c['runs'])])} | "
                f"{_median_range([x['cpu_main'] / cp for cp, x in zip(cpu, rec)], '{:.0%}')} | "
                f"{_median_range([x['busy'] for x in rec])} | {_median_range([x['tail'] for x in rec], '{:.0%}')} |"
            )
    lines.append("")
    for name, c in corpora.items():
        cpu_ratio = statistics.median(
            (r[w]["cpu_main"] + r[w]["cpu_workers"]) / r["raw"]["cpu"] for r in c["runs"]
        )
        d = c["derived"]
        rec_cpu = statistics.median(r[w]["cpu_main"] + r[w]["cpu_workers"] for r in c["runs"])
        alone = [r["encode_alone"] / r["raw"]["cpu"] for r in c["runs"]]
        one = [(r[1]["cpu_main"] + r[1]["cpu_workers"]) / r["raw"]["cpu"] for r in c["runs"]]
        summary = c["runs"][-1][w]["summary"]
        lines += [
            f"{name}: ids equal raw tiktoken ids: {c['same']}/{len(c['texts'])} samples; status {summary['status']}, "
            f"codes {summary['codes']}",
            f"{name}: {w} idle cores at these CPU seconds would give {w / cpu_ratio:.2f}x raw "
            f"(= {w} / CPU s per raw CPU s; an upper bound: perfect overlap, no wait on the main process)",
            f"{name}: the floor: reconstruct's own encode calls alone (prompt pieces cached, as in one process) cost "
            f"{_median_range(alone)} raw CPU s; one process's whole reconstruct {_median_range(one)}, so the rest "
            f"(parse, render, the gate, the rows) is {statistics.median(one) - statistics.median(alone):.2f}",
            f"{name}: input_ids + loss_mask are {d['derived_bytes'] / d['bytes']:.0%} of reconstructed.jsonl's bytes; "
            f"spliced (as written) they cost {d['cpu_spliced']:.3f} CPU s, {d['cpu_spliced'] / rec_cpu:.1%} of "
            f"reconstruct's CPU seconds; built and serialised as lists {d['cpu_lists']:.3f} CPU s "
            f"({d['cpu_lists'] / rec_cpu:.1%}); writing the bytes comes on top",
        ]
    first = corpora["bench"]["runs"][-1][w]
    lines += [
        "",
        f"tokenizer load (once per process, not in the timings above): {first['load_s']:.2f} s",
        f"peak RSS, reconstruct (bench corpus): main {rec_half['rss_main_mb']:.0f} MB / worker "
        f"{rec_half['rss_worker_mb']:.0f} MB at {half_chars:,} chars; main {first['rss_main_mb']:.0f} MB / worker "
        f"{first['rss_worker_mb']:.0f} MB at {corpora['bench']['chars']:,} chars",
    ]
    if hf:
        hf_s, hf_ids = hf
        raw_ids = corpora["bench"]["raw_ids"]
        agree = sum(a == b for a, b in zip(hf_ids, raw_ids))
        raw_s = corpora["bench"]["runs"][-1]["raw"]["seconds"]
        lines.append(
            f"transformers fast tokenizer (TikTokenConverter), 1 thread, bench corpus: {hf_s:.2f} s, "
            f"{raw_s / hf_s:.2f}x raw (last round's raw); ids equal raw: {agree}/{len(raw_ids)}"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
