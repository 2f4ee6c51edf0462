"""``--dry-run``: what a run would send and roughly cost, without sending anything.

Prompt tokens are counted as the serving side would see them: the request rendered by
the model's chat dialect (:mod:`tokenbridge.chat`, ``render_request``) and encoded by its
tokenizer; without a tokenizer, the rendered text's characters / 4. Completion cost is bounded above by ``max_tokens`` x n per sample; when the
run folder already holds responses, their mean completion length gives an expected figure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from ..exit_codes import ExitCode
from .budget import completion_cap, usd
from .prompts import SHOWN_BAD_ROWS, Sample, load_prompts
from .request import build_request
from .settings import ConfigError, GenerateSettings
from .store import STATE_FILE, Store

__all__ = ["DryRunReport", "dry_run"]


@dataclass
class DryRunReport:
    samples: int
    to_send: int  # not yet done in the run folder
    already_done: int
    bad_rows: list[str]
    per_dataset: dict[str, dict[str, int]]
    prompt_tokens: int  # of the samples still to send
    prompt_tokens_max: int
    completion_tokens_max: int  # max_tokens x n x to_send (None max_tokens: not bounded)
    cost_prompt: float | None
    cost_max: float | None
    cost_expected: float | None
    mean_completion_observed: float | None
    tokenizer: str | None
    approximate: bool = False  # True when no tokenizer was given (characters / 4)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def exit_code(self) -> int:
        """What ``generate --dry-run`` exits with: 1 when rows were refused, as the real run
        would (every command's exit 1 means bad rows), so a script can stop before paying."""
        return ExitCode.INCOMPLETE if self.bad_rows else ExitCode.OK

    def lines(self, listed_in: str | Path | None = None) -> list[str]:
        """What ``generate --dry-run`` prints: the first :data:`SHOWN_BAD_ROWS` bad rows, then
        how many more, and where all are listed (``listed_in``: the ``--summary-json`` file)."""
        out = [
            f"samples: {self.samples} ({self.already_done} already done, {self.to_send} to send), "
            f"bad rows: {len(self.bad_rows)}",
        ]
        for name, d in self.per_dataset.items():
            out.append(f"  {name}: {d['samples']} samples, {d['prompt_tokens']:,} prompt tokens to send")
        kind = "approx. " if self.approximate else ""
        out.append(f"prompt tokens to send: {kind}{self.prompt_tokens:,} (longest prompt {self.prompt_tokens_max:,})")
        if self.cost_prompt is not None:
            out.append(f"prompt cost: ${self.cost_prompt:,.2f}")
        if self.cost_expected is not None:
            out.append(
                f"expected cost: ${self.cost_expected:,.2f} (at the {self.mean_completion_observed:,.0f} "
                "completion tokens/sample seen so far)"
            )
        if self.cost_max is not None:
            out.append(f"worst case (every sample hits max_tokens): ${self.cost_max:,.2f}")
        out += [f"note: {n}" for n in self.notes]
        out += [f"bad row: {b}" for b in self.bad_rows[:SHOWN_BAD_ROWS]]
        if len(self.bad_rows) > SHOWN_BAD_ROWS:  # as the run says it, which lists them all in generate.json
            more = len(self.bad_rows) - SHOWN_BAD_ROWS
            out.append(f"... {more} more bad rows (all listed in {listed_in})" if listed_in is not None
                       else f"... {more} more bad rows (--summary-json FILE lists them all)")
        return out


def dry_run(settings: GenerateSettings, out_dir: str | Path | None = None, *, force_settings: bool = False) -> DryRunReport:
    """Load and render every prompt, count tokens, estimate cost. Sends nothing, writes
    nothing. Refuses what the run would refuse before sending (a renamed dataset; done
    samples made with other settings, unless ``force_settings``)."""
    from ..chat import RENDER_FAILURES
    from .run import (check_request_settings, check_sendable, folders_unread, gave_nothing, refuse_as_the_run,
                      sendable, tools_unsent)
    from .secrets import read_api_key

    check_sendable(settings)
    loaded = load_prompts(settings.datasets, default_limit=settings.limit)
    # the run leaves out a prompt that holds the key (it is only read here, and is not needed)
    key = read_api_key(settings.api_key_env, required=False)
    check_request_settings(settings, key)
    rows, bad = sendable(loaded, settings, key)
    done_ids: set[str] = set()
    run_ids = [s.id for s in loaded.samples]
    observed: float | None = None
    spent: list[str] = []
    state = Path(out_dir) / STATE_FILE if out_dir is not None else None
    if state is not None and state.is_file() and state.stat().st_size > 0:  # an empty one holds nothing done
        with Store.open_readonly(state.parent) as store:
            # what the run refuses before it sends (a renamed dataset: AlreadyAnswered), refused here alike
            # base URLs compare with the key masked, as they are stored
            run_ids = refuse_as_the_run(store, rows, settings, key,
                                        state.parent, force_settings=force_settings)
            done_ids = {sid for sid, status in store.statuses().items() if status == "done"}  # no request read
            p, c, _ = store.token_totals()
            if done_ids and c:
                observed = c / len(done_ids)
            spent = _spent_note(store.total_cost(), store.possible_cost(), settings.max_cost)
    count, approximate, notes = _counter(settings)
    notes += spent
    notes += gave_nothing(settings, loaded) + tools_unsent(settings, loaded) + folders_unread(settings)  # as the run warns
    per: dict[str, dict[str, int]] = {}
    total = longest = 0
    to_send = 0
    n_per = settings.request.n or 1
    render_errors: list[str] = []
    for s, sid in zip(loaded.samples, run_ids, strict=True):
        d = per.setdefault(s.dataset, {"samples": 0, "prompt_tokens": 0})
        d["samples"] += 1
        if sid in done_ids:  # the id the run uses: a folder's older one where it holds that
            continue
        request = build_request(s, settings.request)
        try:
            n = count(request)
        except RENDER_FAILURES as exc:  # a row the template cannot render is reported, not fatal
            render_errors.append(f"{s.source}: cannot render the prompt: {type(exc).__name__}: {exc}")
            continue
        d["prompt_tokens"] += n
        total += n
        longest = max(longest, n)
        to_send += 1
    # the caps every request carries (extra_body's max_completion_tokens too): the larger bounds the cost
    max_tokens = completion_cap(build_request(Sample("", "", []), settings.request))
    completion_max = (max_tokens or 0) * n_per * to_send
    prices = settings.prices
    cost_prompt = cost_max = cost_expected = None
    if prices is not None:
        cost_prompt = total * prices.prompt / 1e6
        if max_tokens:
            cost_max = cost_prompt + completion_max * prices.completion / 1e6
        else:
            notes.append("no max_tokens: the completion cost has no upper bound")
        if observed is not None:
            cost_expected = cost_prompt + observed * to_send * prices.completion / 1e6
    else:
        notes.append("no [prices] configured: token counts only (OpenRouter's usage.cost is used during the run)")
    return DryRunReport(
        samples=len(loaded.samples),
        to_send=to_send,
        already_done=len(loaded.samples) - to_send,
        bad_rows=bad + render_errors,
        per_dataset=per,
        prompt_tokens=total,
        prompt_tokens_max=longest,
        completion_tokens_max=completion_max,
        cost_prompt=cost_prompt,
        cost_max=cost_max,
        cost_expected=cost_expected,
        mean_completion_observed=observed,
        tokenizer=settings.tokenizer,
        approximate=approximate,
        notes=notes,
    )


def _spent_note(spent: float, possible: float, cap: float | None) -> list[str]:
    """What the folder has spent already, and whether its ``--max-cost`` leaves the run
    anything to send: the run counts the folder's spend against the cap, so a dry run that
    priced the rest without it promised a run that would stop at once."""
    if not spent and not possible:
        return []
    maybe = f" + {usd(possible)} possibly billed" if possible else ""
    line = f"this folder has spent {usd(spent)}{maybe} so far"
    if cap is None:
        return [line]
    left = (f"its cap {usd(cap)} is reached, so the run would send nothing" if spent + possible >= cap
            else f"{usd(cap - spent - possible)} of its cap {usd(cap)} is left")
    return [f"{line}, which counts against --max-cost: {left}"]


#: The family rendered when there is no tokenizer to recognise one from (the default model's).
_DEFAULT_DIALECT = "kimi-k2.5"


def _counter(settings: GenerateSettings) -> tuple[Callable[[dict[str, Any]], int], bool, list[str]]:
    """A function request -> prompt token count, and whether it is only approximate.

    Every request is rendered with the chat dialect, as the server renders it; with a
    tokenizer the rendered text is encoded exactly, without one its characters / 4
    stand in for tokens (the template's markers and the generation prompt still count).
    """
    from ..chat import DIALECTS, resolve_dialect

    if not settings.tokenizer:
        name = settings.dialect or _DEFAULT_DIALECT
        if name not in DIALECTS:
            raise ConfigError(f"unknown dialect {name!r}; known: {', '.join(sorted(DIALECTS))}")
        dialect = DIALECTS[name]
        note = f"no --tokenizer: prompt tokens are approximate (characters of the {name}-rendered prompt / 4)"
        return (lambda req: len(dialect.render_request(req)) // 4), True, [note]
    from ..tokenizer import load_tokenizer

    tok = load_tokenizer(settings.tokenizer)
    dialect = resolve_dialect(tok, settings.dialect)

    def count(req: dict[str, Any]) -> int:
        return len(tok.encode(dialect.render_request(req)))

    return count, False, []
