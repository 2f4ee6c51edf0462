"""The dialect for a folder whose family tokenbridge does not know, but whose chat
template it can render.

Prompts are the template's own (exact, as transformers renders them). The completion
side is a guess read off the tokenizer: the end token is the config's ``eos_token``
(or ``<|im_end|>`` / ``<|endoftext|>`` when that is absent), and ``<think>`` /
``</think>`` are the think markers when the vocabulary has them. No engine parser backs
that guess, so the gate marks every sample ``completion_unproven``.
"""

from __future__ import annotations

from ..tokenizer import Tokenizer
from .dialect import Dialect
from .template import special_token_strings

_FALLBACK_ENDS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>")


def generic_dialect(tokenizer: Tokenizer) -> Dialect:
    markers = tokenizer.markers
    eos = special_token_strings(tokenizer.config).get("eos_token")
    if eos not in markers:
        eos = next((t for t in _FALLBACK_ENDS if t in markers), None)
    if eos is None:
        from . import DialectError

        raise DialectError(f"{tokenizer.source}: unknown chat format and no end-of-turn token found; pass --dialect")
    think = "<think>" in markers and "</think>" in markers
    return Dialect(
        name="generic",
        render=None,
        end_token=eos,
        think_open="<think>" if think else None,
        think_close="</think>" if think else None,
        eos_markers=frozenset({eos}),
        completion_proven=False,
    )
