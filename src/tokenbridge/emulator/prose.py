"""Text the synthetic model writes: reasoning and answers that look like a chat model's.

The goal is realistic *token statistics* for draft training and for the gate, not meaning:
English prose, Markdown lists and headings, fenced code in several languages, numbers and
arithmetic, CJK text, and the odd symbol. Everything is composed from small banks with a
seeded ``random.Random``, so the same seed gives the same text.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["Topic", "read_topic", "write_reasoning", "write_answer", "write_tool_preamble", "write_after_tool"]

_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]{3,}")
_STOP = frozenset(
    "about above after again also because been before being between could does doing down during each from "  # noqa: SIM905 - a word list reads as text
    "further have having here into just like more most much only other over same should some such than that "
    "their them then there these they this those through under until very what when where which while whom "
    "will with would your please explain tell give write want need make know help thanks thank using".split()
)
_CODE_HINTS = ("code", "python", "function", "script", "implement", "program", "bug", "error", "regex", "sql",
               "javascript", "bash", "class", "api", "```", "compile", "debug", "parse")
_NUM_HINTS = ("how many", "calculate", "compute", "sum", "average", "percent", "total", "estimate", "math", "cost")
_LIST_HINTS = ("steps", "list", "ways", "tips", "compare", "options", "pros", "cons", "ideas", "plan", "how do", "how to")


@dataclass(frozen=True)
class Topic:
    """What the last user turn is about, as far as the writer cares."""

    phrase: str
    words: tuple[str, ...]
    cjk: bool
    code: bool
    numeric: bool
    listy: bool


def read_topic(user_text: str) -> Topic:
    """Pick a topic phrase and style hints out of the user's text."""
    low = user_text.lower()
    cjk_chars = _CJK.findall(user_text)
    words = tuple(w.lower() for w in _WORD.findall(user_text) if w.lower() not in _STOP)[:6]
    if words:
        phrase = " ".join(words[:3])
    elif cjk_chars:
        phrase = "".join(cjk_chars[:8])
    else:
        phrase = "the question"
    return Topic(
        phrase=phrase,
        words=words or ("topic",),
        cjk=len(cjk_chars) >= 2,
        code=any(h in low for h in _CODE_HINTS),
        numeric=any(h in low for h in _NUM_HINTS) or bool(re.search(r"\d", user_text)),
        listy=any(h in low for h in _LIST_HINTS),
    )


# --- banks -----------------------------------------------------------------------------

_ASPECTS = [
    "the edge cases", "the overall cost", "how the parts interact", "the order of operations", "memory use",
    "what the user actually needs", "the simplest correct approach", "the failure modes", "the units involved",
    "backwards compatibility", "the worst-case input", "readability", "the assumptions hidden in the question",
    "how this scales", "the boundary conditions", "whether the data is sorted", "rounding", "time zones",
    "concurrency", "the empty case",
]
_NOUNS = [
    "cache", "buffer", "request", "record", "index", "table", "schedule", "budget", "signal", "sample", "batch",
    "queue", "window", "matrix", "pipeline", "network", "parser", "token", "report", "model", "dataset", "sensor",
]
_ADJ = ["small", "stable", "careful", "robust", "quick", "clear", "simple", "precise", "lazy", "strict", "safe"]
_VERBS = ["check", "compare", "measure", "split", "merge", "count", "sort", "filter", "validate", "estimate"]
_OPENERS = [
    "The user is asking about {t}.",
    "Okay, so the question is about {t}.",
    "Let me think about {t} step by step.",
    "I need to work out {t} carefully.",
    "This is a question about {t}; let me break it down.",
]
_CJK_OPENERS = ["用户想了解{t}。", "这个问题是关于{t}的，我来一步步分析。", "好的，先理清{t}的要点。"]
_THOUGHTS = [
    "First, I should consider {a}.",
    "One subtlety here is {a}.",
    "Hmm, I also need to keep {a} in mind.",
    "Wait, that ignores {a}. Let me re-check.",
    "Actually, {a} matters more than it first seems.",
    "A {j} way to handle this is to {v} the {n} first.",
    "If I {v} each {n} separately, the result stays {j}.",
    "So the plan is: {v} the {n}, then {v2} the {n2}.",
    "The user probably wants something {j} rather than exhaustive.",
    "Let me double-check the reasoning about {a}.",
]
_CJK_SENTENCES = [
    "首先，我们需要明确问题的范围。", "这个方法在大多数情况下都很有效。", "需要注意边界条件和异常输入。",
    "从结果来看，第二种方案更加稳定。", "我们可以把数据分成几个小批次来处理。", "这样做的好处是逻辑清晰，容易维护。",
    "如果输入为空，函数应该直接返回。", "整体的时间复杂度是线性的。", "最后，再检查一遍单位是否一致。",
    "用户可能更关心实际的使用效果。", "我们先看一个简单的例子。", "这一点在并发场景下尤其重要。",
    "总结一下，关键在于保持简单。", "下面给出具体的步骤。", "これは簡単な例です。", "結果を確認してください。",
]
_SYMBOLS = ["→", "≈", "±", "°C", "×", "≤", "≥", "—", "…", "✓", "µs", "€"]
_LANGS = ["python", "javascript", "bash", "sql", "rust"]


def _fill(rng: random.Random, template: str, topic: Topic) -> str:
    return template.format(
        t=topic.phrase,
        a=rng.choice(_ASPECTS),
        n=rng.choice(_NOUNS),
        n2=rng.choice(_NOUNS),
        j=rng.choice(_ADJ),
        v=rng.choice(_VERBS),
        v2=rng.choice(_VERBS),
    )


@lru_cache(maxsize=1)
def _thought_pool() -> tuple[str, ...]:
    """Pre-filled thought sentences: one pick per sentence keeps per-request CPU low."""
    rng = random.Random(0)
    blank = Topic("", ("",), False, False, False, False)
    return tuple(dict.fromkeys(_fill(rng, rng.choice(_THOUGHTS), blank) for _ in range(6000)))


def _thought(rng: random.Random) -> str:
    pool = _thought_pool()
    return pool[int(rng.random() * len(pool))]


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    kind = rng.randrange(4)
    if kind == 0:
        return f"{a} × {b} = {a * b}, so the total is {a * b:,}."
    if kind == 1:
        return f"{a} + {b} = {a + b}, and {a + b} / {b} ≈ {(a + b) / b:.2f}."
    if kind == 2:
        pct = rng.randint(1, 99)
        return f"{pct}% of {a * 10} is {a * 10 * pct / 100:g}."
    return f"Between {a} and {a + b * 7} there are {b * 7 - 1} integers strictly inside."


def _identifier(rng: random.Random, topic: Topic) -> str:
    word = re.sub(r"[^a-z]", "", rng.choice(topic.words)) or "value"
    return f"{rng.choice(_VERBS)}_{word}"


def _code_block(rng: random.Random, topic: Topic) -> str:
    lang = rng.choice(_LANGS)
    fn = _identifier(rng, topic)
    k, m = rng.randint(2, 9), rng.randint(2, 12)
    nums = ", ".join(str(rng.randint(0, 99)) for _ in range(rng.randint(3, 7)))
    if lang == "python":
        body = (
            f"def {fn}(values: list[int], step: int = {k}) -> int:\n"
            f'    """Sum the values divisible by ``step``."""\n'
            f"    total = 0\n"
            f"    for value in values:\n"
            f"        if value % step == 0:\n"
            f"            total += value * {m}\n"
            f"    return total\n\n\n"
            f"print({fn}([{nums}]))"
        )
    elif lang == "javascript":
        camel = re.sub(r"_(\w)", lambda mt: mt.group(1).upper(), fn)
        body = (
            f"function {camel}(items) {{\n"
            f"  return items\n"
            f"    .filter((x) => x > {k})\n"
            f"    .map((x) => x * {m});\n"
            f"}}\n\n"
            f"console.log({camel}([{nums}]));"
        )
    elif lang == "bash":
        body = (
            f"#!/usr/bin/env bash\nset -euo pipefail\n"
            f"for f in ./data/*.csv; do\n"
            f'  echo "$f: $(wc -l < "$f") lines"\n'
            f"done | sort -t: -k2 -n | tail -n {k}"
        )
    elif lang == "sql":
        col = rng.choice(_NOUNS)
        body = (
            f"SELECT {col}_id, COUNT(*) AS n, AVG(amount) AS mean_amount\n"
            f"FROM {rng.choice(_NOUNS)}s\n"
            f"WHERE amount > {k * 10}\n"
            f"GROUP BY {col}_id\n"
            f"ORDER BY n DESC\n"
            f"LIMIT {m};"
        )
    else:
        body = (
            f"fn {fn}(values: &[i64]) -> i64 {{\n"
            f"    values.iter().filter(|v| *v % {k} == 0).map(|v| v * {m}).sum()\n"
            f"}}\n\n"
            f"fn main() {{\n"
            f'    println!("{{}}", {fn}(&[{nums}]));\n'
            f"}}"
        )
    return f"```{lang}\n{body}\n```"


def _list_block(rng: random.Random, topic: Topic) -> str:
    numbered = rng.random() < 0.5
    items = []
    for i in range(rng.randint(3, 7)):
        text = _thought(rng).rstrip(".")
        lead = f"{i + 1}." if numbered else "-"
        bold = f"**{rng.choice(_VERBS).capitalize()} the {rng.choice(_NOUNS)}**: " if rng.random() < 0.4 else ""
        items.append(f"{lead} {bold}{text[0].upper()}{text[1:]}.")
    return "\n".join(items)


def _table_block(rng: random.Random) -> str:
    rows = ["| item | count | share |", "|---|---:|---:|"]
    counts = [rng.randint(1, 500) for _ in range(rng.randint(3, 5))]
    total = sum(counts)
    for c in counts:
        rows.append(f"| {rng.choice(_NOUNS)} | {c} | {100 * c / total:.1f}% |")
    return "\n".join(rows)


def _paragraph(rng: random.Random, topic: Topic, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        r = rng.random()
        if topic.numeric and r < 0.25:
            out.append(_arithmetic(rng))
        elif topic.cjk and r < 0.55:
            out.append("".join(rng.choice(_CJK_SENTENCES) for _ in range(rng.randint(1, 3))))
        else:
            s = _thought(rng)
            if rng.random() < 0.08:
                s = s[:-1] + f" {rng.choice(_SYMBOLS)} {rng.randint(1, 99)}."
            out.append(s)
    return " ".join(out)


# --- writers ---------------------------------------------------------------------------


def _opener(rng: random.Random, topic: Topic) -> str:
    return _fill(rng, rng.choice(_CJK_OPENERS if topic.cjk and rng.random() < 0.7 else _OPENERS), topic)


def write_reasoning(rng: random.Random, topic: Topic, budget_chars: int) -> str:
    """A thinking trace of roughly ``budget_chars`` characters."""
    parts = [_opener(rng, topic)]
    size = len(parts[0])
    while size < budget_chars:
        r = rng.random()
        if r < 0.12 and topic.numeric:
            block = _arithmetic(rng)
        elif r < 0.18 and topic.code:
            block = "Something like `" + _identifier(rng, topic) + "(values)` should be enough."
        else:
            block = _paragraph(rng, topic, rng.randint(2, 5))
        parts.append(block)
        size += len(block) + 2
    text = "\n\n".join(parts)
    return text + ("\n" if rng.random() < 0.5 else "")


def write_answer(rng: random.Random, topic: Topic, budget_chars: int) -> str:
    """An answer of roughly ``budget_chars`` characters, in Markdown."""
    parts = [_paragraph(rng, topic, rng.randint(1, 3))]
    size = len(parts[0])
    while size < budget_chars:
        r = rng.random()
        if r < (0.35 if topic.code else 0.08):
            block = _code_block(rng, topic)
        elif r < 0.45 or (topic.listy and r < 0.6):
            block = _list_block(rng, topic)
        elif r < 0.52:
            block = f"## {rng.choice(_VERBS).capitalize()} the {rng.choice(_NOUNS)}"
        elif r < 0.58 and topic.numeric:
            block = _table_block(rng)
        elif r < 0.62:
            block = "".join(rng.choice(_CJK_SENTENCES) for _ in range(rng.randint(2, 5)))
        else:
            block = _paragraph(rng, topic, rng.randint(2, 6))
        parts.append(block)
        size += len(block) + 2
    text = "\n\n".join(parts)
    return ("\n\n" if rng.random() < 0.5 else "") + text


def write_tool_preamble(rng: random.Random, topic: Topic, names: list[str]) -> tuple[str, str]:
    """(reasoning, short content before the tool call) for a turn that calls ``names``."""
    listed = ", ".join(f"`{n}`" for n in names)
    reasoning = (
        f"{_opener(rng, topic)} I can't answer this reliably from memory. "
        f"The available tool {listed} fits, so I'll call it with the relevant arguments and then "
        f"{rng.choice(_VERBS)} the result."
    )
    content = "" if rng.random() < 0.5 else f"Let me look that up with {names[0]}."
    return reasoning, content


def write_after_tool(rng: random.Random, topic: Topic, result: str, budget_chars: int) -> tuple[str, str]:
    """(reasoning, answer) for the turn after a tool result."""
    quote = " ".join(result.split())[:80] or "nothing"
    reasoning = (
        f"The tool returned: {quote}. Now I need to {rng.choice(_VERBS)} that against what the user asked "
        f"about {topic.phrase}. " + _paragraph(rng, topic, rng.randint(1, 3))
    )
    answer = f"Based on the result ({quote}), here is what I found.\n\n" + write_answer(rng, topic, budget_chars)
    return reasoning, answer
