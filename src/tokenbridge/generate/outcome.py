"""One sentence saying what a generate invocation did, for people (``run`` prints it).

Why a sentence: a resumed run that sent nothing must read "216 already done", not a
dict of zeros that looks like a failure.
"""

from __future__ import annotations

from .run import RunSummary

__all__ = ["describe_run", "no_finish_line"]


def _n(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def describe_run(s: RunSummary) -> str:
    """E.g. ``216 samples: 200 already done, 16 done now; 16 requests, $0.0010 this run, $0.0123 in all.``"""
    parts = []
    if s.already_done:
        parts.append(f"{s.already_done} already done")
    if s.done or not s.already_done:
        parts.append(f"{s.done} done now")
    if s.failed:
        parts.append(f"{s.failed} failed")
    if s.pending:
        parts.append(f"{s.pending} not sent yet")
    if s.requests:
        money = f"{_n(s.requests, 'request')}, ${s.spent_run:.4f} this run, ${s.spent_total:.4f} in all"
    else:
        money = f"nothing sent, ${s.spent_total:.4f} spent in all"
    text = f"{_n(s.samples, 'sample')}: {', '.join(parts)}; {money}"
    if s.bad_rows:
        text += f"; {_n(len(s.bad_rows), 'bad prompt row')} skipped"
    if s.no_finish:
        text += f"; {_n(s.no_finish, 'prompt')} got answers without finish_reason ({_n(s.no_finish_attempts, 'billed attempt')})"
    if s.stop_reason:
        text += f"; stopped ({s.stop_reason})"
    return text + "."


def no_finish_line(s: RunSummary) -> str:
    """What became of the answers that came without finish_reason (``s.no_finish`` > 0): a
    provider that never sends one is paid ``max_attempts`` times a prompt, so the count,
    the money and where the bodies are, plainly."""
    failed = f"; {s.no_finish_failed} of those prompts failed, never answered with one" if s.no_finish_failed else ""
    return (f"{_n(s.no_finish, 'prompt')} got answers without finish_reason: {_n(s.no_finish_attempts, 'attempt')}, "
            f"paid for (${s.no_finish_cost:.4f} reported) and sent again up to max_attempts{failed} (e.g. {', '.join(s.no_finish_examples[:3])}); "
            "the answers are kept in the attempt rows of state.sqlite, not in exchanges.jsonl")
