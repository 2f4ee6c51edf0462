"""Spend: what a response cost, and whether one more request still fits the budget.

A response's cost is ``usage.cost`` (OpenRouter returns it with ``usage: {include:
true}``), else usage tokens x the configured price table, else unknown.

:class:`Budget` admits a request only if ``spent + reserved + estimate <= max_cost``,
where every in-flight request holds a reservation of its worst case (prompt estimate +
``max_tokens`` x n at the completion price). Without a price table, the first request
goes alone; its cost per token then prices the reservations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .settings import Prices

__all__ = ["Budget", "cost_of", "estimate_prompt_tokens"]

#: Completion tokens reserved per request when the request sets no max_tokens.
DEFAULT_RESERVE_TOKENS = 32_768


def cost_of(usage: Mapping[str, Any] | None, prices: Prices | None) -> float | None:
    """USD for one response: the provider's figure when given, else from the price table."""
    if not isinstance(usage, Mapping):
        return None
    cost = usage.get("cost")
    if isinstance(cost, (int, float)) and not isinstance(cost, bool):
        return float(cost)
    if prices is None:
        return None
    p = usage.get("prompt_tokens") or 0
    c = usage.get("completion_tokens") or 0
    if not isinstance(p, int) or not isinstance(c, int):
        return None
    return prices.cost(p, c)


def estimate_prompt_tokens(request_json: str) -> int:
    """A cheap upper-ish bound for budget reservations (no tokenizer on the hot path)."""
    return len(request_json) // 3 + 16


@dataclass
class Budget:
    """Running spend against an optional cap, with per-request reservations."""

    max_cost: float | None
    prices: Prices | None
    spent: float = 0.0
    reserved: float = 0.0
    in_flight: int = 0
    _tokens_seen: int = 0
    _cost_seen: float = 0.0
    exhausted: bool = False
    unpriced: bool = False  # a cap is set but responses carry no cost and there is no price table

    def reservation(self, prompt_tokens: int, completion_tokens: int) -> float | None:
        """Worst-case USD for one request, or None when nothing is known yet to price it."""
        if self.prices is not None:
            return self.prices.cost(prompt_tokens, completion_tokens)
        if self._tokens_seen:
            return (prompt_tokens + completion_tokens) * self._cost_seen / self._tokens_seen
        return None

    def admit(self, prompt_tokens: int, completion_tokens: int) -> float | None:
        """Reserve for one request; returns the reservation, or None if it cannot go now.

        None with :attr:`exhausted` still False means "wait for an in-flight request to
        settle and ask again"; :attr:`exhausted` turns True once even an idle budget
        cannot fit the request, and then stays True.
        """
        if self.max_cost is None:
            self.in_flight += 1
            return 0.0
        if self.exhausted:
            return None
        estimate = self.reservation(prompt_tokens, completion_tokens)
        if estimate is None:
            if self.in_flight:  # learning the price: one request at a time until one returns
                return None
            estimate = 0.0
        if self.spent + self.reserved + estimate > self.max_cost or self.spent >= self.max_cost:
            if self.in_flight == 0:
                self.exhausted = True
            return None
        self.reserved += estimate
        self.in_flight += 1
        return estimate

    def settle(self, reservation: float, cost: float | None, tokens: int = 0) -> None:
        """A request came back: drop its reservation and book what it actually cost.

        ``cost`` None means "a response arrived but its price is unknown" (an unbilled
        failure should pass 0.0).
        """
        self.in_flight = max(0, self.in_flight - 1)
        self.reserved = max(0.0, self.reserved - reservation)
        if cost is None and self.max_cost is not None and self.prices is None:
            self.unpriced = self.exhausted = True
        if cost is not None:
            self.spent += cost
            if tokens > 0:
                self._tokens_seen += tokens
                self._cost_seen += cost

    def cancel(self, reservation: float) -> None:
        """A reserved request was never sent."""
        self.in_flight = max(0, self.in_flight - 1)
        self.reserved = max(0.0, self.reserved - reservation)

    @property
    def waiting_to_learn(self) -> bool:
        """True while an unpriced cap holds requests back until the first cost is known."""
        return self.max_cost is not None and self.prices is None and not self._tokens_seen and self.in_flight > 0
