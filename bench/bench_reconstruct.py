"""Reconstruction throughput against the raw tokenizer, in one run on the same text.

Measures, on the same >=10M characters of exchange records:
  1. raw tiktoken encode, single thread (the limit a re-tokenizer could reach),
  2. ``tokenbridge reconstruct`` end to end (JSONL in -> gated JSONL out, all cores),
  3. the transformers fast-tokenizer path a re-tokenizing tool would use
     (the tiktoken ranks converted by transformers' TikTokenConverter),
and reconstruct's peak memory at two input sizes (flat means streaming works).

Text: what ships with the interpreter (standard-library sources for code, the Python
reference topics for English prose), plus CJK sentences built from the tokenizer's own
Han tokens.

    python bench/bench_reconstruct.py [--chars 10000000] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "kimi-k2.5"


def _corpus_sources() -> tuple[list[str], list[str]]:
    """Code: the standard library's own modules. Prose: the Python reference topics
    (``pydoc_data``). Both ship with the interpreter, so the corpus is the same on every
    machine with this Python."""
    from pydoc_data.topics import topics

    stdlib = sysconfig.get_paths()["stdlib"]
    code = [open(p, encoding="utf-8", errors="replace").read() for p in sorted(glob.glob(f"{stdlib}/*.py"))]
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


def _texts(path: Path, tok) -> list[str]:
    from tokenbridge.chat import resolve_dialect

    dialect = resolve_dialect(tok)
    texts = []
    for line in path.open(encoding="utf-8"):
        rec = json.loads(line)
        msg = rec["response"]["choices"][0]["message"]
        parts = dialect.completion_parts(msg, "stop", True)
        texts.append(dialect.render_prompt(rec["request"]["messages"]) + "".join(t for _, t in parts))
    return texts


def bench_raw_tiktoken(texts: list[str], tokenizer_dir: Path) -> tuple[float, list[list[int]]]:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from tokenbridge.tokenizer import KIMI_PAT_STR, load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    enc = tiktoken.Encoding(
        "raw", pat_str=KIMI_PAT_STR, mergeable_ranks=load_tiktoken_bpe(str(tokenizer_dir / "tiktoken.model")),
        special_tokens={t: i for i, t in tok.marker_ids.items()},
    )
    t0 = time.perf_counter()
    ids = [enc.encode(t, allowed_special="all") for t in texts]
    return time.perf_counter() - t0, ids


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


def bench_reconstruct(src: Path, tokenizer_dir: Path, workers: int) -> dict:
    """Run reconstruct in a fresh process; report wall time (tokenizer load apart: a
    fixed ~0.3 s per process) and peak RSS (main + workers)."""
    code = (
        "import json, resource, sys, time\n"
        "from tokenbridge.reconstruct import reconstruct_file\n"
        "from tokenbridge.tokenizer import load_tokenizer\n"
        "t = time.perf_counter()\n"
        f"tok = load_tokenizer({str(tokenizer_dir)!r})\n"
        "load = time.perf_counter() - t\n"
        "t = time.perf_counter()\n"
        f"s = reconstruct_file({str(src)!r}, {str(src) + '.out.jsonl'!r}, tok, workers={workers})\n"
        "dt = time.perf_counter() - t\n"
        "main = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "print(json.dumps({'seconds': dt, 'load_s': load, 'rss_main_mb': main / 1024, 'rss_worker_mb': kids / 1024, 'summary': s.to_dict()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=10_000_000)
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()

    from tokenbridge.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        small, big = Path(tmp) / "half.jsonl", Path(tmp) / "full.jsonl"
        chars = build_exchanges(big, tok, args.chars)
        half_chars = build_exchanges(small, tok, args.chars // 2, seed=1)
        texts = _texts(big, tok)
        assert sum(map(len, texts)) == chars

        raw_s, raw_ids = bench_raw_tiktoken(texts, args.tokenizer)
        rec = bench_reconstruct(big, args.tokenizer, args.workers)
        rec_half = bench_reconstruct(small, args.tokenizer, args.workers)
        hf = bench_transformers(texts, args.tokenizer)

        # reconstruct's ids must be the raw encoder's ids, sample for sample
        ours = [json.loads(line)["input_ids"] for line in open(str(big) + ".out.jsonl", encoding="utf-8")]
        same = sum(a == b for a, b in zip(ours, raw_ids))

    n_tokens = sum(map(len, raw_ids))
    lines = [
        f"corpus: {len(texts)} records, {chars:,} characters, {n_tokens:,} tokens (half-size run: {half_chars:,} chars)",
        f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}",
        "",
        "| path | seconds | M chars/s | ratio vs raw tiktoken (1 thread) |",
        "|---|---:|---:|---:|",
        f"| raw tiktoken encode, 1 thread | {raw_s:.2f} | {chars / raw_s / 1e6:.2f} | 1.00 |",
        f"| tokenbridge reconstruct end to end, {args.workers} workers | {rec['seconds']:.2f} | "
        f"{chars / rec['seconds'] / 1e6:.2f} | {raw_s / rec['seconds']:.2f} |",
    ]
    if hf:
        hf_s, hf_ids = hf
        agree = sum(a == b for a, b in zip(hf_ids, raw_ids))
        lines.append(f"| transformers fast tokenizer (TikTokenConverter), 1 thread | {hf_s:.2f} | "
                     f"{chars / hf_s / 1e6:.2f} | {raw_s / hf_s:.2f} |")
    lines += [
        "",
        f"tokenizer load (once per process, not in the timings above): {rec['load_s']:.2f} s",
        f"reconstruct ids equal raw tiktoken ids: {same}/{len(texts)} samples; "
        f"status {rec['summary']['status']}, codes {rec['summary']['codes']}",
    ]
    if hf:
        lines.append(f"transformers fast-tokenizer ids equal raw tiktoken ids: {agree}/{len(texts)} samples")
    lines.append(
        f"peak RSS, reconstruct: main {rec_half['rss_main_mb']:.0f} MB / worker {rec_half['rss_worker_mb']:.0f} MB at "
        f"{half_chars:,} chars; main {rec['rss_main_mb']:.0f} MB / worker {rec['rss_worker_mb']:.0f} MB at {chars:,} chars"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
