"""Spend: what a response cost, and whether one more request still fits the budget.

A response's cost is ``usage.cost`` (OpenRouter returns it with ``usage: {include:
true}``; for a bring-your-own-key answer, ``is_byok: true``, plus
``cost_details.upstream_inference_cost``, which the user's provider account paid: see
:func:`~.body.checked_usage`), else usage tokens x the configured price table, else unknown.

:class:`Budget` admits a request only if ``spent + possible + reserved + worst <= max_cost``.
``worst`` is the request's worst case: ``P`` prompt tokens (:func:`estimate_prompt_tokens`,
an upper bound: UTF-8 bytes of the request) and ``C = max_tokens x n`` completion tokens
(a request without ``max_tokens`` is assumed to stop at 32,768: then nothing is a bound).

Pricing the worst case
  * With ``[prices]``: ``P x prompt + C x completion``.
  * Without: learned from responses, per provider, with no assumption but fixed,
    non-negative per-token prices (a, b). Each response i says ``a p_i + b c_i = k_i``.
    Any y >= 0 with ``sum y_i p_i >= P`` and ``sum y_i c_i >= C`` gives
    ``a P + b C <= sum y_i k_i`` (the LP dual), so that sum never under-reserves. We keep
    the two responses with the smallest and largest prompt/completion ratio: one alone
    gives ``k_i max(P/p_i, C/c_i)`` (its whole cost put on whichever token kind binds, a
    loose bound), and when the two bracket the request's ratio their combination is the
    exact price (two equations, two unknowns). The worst case is the largest over the
    providers seen.

Responses are not all at list price (a free or cached answer costs $0, a discounted one
less), so what they teach is kept on the safe side: a $0 response teaches nothing, of two
with the same ratio the pricier is kept, and no bound is below what the dearest response
seen proves for a request of its size (``k min(P/p, C/c)``: at least that at any prices,
discounted or not).

Guarantee: with ``[prices]`` the spend never exceeds ``max_cost`` while every answer costs
no more than its reservation. One that costs more (prices below the provider's, an answer
past the completion tokens reserved for it) proves the table wrong: from then on the run
prices requests as without it (learned, below), and the requests already in flight may pass
the cap, which the engine then reports and stops on. Without, learned prices
are trusted for requests sent side by side only while they are *borne out*: the latest
response that cost anything cost no more than the reservation they gave it. Until one is
(the run's first responses: the first is sent before any price is known) and again after a
response cost more (it was priced by a cheap or discounted answer, a pricier provider came,
a price changed), and whenever a request's loose bound does not fit, a request goes only
alone, while ``spent`` is under the cap (a "learning" send), so the spend can exceed
``max_cost`` by at most one request's real cost (``P x a + max_tokens x n x b``); once two
responses with different ratios bracket the requests, the cap holds exactly. (A learning
send that times out is booked at its reservation, which is $0 before any price is known.)
Answers that all cost $0 (a free model) never bear a price out: under a cap they go one at
a time, and ``[prices]`` of 0 sends them side by side. Assumed: a provider's prices do not
change, and no unseen, pricier provider serves requests sent alongside ones the learned
prices bore out: set ``[prices]`` to the dearest provider's prices for a hard cap.

Without a cap nothing waits, but a request whose worst case is known exactly (``[prices]``, or
two learned responses that bracket it) still reserves it, so what it may cost silently is booked
as possible spend as under a cap (a loose bound is not booked: it would overstate it wildly).

Failures: an HTTP error reply is not billed (booked at $0). A 200 that is not kept
(malformed, no or repeated choices, a choice error) is: its ``usage`` as far as the body can
be read. An attempt that may have been billed without saying so (a read timeout, a dropped
connection, a cut stream, a 200 without usage, one that is not JSON at all) keeps its
reservation as *possible* spend (``Budget.possible``, stored in the attempt row, counted
against the cap in later runs too); nothing resolves it afterwards. So does a request cut off by the run's own end: aborted (an ``interrupted`` attempt) or killed (its
``in_flight`` record, committed before it went out, becomes an ``unanswered`` attempt when the
next run begins), so a resume's budget starts from it and ``--max-cost`` holds across resumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from ..content import request_parts
from .body import checked_usage
from .settings import Prices

__all__ = ["MEDIA_RESERVE_TOKENS", "Budget", "PriceBounds", "cost_of", "estimate_prompt_tokens", "linked_media",
           "cap_setting", "completion_cap", "reserved_tokens", "usd"]

#: Completion tokens reserved per request when the request sets no max_tokens.
DEFAULT_RESERVE_TOKENS = 32_768
#: Prompt tokens a provider may add around the messages (chat template, system preamble).
PROMPT_OVERHEAD_TOKENS = 256
#: Prompt tokens reserved for a media part given by URL (an image, a video, audio, a file),
#: beyond the URL's bytes: a BPE token covers a byte of text, but an encoder makes hundreds to
#: thousands of tokens of an image a short URL names. An allowance, not a bound (a long video
#: takes more): an answer that costs more than its reservation turns [prices] off, as any does.
#: One inline (``data:``, base64) is bounded by its bytes already.
MEDIA_RESERVE_TOKENS = 16_384
#: Content part types that carry media, by URL or inline.
_MEDIA_PARTS = ("image_url", "input_image", "image", "video_url", "video", "audio_url", "file", "input_file")


def usd(amount: float) -> str:
    """Dollars to four significant digits, at least cents: ``$400.00``, ``$0.9999``,
    ``$0.0005`` (``:.2f`` printed a $0.0005 cap as ``$0.00``)."""
    if amount == 0 or not math.isfinite(amount):
        return f"${amount:.2f}"
    decimals = max(2, 3 - math.floor(math.log10(abs(amount))))
    if decimals > 10:
        return f"${amount:.2e}"
    whole, _, cents = f"{amount:.{decimals}f}".partition(".")
    return f"${whole}.{cents[:2]}{cents[2:].rstrip('0')}"


def cost_of(usage: Mapping[str, Any] | None, prices: Prices | None) -> float | None:
    """USD for one response: the provider's figure when it is plausible (a finite number in
    0..:data:`~.body.MAX_PLAUSIBLE_COST`; a negative, NaN or absurd one is ignored, so it can
    never switch ``--max-cost`` off; BYOK: the fee plus the upstream charge), else from the
    price table, else unknown."""
    if not isinstance(usage, Mapping):
        return None
    checked = checked_usage({"usage": dict(usage)})
    if checked.cost is not None:
        return checked.cost
    if prices is None or checked.usage is None:
        return None
    if checked.prompt_tokens is None or checked.completion_tokens is None:
        return None  # absent or unusable: the tokens are unknown (``usage: {}`` was booked at $0, uncapped)
    return prices.cost(checked.prompt_tokens, checked.completion_tokens)


def reserved_tokens(request_json: str, request: Mapping[str, Any]) -> tuple[int, int]:
    """(prompt, completion) tokens a request's reservation prices: the prompt's upper bound
    (:func:`estimate_prompt_tokens`) and its :func:`completion_cap` (or
    :data:`DEFAULT_RESERVE_TOKENS`) for each of its ``n`` choices."""
    reserve = (completion_cap(request) or DEFAULT_RESERVE_TOKENS) * (_count(request.get("n")) or 1)
    return estimate_prompt_tokens(request_json) + MEDIA_RESERVE_TOKENS * linked_media(request), reserve


#: The body fields that cap a choice's completion tokens: engines take either, and vLLM's
#: ``max_completion_tokens`` wins over ``max_tokens`` when both are sent.
_CAPS = ("max_tokens", "max_completion_tokens")


def completion_cap(request: Mapping[str, Any]) -> int | None:
    """The most completion tokens a choice of ``request`` may be billed for: the larger of
    its caps (a server may obey either one: reserving ``max_tokens = 100`` beside
    ``max_completion_tokens = 20000`` let a run spend 13 times its ``max_cost``), None
    where it sets none."""
    caps = [_count(request.get(key)) for key in _CAPS]
    return max(caps) or None


def cap_setting(request: Mapping[str, Any]) -> str:
    """The setting(s) that gave ``request`` its :func:`completion_cap`, as a config names
    them: both where they are equal (lowering one alone changes nothing)."""
    given, other = _count(request.get("max_completion_tokens")), _count(request.get("max_tokens"))
    if given > other:
        return "extra_body.max_completion_tokens"
    return "max_tokens and extra_body.max_completion_tokens" if given == other else "max_tokens"


def _count(value: Any) -> int:  # Any: a stored request's field, as JSON gave it
    """``value`` where it is a positive whole number, else 0."""
    return value if type(value) is int and value > 0 else 0


def linked_media(request: Mapping[str, Any]) -> int:
    """How many media parts the request's messages name by URL (not inline)."""
    return sum(part.get("type") in _MEDIA_PARTS and not _inline(part) for part in request_parts(request))


def _inline(part: Mapping[str, Any]) -> bool:
    """Whether a media part carries its bytes (a ``data:`` URL, base64 data, a file's data)."""
    for key in (part["type"], "image_url", "url", "source", "file"):
        value = part.get(key)
        if isinstance(value, Mapping):
            if value.get("type") == "base64" or isinstance(value.get("data"), str):
                return True
            value = value.get("file_data", value.get("url"))  # OpenRouter's file_data: a data: URL or a link
        if isinstance(value, str):
            return value.startswith("data:")
    return False


def estimate_prompt_tokens(request_json: str) -> int:
    """An upper bound on the prompt tokens: a BPE token covers at least one byte of text,
    and the JSON around the texts outweighs the template's role markers."""
    return len(request_json.encode("utf-8", "surrogatepass")) + PROMPT_OVERHEAD_TOKENS


_Obs = tuple[int, int, float]  # (prompt tokens, completion tokens, USD) of one priced response


def _ratio(obs: _Obs) -> float:
    p, c, _ = obs
    return p / c if c else float("inf")


def _per_token(obs: _Obs) -> float:
    p, c, k = obs
    return k / (p + c)


def _replaces(obs: _Obs, kept: _Obs | None, more_extreme: bool) -> bool:
    """Whether ``obs`` takes ``kept``'s place: its ratio is further out, or the same and it is
    pricier (a cached or discounted answer must not stand for its ratio while a dearer one seen does)."""
    if kept is None or more_extreme:
        return True
    return _ratio(obs) == _ratio(kept) and _per_token(obs) > _per_token(kept)


@dataclass
class PriceBounds:
    """One provider's price knowledge: its most prompt-heavy and most completion-heavy
    response, and its dearest per token."""

    lo: _Obs | None = None  # smallest prompt/completion ratio (the pricier of equals)
    hi: _Obs | None = None  # largest
    dear: _Obs | None = None  # largest USD per token

    def add(self, prompt_tokens: int, completion_tokens: int, cost: float) -> None:
        """Learn from one response. One that cost $0 (a free or cached answer) teaches no
        price: kept, it would price every later request of its ratio at $0."""
        if prompt_tokens < 0 or completion_tokens < 0 or not cost > 0 or not (prompt_tokens or completion_tokens):
            return
        obs = (prompt_tokens, completion_tokens, cost)
        if _replaces(obs, self.lo, self.lo is not None and _ratio(obs) < _ratio(self.lo)):
            self.lo = obs
        if _replaces(obs, self.hi, self.hi is not None and _ratio(obs) > _ratio(self.hi)):
            self.hi = obs
        if self.dear is None or _per_token(obs) > _per_token(self.dear):
            self.dear = obs

    def bound(self, prompt: int, completion: int) -> tuple[float, bool] | None:
        """(USD no request of this size can exceed, whether it is exact), or None if unbounded.
        Never below :meth:`floor`: a discounted response kept for its ratio cannot pull it under
        what a dearer one proved."""
        upper = self._upper(prompt, completion)
        if upper is None:
            return None
        return max(upper[0], self.floor(prompt, completion)), upper[1]

    def floor(self, prompt: int, completion: int) -> float:
        """What a request of this size costs at least, by the responses kept: one that is
        ``y = min(P/p, C/c)`` times as large as response (p, c, k) in both token kinds costs at
        least ``y k`` at any non-negative prices, even if that response was discounted."""
        best = 0.0
        for p, c, k in {obs for obs in (self.lo, self.hi, self.dear) if obs is not None}:
            y = min(prompt / p if p else float("inf"), completion / c if c else float("inf"))
            best = max(best, y * k)
        return best

    def _upper(self, prompt: int, completion: int) -> tuple[float, bool] | None:
        """The LP bound of the module docstring: the two kept responses' exact combination when
        they bracket the request (the least of all bounds when the prices are fixed; taken as it
        is, not the least, when responses disagree), else the least single-response bound."""
        if self.lo is not None and self.hi is not None and self.lo != self.hi:
            (p1, c1, k1), (p2, c2, k2) = self.lo, self.hi
            det = p1 * c2 - p2 * c1
            if det:
                y1 = (prompt * c2 - completion * p2) / det
                y2 = (completion * p1 - prompt * c1) / det
                if y1 >= 0 and y2 >= 0:
                    return y1 * k1 + y2 * k2, True
        best: float | None = None
        for p, c, k in {obs for obs in (self.lo, self.hi) if obs is not None}:
            if (prompt and not p) or (completion and not c):
                continue  # this response says nothing about one of the prices
            y = max(prompt / p if prompt else 0.0, completion / c if completion else 0.0)
            best = y * k if best is None else min(best, y * k)
        return (best, False) if best is not None else None


@dataclass
class Budget:
    """Running spend against an optional cap, with per-request reservations."""

    max_cost: float | None
    prices: Prices | None
    spent: float = 0.0  # billed
    possible: float = 0.0  # maybe billed (reservations of attempts that returned no cost)
    reserved: float = 0.0
    in_flight: int = 0
    exhausted: bool = False
    unpriced: bool = False  # a cap is set and a request no price bounded came back of unknown cost
    unread: bool = False  # ... and the answer that stopped it could not be read (its cost unknown)
    lost: bool = False  # ... and the request that stopped it may have been billed and got no answer
    learning_sends: int = 0  # requests sent alone because their price was not known well enough
    providers: dict[str, PriceBounds] = field(default_factory=dict)
    borne_out: bool = False  # the latest answer that cost anything cost no more than its learned reservation
    #: (cost, reservation) of the first answer that cost more than ``[prices]`` reserved for it:
    #: the table is then not used to price requests (:attr:`priced`)
    overrun: tuple[float, float] | None = None
    #: the overrun is an answer an earlier run stored (:meth:`table_shown_low`), not this run's
    overrun_stored: bool = False
    #: requests still in flight that ``[prices]`` reserved when it proved too low: their
    #: answers settle first and bear out no learned price (each was not priced by one)
    _table_flight: int = 0

    def table_shown_low(self, cost: float, reservation: float) -> None:
        """An answer stored by an earlier run cost more than ``[prices]`` reserves for its
        request: the table is not trusted from the start, as it was not once the run saw it
        (a resume trusted it again and sent a batch at once past the cap)."""
        if self.overrun is None:
            self.overrun, self.overrun_stored = (cost, reservation), True

    @property
    def priced(self) -> bool:
        """Whether requests are priced by ``[prices]``: given, and no answer cost more than it said."""
        return self.prices is not None and self.overrun is None

    @property
    def total(self) -> float:
        return self.spent + self.possible

    def observe(self, provider: str | None, prompt_tokens: int, completion_tokens: int, cost: float) -> None:
        """Learn from one priced response (also fed from the store when a run resumes); one
        that cost $0 teaches nothing (see :meth:`PriceBounds.add`), so it names no provider."""
        if cost > 0:
            self.providers.setdefault(provider or "", PriceBounds()).add(prompt_tokens, completion_tokens, cost)

    def reservation(self, prompt_tokens: int, completion_tokens: int) -> tuple[float, bool] | None:
        """(worst-case USD for one request, exact?), or None when nothing is known yet to price it."""
        if self.prices is not None and self.priced:
            return self.prices.cost(prompt_tokens, completion_tokens), True
        if not self.providers:
            return None
        worst, exact = 0.0, True
        for bounds in self.providers.values():
            b = bounds.bound(prompt_tokens, completion_tokens)
            if b is None:
                return None
            worst, exact = max(worst, b[0]), exact and b[1]
        return worst, exact

    def _unbounded_message(self) -> str:
        """Why a request no price bounded stopped the run: what it was (an answer without a
        cost, an unreadable 200, a request with no HTTP answer) and why no price held."""
        if self.prices is not None:
            why, todo = ("[prices] proved too low (an answer cost more than it reserved) and what answers cost so far "
                         "cannot bound the next request"), "raise [prices] to the provider's"
        elif self.providers:
            why, todo = "no [prices], and what answers cost so far cannot bound the next request", "set [prices]"
        else:
            why, todo = "nothing is priced yet (no [prices], no answer's usage.cost)", "set [prices]"
        if self.unread:
            what = "an answer the provider sent (HTTP 200) could not be read whole"
        elif self.lost:
            what = ("a request that may have been billed got no HTTP answer (a timeout, a connection dropped after it "
                    "went out, a body that could not be decoded, or an internal error)")
        else:
            what = "an answer carried no usage.cost"
        return (f"--max-cost is set, {why}, and {what}, so what it cost is unknown: {todo} "
                "(zero prices for a free model)")

    def stop_message(self, prompt_tokens: int, completion_tokens: int, *, default_reserve: bool, media: int = 0,
                     cap: str = "max_tokens") -> str:
        """Why the cap stopped the run (once :attr:`exhausted`), for the request that did not
        fit: amounts with the digits that tell them (:func:`usd`), that request's worst case,
        and when it alone is above the cap, so so is every request like it, why
        (``default_reserve``: the request sets no ``max_tokens``, so
        :data:`DEFAULT_RESERVE_TOKENS` completion tokens were reserved for it; else ``cap``
        names the setting that set its completion's cap, :func:`cap_setting`)."""
        if self.unpriced:
            return self._unbounded_message()
        most = self.max_cost or 0.0
        possible = f" + {usd(self.possible)} possibly billed" if self.possible else ""
        est = self.reservation(prompt_tokens, completion_tokens)
        worst = f", {usd(est[0])}," if est is not None else ""
        text = f"budget {usd(most)} reached (spent {usd(self.spent)}{possible}; the next request's worst case{worst} does not fit)"
        if est is not None and est[0] > most:
            how = (f"no max_tokens, so {DEFAULT_RESERVE_TOKENS:,} completion tokens are reserved for each: set "
                   "max_tokens (--max-tokens) or raise --max-cost" if default_reserve else f"raise --max-cost or lower "
                   f"{cap}")
            if media:
                how += (f"; it names {media} image(s) or other media by URL, {MEDIA_RESERVE_TOKENS:,} prompt tokens "
                        "reserved for each, as their size in tokens is not known before")
            text += f"; one request's worst case alone is above the cap ({how})"
        return text

    def admit(self, prompt_tokens: int, completion_tokens: int) -> float | None:
        """Reserve for one request; returns the reservation, or None if it cannot go now.

        None with :attr:`exhausted` still False means "wait for an in-flight request to
        settle and ask again"; :attr:`exhausted` turns True once even an idle budget
        cannot send the request, and then stays True.
        """
        if self.max_cost is None:  # nothing waits; a request priced exactly still reserves, so a silent charge is booked
            est = self.reservation(prompt_tokens, completion_tokens)
            return self._reserve(est[0] if est is not None and est[1] else 0.0)
        if self.exhausted:
            return None
        if self.total >= self.max_cost:
            if self.in_flight == 0:
                self.exhausted = True
            return None
        est = self.reservation(prompt_tokens, completion_tokens)
        trusted = self.priced or self.borne_out  # else only alone (see the module docstring)
        fits = est is not None and self.total + self.reserved + est[0] <= self.max_cost
        if fits and trusted and est is not None:
            return self._reserve(est[0])
        if self.in_flight:
            return None  # wait: a settling request frees its reservation (or teaches a price)
        if est is not None and est[1] and not fits:
            self.exhausted = True  # the true worst case does not fit
            return None
        self.learning_sends += 1  # alone, under the cap, price not known well enough
        return self._reserve(est[0] if est is not None else 0.0)

    def _reserve(self, amount: float) -> float:
        self.reserved += amount
        self.in_flight += 1
        return amount

    def settle(
        self,
        reservation: float,
        cost: float | None,
        *,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        provider: str | None = None,
        possible: bool = False,
        answered: bool = False,
        unread: bool = False,
        lost: bool = False,
    ) -> float | None:
        """A request came back: drop its reservation and book what it cost.

        ``cost`` None with ``possible`` True: it may have been billed without saying so
        (a timeout, a cut stream; ``answered``: a response without usage; ``unread``: an
        HTTP 200 whose body could not be read whole); its reservation is booked as possible
        spend, and returned (None when nothing was booked). An unbilled failure passes
        ``cost=0.0``. Under a cap, a request no price bounds (nothing priced yet, or prices
        learned that cannot bound it: a learning send) is reserved 0: an answer, a 200, or
        ``lost``, a request that got no HTTP answer and may have been billed (a timeout, a
        connection dropped once it was out: a provider bills a generation the client stopped
        waiting for), each of unknown cost, then stops the run (it cannot be booked, so no cap
        holds; a cold tester's server billed $4.80 in timeouts against a $1 cap).
        """
        self.in_flight = max(0, self.in_flight - 1)
        self.reserved = max(0.0, self.reserved - reservation)
        by_table = self._table_flight > 0
        self._table_flight -= by_table
        if cost is not None and not (0.0 <= cost < float("inf")):
            cost, possible = None, True  # never book a negative/NaN figure: it would lift the cap
        if cost is not None:
            self.spent += cost
            within = cost <= reservation * (1 + 1e-9)
            if self.priced and not within:  # [prices] under-reserved ($0 prices too): priced as without it from now
                self.overrun, self._table_flight = (cost, reservation), self.in_flight
            elif not self.priced and cost > 0 and not by_table:  # did the learned prices foresee it? ($0 says nothing)
                self.borne_out = reservation > 0 and within
            if isinstance(prompt_tokens, int) and isinstance(completion_tokens, int):
                self.observe(provider, prompt_tokens, completion_tokens, cost)  # for when [prices] proves wrong
            return None
        if not possible:
            return None
        if reservation > 0:
            self.possible += reservation
            return reservation
        if (answered or unread or lost) and self.max_cost is not None and not self.priced:
            self.unpriced = self.exhausted = True  # no price bounded it, and it may have cost anything
            self.unread = self.unread or (unread and not answered)
            self.lost = self.lost or (lost and not (answered or unread))
        return None

    def cancel(self, reservation: float) -> None:
        """A reserved request was never sent."""
        self._table_flight -= self._table_flight > 0
        self.in_flight = max(0, self.in_flight - 1)
        self.reserved = max(0.0, self.reserved - reservation)
