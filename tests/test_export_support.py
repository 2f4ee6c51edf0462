"""Shared builders for the export / vocab / trainers / report tests (no tests here).

Exchange records are made deterministically and reconstructed with the real
``reconstruct_record`` on the real Kimi tokenizer, so the rows are exactly the
contract's reconstructed format.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tokenbridge.reconstruct import reconstruct_record

WORDS = (  # noqa: SIM905 - the sample text reads as text
    "the model thinks about prime numbers and 42 apples; naïve café 東京 ünïcödé "
    "def f(x): return x * 2 — tokens, bytes & markers? yes: 3.14159 [ok] {json} 🙂"
).split()

TOOL_CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_exchange(k: int, kind: str = "ok", choices: int = 1, seed: int = 0) -> dict[str, Any]:
    """Exchange ``k``; ``kind``: ok, tool, length (flagged), no_usage (flagged), bad_usage (rejected)."""
    rng = random.Random(seed * 100_003 + k)
    messages = [{"role": "user", "content": f"Question {k}: " + _text(rng, 3, 30)}]
    if k % 3 == 0:
        messages.insert(0, {"role": "system", "content": "You are terse. " + _text(rng, 1, 5)})
    chs = []
    for c in range(choices):
        content = _text(rng, 1, 40)
        finish = "stop"
        if kind == "tool":
            content, finish = "Let me check. " + TOOL_CALL, "tool_calls"
        elif kind == "length":
            finish = "length"
        chs.append({"index": c, "finish_reason": finish,
                    "message": {"role": "assistant", "reasoning": _text(rng, 2, 60), "content": content}})
    provider = ("Alpha", "Beta")[k % 2]
    dataset = ("b3", "chat")[(k // 2) % 2]
    return {
        "id": f"{dataset}-{k:06d}", "dataset": dataset,
        "request": {"model": "moonshotai/kimi-k2.5", "messages": messages},
        "response": {"id": f"gen-{k}", "model": "moonshotai/kimi-k2.5", "provider": provider, "choices": chs},
        "meta": {"provider": provider, "latency_s": 0.5 + (k % 7) * 0.25, "cost": 0.0001 * (1 + k % 5),
                 "attempts": 1 + (k % 4 == 0), "started_at": 1_700_000_000 + 3 * k,
                 "finished_at": 1_700_000_000 + 3 * k + 1.5},
    }


def reconstruct(exchange: dict[str, Any], tok, kind: str = "ok") -> list[dict[str, Any]]:
    """Rows for an exchange, with ``usage`` set to match (or not) as ``kind`` asks."""
    rows = reconstruct_record(exchange, tok)
    if kind == "no_usage":
        return rows
    prompt = len(rows[0]["prompt_ids"])
    completion = sum(len(r["completion_ids"]) for r in rows)
    if kind == "bad_usage":
        completion += 3
    exchange["response"]["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion, "cost": exchange["meta"]["cost"]}
    return reconstruct_record(exchange, tok)


KINDS = ("ok", "ok", "tool", "ok", "length", "ok", "no_usage", "ok", "bad_usage", "ok")


def make_run(tok, n: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(exchanges, reconstructed rows) for ``n`` exchanges of mixed kinds; exchange 5 has 2 choices."""
    exchanges, rows = [], []
    for k in range(n):
        kind = KINDS[k % len(KINDS)]
        ex = make_exchange(k, kind, choices=2 if k % 10 == 5 else 1, seed=seed)
        rows.extend(reconstruct(ex, tok, kind))
        exchanges.append(ex)
    return exchanges, rows


def write_jsonl(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
