"""OpenRouter provider routing: which configured provider serves a request.

Understands the request's ``provider`` object (``order``, ``only``, ``ignore``,
``quantizations``, ``allow_fallbacks``, ``sort``, ``max_price``) and the model suffixes
``:nitro`` (sort by throughput) and ``:floor`` (sort by price). A name matches a provider's
full name (``"leaky/int4"``) or its slug (``"leaky"``), case-insensitively. Without an
order or sort, requests are spread over the candidates by their sample key, the way
OpenRouter load-balances.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Mapping, Sequence

from .config import ProviderConfig
from .hashing import draw

__all__ = ["RoutingError", "select_providers", "split_model_suffix"]

_SORTS = ("price", "throughput", "latency")
_SUFFIX_SORT = {"nitro": "throughput", "floor": "price"}


class RoutingError(Exception):
    """No provider can serve the request (HTTP ``status``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def split_model_suffix(model: str) -> tuple[str, str | None]:
    """``"x/y:nitro"`` -> ``("x/y", "throughput")``; other suffixes stay part of the id."""
    base, sep, suffix = model.rpartition(":")
    if sep and suffix in _SUFFIX_SORT:
        return base, _SUFFIX_SORT[suffix]
    return model, None


def _names(prefs: Mapping[str, Any], key: str) -> list[str] | None:
    value = prefs.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RoutingError(400, f"provider.{key} must be a list of provider names")
    return [v.lower() for v in value]


def _matches(p: ProviderConfig, names: Sequence[str]) -> bool:
    return p.name.lower() in names or p.slug.lower() in names


def _sort_key(sort: str) -> Callable[[ProviderConfig], float]:
    if sort == "price":
        return lambda p: p.prompt_price + p.completion_price
    if sort == "latency":
        return lambda p: p.latency_ms or 0.0
    return lambda p: -(p.tokens_per_s or float("inf"))


def select_providers(
    providers: Sequence[ProviderConfig],
    prefs: Any,
    *,
    sample_key: str,
    suffix_sort: str | None = None,
) -> list[ProviderConfig]:
    """Candidates in the order OpenRouter would try them; RoutingError when none is left."""
    if prefs is None:
        prefs = {}
    if not isinstance(prefs, Mapping):
        raise RoutingError(400, "provider must be an object")
    only, ignore = _names(prefs, "only"), _names(prefs, "ignore")
    order = _names(prefs, "order")
    quants = _names(prefs, "quantizations")
    fallbacks = prefs.get("allow_fallbacks", True)
    sort = prefs.get("sort", suffix_sort)
    if isinstance(sort, Mapping):  # newer form: {"by": "price", ...}
        sort = sort.get("by")
    if sort is not None and sort not in _SORTS:
        raise RoutingError(400, f"provider.sort must be one of {', '.join(_SORTS)}")
    max_price = prefs.get("max_price") or {}
    if not isinstance(max_price, Mapping):
        raise RoutingError(400, "provider.max_price must be an object")

    cands = list(providers)
    if only is not None:
        cands = [p for p in cands if _matches(p, only)]
    if ignore is not None:
        cands = [p for p in cands if not _matches(p, ignore)]
    if quants is not None:
        cands = [p for p in cands if p.quantization.lower() in quants]
    if isinstance(max_price.get("prompt"), (int, float)):
        cands = [p for p in cands if p.prompt_price <= max_price["prompt"]]
    if isinstance(max_price.get("completion"), (int, float)):
        cands = [p for p in cands if p.completion_price <= max_price["completion"]]

    if order:
        first = [p for name in order for p in cands if _matches(p, [name])]
        first = list(dict.fromkeys(first))
        rest = [p for p in cands if p not in first]
        if sort:
            rest.sort(key=_sort_key(sort))
        cands = first + (rest if fallbacks is not False else [])
    elif sort:
        cands.sort(key=_sort_key(sort))
    elif len(cands) > 1:
        shift = int(draw("route", sample_key) * len(cands))
        cands = cands[shift:] + cands[:shift]
    if not cands:
        raise RoutingError(404, "No endpoints found matching your data policy and provider preferences")
    return cands
