"""What a whole run (or a probe) shows about a provider that no single response can.

Two kinds of trait:

* **Count calibration.** A provider whose ``usage.completion_tokens`` never counts the
  end token (one less than ours on every sample that ended, equal on cut ones), or whose
  ``prompt_tokens`` leaves out ``cached_tokens`` (less than ours by exactly that count),
  would have every sample rejected as a count mismatch although its ids are right.
  Across a run the offset is plain; its samples are then checked against the calibrated
  count, and the calibration is reported. A sample whose own count disagrees with the
  calibrated one is still rejected. Offsets without such a cause are never calibrated
  (see :func:`_end_uncounted`). The opposite is a trait too where it matters: a run that
  proves a provider counts its end token lets the count read a turn that ended inside
  its think block (``end_in_think``, :mod:`tokenbridge.hypotheses`), which is one token
  short of the formula exactly as an uncounted end token is.
* **Text edits the gate cannot see per sample** (``strip``, ``nfc``, ``nfkc``,
  ``crlf_to_lf``): found across the run (a provider whose text never keeps edge
  whitespace) or by ``tokenbridge probe``'s echo tests (``--provider-profile``). Such a
  provider's samples get a warning finding unless ground-truth ids prove them.

Detection reads only samples with one reading and exact-looking evidence
(:class:`CountDelta`), so an ambiguous or broken sample cannot skew it.
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Mapping

__all__ = [
    "CountDelta",
    "ProfileError",
    "RecordFacts",
    "ProviderTrait",
    "TraitStats",
    "load_provider_profile",
]

#: Text edits that can keep a text's token count: invisible per sample.
INVISIBLE_EDITS = ("crlf_to_lf", "nfc", "nfkc", "strip")
#: Every edit a probe profile may name: the invisible ones, and vLLM's marker spaces
#: (which :mod:`tokenbridge.hypotheses` undoes).
KNOWN_EDITS = (*INVISIBLE_EDITS, "marker_spaces")

#: Fewest eligible samples before a provider's counts are calibrated, and the share of
#: them that must show the same offset.
MIN_SAMPLES = 20
MIN_SHARE = 0.9
#: Fewest samples with ``cached_tokens > 0`` before "prompt excludes cached" is decided.
MIN_CACHED = 5


@dataclass(frozen=True)
class ProviderTrait:
    """A provider's run-level calibration and known text edits."""

    provider: str
    #: usage leaves out the end token: one less is expected from a sample that ends
    end_uncounted: bool = False
    #: ``prompt_tokens`` excludes ``prompt_tokens_details.cached_tokens``
    cached_excluded: bool = False
    #: invisible text edits (sorted), with where each was seen
    edits: tuple[str, ...] = ()
    edit_sources: tuple[str, ...] = ()
    #: serves vLLM's joined text (a space around every marker, one in front)
    joins_markers: bool = False
    #: GLM: the newline before ``<think>`` comes inside the reasoning (SGLang, True) or
    #: never does (vLLM, False); None: the run does not show
    prefix_in_reasoning: bool | None = None
    #: usage counts the end token, proven across the run (set only where a sample of the
    #: run could have ended inside its think block: it is what lets the count read that)
    end_counted: bool = False

    @property
    def calibrated(self) -> bool:
        return (self.end_uncounted or self.cached_excluded or self.joins_markers or self.prefix_in_reasoning is not None
                or self.end_counted)

    def describe(self) -> str | None:
        """One phrase for messages and the summary; None when nothing is calibrated."""
        said = []
        if self.end_uncounted:
            said.append("completion_tokens leaves out the end token")
        if self.end_counted:
            said.append("completion_tokens counts the end token")
        if self.cached_excluded:
            said.append("prompt_tokens leaves out cached_tokens")
        if self.joins_markers:
            said.append("text joins markers with spaces (vLLM's detokenizer)")
        if self.prefix_in_reasoning is not None:
            said.append("GLM's newline before <think> " + ("comes in the reasoning (SGLang)" if self.prefix_in_reasoning
                                                           else "never comes in the reasoning (vLLM)"))
        return "; ".join(said) or None

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "end_uncounted": self.end_uncounted,
            "cached_excluded": self.cached_excluded,
            "edits": list(self.edits),
            "edit_sources": list(self.edit_sources),
            "joins_markers": self.joins_markers,
            "prefix_in_reasoning": self.prefix_in_reasoning,
            "end_counted": self.end_counted,
            "calibration": self.describe(),
        }


@dataclass(frozen=True)
class CountDelta:
    """One eligible sample's counts against its usage: ours minus theirs."""

    ended: bool
    completion: int | None
    prompt: int | None
    cached: int | None


@dataclass(frozen=True)
class RecordFacts:
    """What one record tells the run-level detection."""

    delta: CountDelta | None = None
    #: choices whose text holds a marker, and how many of those have vLLM's joined shape
    markered: int = 0
    joined: int = 0
    #: GLM thinking choices with reasoning, and how many of those start it with the
    #: newline the model writes before ``<think>``
    reasoned: int = 0
    prefixed: int = 0
    #: choices that may have ended inside their think block, read without that reading
    #: (the run had not proven the provider counts its end token)
    unclosed: int = 0
    #: per choice: whether its served text keeps leading/trailing whitespace
    edges: tuple[bool, ...] = ()


@dataclass
class TraitStats:
    """Per-provider tallies from one pass over a run; flat in memory (counters)."""

    completion: dict[str, Counter[tuple[bool, int]]] = field(default_factory=dict)  # provider -> (ended, delta) counts
    cached: dict[str, list[int]] = field(default_factory=dict)  # provider -> [rows with cached > 0, delta == cached]
    shapes: dict[str, list[int]] = field(default_factory=dict)  # provider -> [choices with a marker, joined shape]
    prefixes: dict[str, list[int]] = field(default_factory=dict)  # provider -> [GLM reasonings, with the newline]
    unclosed: Counter[str] = field(default_factory=Counter)  # provider -> choices that may have ended in think

    def add(self, provider: str, facts: RecordFacts) -> None:
        if facts.unclosed:
            self.unclosed[provider] += facts.unclosed
        if facts.reasoned:
            tally = self.prefixes.setdefault(provider, [0, 0])
            tally[0] += facts.reasoned
            tally[1] += facts.prefixed
        if facts.markered:
            tally = self.shapes.setdefault(provider, [0, 0])
            tally[0] += facts.markered
            tally[1] += facts.joined
        delta = facts.delta
        if delta is None:
            return
        if delta.completion is not None:
            self.completion.setdefault(provider, Counter())[(delta.ended, delta.completion)] += 1
        if delta.prompt is not None and delta.cached:
            tally = self.cached.setdefault(provider, [0, 0])
            tally[0] += 1
            tally[1] += delta.prompt == delta.cached

    def traits(self, stripping: Iterable[str] = (), profile: Mapping[str, tuple[str, ...]] | None = None,
               ) -> dict[str, ProviderTrait]:
        """The traits this run shows, merged with ``stripping`` (providers suspected of
        stripping edge whitespace) and a probe ``profile`` (provider -> edits)."""
        out: dict[str, ProviderTrait] = {}
        names = (set(self.completion) | set(self.cached) | set(self.shapes) | set(self.prefixes) | set(stripping)
                 | set(profile or {}))
        strip = set(stripping)
        for name in sorted(names):
            end_uncounted = _end_uncounted(self.completion.get(name, Counter()))
            # a constant prompt offset has no known cause (our prompt may differ): never calibrated
            cached_excluded = _cached_excluded(self.cached.get(name, [0, 0]))
            edits: dict[str, str] = {}
            probed = (profile or {}).get(name, ())
            for edit in probed:
                if edit in INVISIBLE_EDITS:
                    edits[edit] = "probe"
            if name in strip:
                edits.setdefault("strip", "run")
            markered, joined = self.shapes.get(name, [0, 0])
            joins = "marker_spaces" in probed or (markered >= MIN_SAMPLES and joined >= MIN_SHARE * markered)
            counted = bool(self.unclosed[name]) and _end_counted(self.completion.get(name, Counter()))
            trait = ProviderTrait(name, end_uncounted, cached_excluded,
                                  tuple(sorted(edits)), tuple(edits[e] for e in sorted(edits)), joins,
                                  _prefix_in_reasoning(self.prefixes.get(name, [0, 0])), counted)
            if trait.calibrated or trait.edits:
                out[name] = trait
        return out


def _mode(counts: Counter[int]) -> int:
    """The offset (non-zero) shared by at least MIN_SHARE of MIN_SAMPLES or more, else 0."""
    total = sum(counts.values())
    if total < MIN_SAMPLES:
        return 0
    value, n = counts.most_common(1)[0]
    return value if value and n >= MIN_SHARE * total else 0


def _end_uncounted(counts: Counter[tuple[bool, int]]) -> bool:
    """Whether (ended, delta) tallies show a provider that never counts the end token.

    Only an offset with a known cause is calibrated: ours one more than usage on every
    sample that ended, and equal on the cut ones when there are enough of them to tell
    -- the end token left uncounted. Any other constant (usage counting more than we
    rebuilt, above all) is just as well explained by ids that are wrong the same way on
    every sample (a model that always splits one word another way does that), so it
    stays a mismatch: calibrating it away would pass every wrong sample at once.
    """
    ended = Counter({d: n for (e, d), n in counts.items() if e})
    cut = Counter({d: n for (e, d), n in counts.items() if not e})
    if _mode(ended) != 1:
        return False
    if sum(cut.values()) >= 3:
        value, n = cut.most_common(1)[0]
        return value == 0 and n >= MIN_SHARE * sum(cut.values())
    return True


def _end_counted(counts: Counter[tuple[bool, int]]) -> bool:
    """Whether (ended, delta) tallies show a provider that counts the end token: our count
    equal to usage's on at least MIN_SHARE of MIN_SAMPLES or more samples that ended, and
    none that ended one over usage (an end token left uncounted there: a provider mixing
    backends, whose closed think blocks would read as ended inside them)."""
    ended = [n for (e, _), n in counts.items() if e]
    return sum(ended) >= MIN_SAMPLES and counts[(True, 0)] >= MIN_SHARE * sum(ended) and not counts[(True, 1)]


def _prefix_in_reasoning(tally: list[int]) -> bool | None:
    """Which engine's GLM form a provider's run shows: SGLang puts the newline the model
    writes before ``<think>`` at the start of every reasoning, vLLM in none (it drops it, or
    streams it as content), barring a model that starts its reasoning with a newline."""
    reasoned, prefixed = tally
    if reasoned < MIN_SAMPLES:
        return None
    if prefixed >= MIN_SHARE * reasoned:
        return True
    if reasoned - prefixed >= MIN_SHARE * reasoned:
        return False
    return None


def _cached_excluded(tally: list[int]) -> bool:
    rows, hits = tally
    return rows >= MIN_CACHED and hits >= MIN_SHARE * rows


class ProfileError(ValueError):
    """A provider profile file is unreadable or not in ``tokenbridge probe --json``'s shape."""


#: The most of a profile file read (a probe's is a few KB).
_PROFILE_BYTES = 64 << 20


def load_provider_profile(path: str | Path) -> dict[str, tuple[str, ...]]:
    """Provider -> the invisible text edits ``tokenbridge probe --json`` found.

    Accepts the probe's own output (``{"providers": [{"provider", "profile": {...}}]}``)
    or a bare list of profiles (``[{"provider", "text_edits", ...}]``).
    """
    from .fsio import read_small_text
    from .jsonl import JsonLineError, loads_document

    path = Path(path)
    try:  # a regular file: a FIFO no one writes to hung the command
        data = loads_document(read_small_text(path, _PROFILE_BYTES), unique_keys=True)
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON, nested too deeply, a key twice (JsonLineError)
        field = exc.field if isinstance(exc, JsonLineError) else None
        where = f"{path}: {'providers' if field.startswith('[') else ''}{field}" if field else str(path)  # a bare list too
        raise ProfileError(f"{where}: cannot read the provider profile ({exc})") from None
    entries = data.get("providers") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ProfileError(f"{path}: providers: must be a list (the output of `tokenbridge probe --json`)")
    out: dict[str, tuple[str, ...]] = {}
    given: dict[str, int] = {}  # provider -> its entry
    for k, entry in enumerate(entries):
        where = f"{path}: providers[{k}]"
        if not isinstance(entry, dict):
            raise ProfileError(f"{where}: must be an object")
        prof = entry.get("profile", entry)
        name = entry.get("provider", prof.get("provider") if isinstance(prof, dict) else None)
        if not isinstance(name, str) or not name:
            raise ProfileError(f"{where}.provider: missing or not a string")
        if not isinstance(prof, dict):
            raise ProfileError(f"{where}.profile: must be an object")
        at = f"{where}.profile" if "profile" in entry else where
        # strict, as a hand edit is read: a misspelt or misplaced text_edits read as "no edit"
        # let that provider's samples pass unflagged (a cold tester's)
        if "text_edits" not in prof:
            near = difflib.get_close_matches("text_edits", [str(k) for k in prof], n=1)
            raise ProfileError(f"{at}.text_edits: missing (a probe writes it: the edits it found, [] for none, or "
                               "null where it could not tell)" + (f"; the profile has {near[0]!r}" if near else ""))
        edits = prof["text_edits"]
        if edits is None:  # the probe could not tell (no echo test was answered): no edit known
            edits = []
        if not isinstance(edits, list) or not all(isinstance(e, str) for e in edits):
            raise ProfileError(f"{where}.profile.text_edits: must be a list of strings or null")
        # strict, as a hand edit is read: an edit misspelled ("NFKC") or a provider given
        # twice with other edits (the last one kept) silently let that provider's samples pass unflagged
        for i, edit in enumerate(edits):
            if edit not in KNOWN_EDITS:
                raise ProfileError(f"{where}.profile.text_edits[{i}]: {edit!r} is no edit a probe names "
                                   f"(one of {', '.join(KNOWN_EDITS)})")
        found = tuple(sorted(set(edits)))
        if name in given and out[name] != found:  # the same profile twice says nothing twice
            raise ProfileError(f"{where}.provider: {name!r} is also providers[{given[name]}], with other text_edits: "
                               "which one holds is unclear")
        given.setdefault(name, k)
        out[name] = found
    return out
