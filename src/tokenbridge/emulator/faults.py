"""Which failure (if any) a request meets.

The draw is keyed by (seed, sample key, attempt number for that key), so a retry of the
same sample gets a fresh, but still reproducible, coin: with ``fault_rate`` 0.3 a client
that retries eventually succeeds, and the same run replays identically.
"""

from __future__ import annotations

from dataclasses import fields

from .config import TRANSPORT_FAULTS, ProviderConfig, ProviderFaults
from .hashing import draw

__all__ = ["FAULT_KINDS", "pick_fault"]

#: Every fault kind, in the order provider rates are checked.
FAULT_KINDS = tuple(f.name for f in fields(ProviderFaults))


def pick_fault(provider: ProviderConfig, fault_rate: float, *, seed: int, key: str, attempt: int) -> str | None:
    """The fault kind for this attempt, or None for a normal response."""
    if fault_rate > 0 and draw(seed, "fault", key, attempt) < fault_rate:
        return TRANSPORT_FAULTS[int(draw(seed, "fault-kind", key, attempt) * len(TRANSPORT_FAULTS))]
    for kind in FAULT_KINDS:
        rate = getattr(provider.faults, kind)
        if rate > 0 and draw(seed, provider.name, kind, key, attempt) < rate:
            return kind
    return None
