"""Reconstruction throughput per model family against that family's raw tokenizer, in one run.

For each tokenizer folder in ../shared/tokenizers (Kimi K2.5, Qwen3, DeepSeek V3.1 / V3.2,
GLM-4.5, gpt-oss), on the same kind of exchange records (bench_reconstruct.py's corpus: prose
questions, prose + CJK reasoning, code answers, thinking mode):

  1. raw encode of each sample's full text (prompt + completion), single thread, with the
     family's own encoder (tiktoken for Kimi; for gpt-oss tiktoken's own ``o200k_harmony``
     built from the folder's ``o200k_base.tiktoken``, OpenAI's hash checked; ``tokenizers``
     for the other tokenizer.json folders);
  2. ``reconstruct_file`` end to end (parse, render with the family's dialect, encode every
     part, the whole gate, write), all cores;

and checks reconstruct's ids equal the raw encoder's ids sample for sample. Rounds
interleave the families so machine noise spreads over all of them.

    python bench/bench_families.py [--chars 3000000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_reconstruct import _corpus_sources, bench_reconstruct, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "tokenizers"
FAMILIES = ["kimi-k2.5", "qwen3", "deepseek-v3.1", "deepseek-v3.2", "glm-4.5", "gpt-oss"]
#: Thinking mode for every family (DeepSeek thinks only when asked).
REQUEST_EXTRA = {"reasoning": {"enabled": True}}


def _cjk_sentences(tok, rng: random.Random, n: int) -> list[str]:
    """Sentences of the tokenizer's own Han tokens (any vocabulary layout)."""
    han = []
    for i in range(tok.vocab_size):
        if i in tok.marker_ids:
            continue
        s = tok.decode([i])
        if s and all("\u4e00" <= ch <= "\u9fff" for ch in s):
            han.append(s)
    return ["".join(rng.choice(han) + (rng.choice("，、") if rng.random() < 0.15 else "") for _ in range(rng.randint(8, 30))) + "。"
            for _ in range(n)]


def build(path: Path, tok, target_chars: int, seed: int = 0) -> tuple[list[str], int]:
    """Exchange records with exact usage, and each sample's full text."""
    from tokenbridge.chat import resolve_dialect

    rng = random.Random(seed)
    code, prose = _corpus_sources()
    cjk = _cjk_sentences(tok, rng, 2000)
    dialect = resolve_dialect(tok)
    created = int(time.time())  # gpt-oss's prompt prints the serving day: the records say when they ran
    texts, total, k = [], 0, 0
    with path.open("w", encoding="utf-8") as fh:
        while total < target_chars:
            src = rng.choice(prose)
            a = rng.randrange(max(1, len(src) - 1500))
            msgs = [{"role": "user", "content": src[a: a + rng.randint(200, 1500)]}]
            reasoning = " ".join(rng.choice(prose)[: rng.randint(800, 6000)].split("\n"))
            if rng.random() < 0.3:
                reasoning += "".join(rng.choice(cjk) for _ in range(rng.randint(3, 20)))
            body = rng.choice(code)
            b = rng.randrange(max(1, len(body) - 4000))
            content = "Here is the code:\n\n```python\n" + body[b: b + rng.randint(500, 6000)] + "\n```\n"
            request = {"messages": msgs, **REQUEST_EXTRA}
            prompt = dialect.prompt_readings(request, {"created": created}, {})[0].text
            opens = bool(dialect.think_open) and prompt.endswith(dialect.think_open)
            parts = dialect.completion_parts({"reasoning": reasoning, "content": content}, "stop", True, opens)
            completion = "".join(t for _, t in parts)
            record = {"id": f"bench-{k}", "dataset": "bench", "request": request, "response": {
                "id": f"gen-{k}", "provider": "bench", "created": created, "choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "reasoning": reasoning, "content": content}}],
                "usage": {"prompt_tokens": len(tok.encode(prompt)), "completion_tokens": len(tok.encode(completion))}}}
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            texts.append(prompt + completion)
            total += len(prompt) + len(completion)
            k += 1
    return texts, total


def raw_encoder(folder: Path):
    """The family's own encoder, outside tokenbridge."""
    if (folder / "tiktoken.model").is_file():
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        from tokenbridge.tokenizer import KIMI_PAT_STR, load_tokenizer

        tok = load_tokenizer(folder)
        enc = tiktoken.Encoding("raw", pat_str=KIMI_PAT_STR, mergeable_ranks=load_tiktoken_bpe(str(folder / "tiktoken.model")),
                                special_tokens={t: i for i, t in tok.marker_ids.items()})
        return "tiktoken", lambda t: enc.encode(t, allowed_special="all")
    if (folder / "o200k_base.tiktoken").is_file():
        from unittest import mock

        import tiktoken
        from tiktoken import load
        from tiktoken_ext import openai_public

        def local(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
            return load.load_tiktoken_bpe(str(folder / "o200k_base.tiktoken"), expected_hash=expected_hash)

        with mock.patch.object(openai_public, "load_tiktoken_bpe", local):  # the folder's file, not the network
            harmony = tiktoken.Encoding(**openai_public.o200k_harmony())
        return "tiktoken o200k_harmony", lambda t: harmony.encode(t, allowed_special="all")
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return "tokenizers", lambda t: hf.encode(t, add_special_tokens=False).ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=3_000_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from tokenbridge.tokenizer import load_tokenizer

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpora = {}
        for name in FAMILIES:
            folder = SHARED / name
            src = Path(tmp) / f"{name}.jsonl"
            texts, chars = build(src, load_tokenizer(folder), args.chars)
            corpora[name] = (folder, src, texts, chars)
            results[name] = {"raw": [], "rec": [], "chars": chars, "records": len(texts)}
        for _ in range(args.rounds):
            for name, (folder, src, texts, _chars) in corpora.items():
                kind, encode = raw_encoder(folder)
                t0 = time.perf_counter()
                raw_ids = [encode(t) for t in texts]
                results[name]["raw"].append(time.perf_counter() - t0)
                rec = bench_reconstruct(src, folder, args.workers)
                results[name]["rec"].append(rec["seconds"])
                ours = [json.loads(line)["input_ids"]
                        for line in Path(str(src) + ".out.jsonl").read_text(encoding="utf-8").splitlines()]
                results[name].update(kind=kind, same=sum(a == b for a, b in zip(ours, raw_ids)),
                                     status=rec["summary"]["status"], codes=rec["summary"]["codes"],
                                     tokens=sum(map(len, raw_ids)))

    print(f"machine: {machine()}; {args.rounds} interleaved rounds, "
          f"{args.workers} reconstruct workers; median (range) of the per-round ratios")
    print()
    print("| family | raw encoder | records | M chars | tokens | raw encode M chars/s | reconstruct M chars/s | "
          "reconstruct / raw encode | ids equal raw | status |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, r in results.items():
        ratios = [raw / rec for raw, rec in zip(r["raw"], r["rec"])]
        mc = r["chars"] / 1e6
        print(f"| {name} | {r['kind']} | {r['records']} | {mc:.1f} | {r['tokens']:,} | {mc / statistics.median(r['raw']):.2f} | "
              f"{mc / statistics.median(r['rec']):.2f} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{r['same']}/{r['records']} | {r['status']} {r['codes'] or ''} |")


if __name__ == "__main__":
    main()
