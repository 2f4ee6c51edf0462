"""One render of a chat template, bounded: transformers' immutable sandbox, plus bounds.

A template is code from a folder or the Hub, run on every record. transformers leaves
it unbounded; here a template that loops without end, multiplies or doubles a value past
any prompt's size stops with :class:`RenderStopped` (its render, not the run or the
machine): a time limit (:data:`RENDER_SECONDS`, by SIGALRM), a size for every value it
builds and for what it writes (:data:`RENDER_SIZE`), a ``range`` budget
(:data:`RANGE_ITEMS`), and ``**`` up to :data:`POWER_BITS`. Within them, what a template
writes is what the unbounded sandbox writes.
"""

from __future__ import annotations

import functools
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import Namespace

__all__ = ["POWER_BITS", "RANGE_ITEMS", "RENDER_SECONDS", "RENDER_SIZE", "RenderStopped", "environment", "render"]


class RenderStopped(Exception):
    """A render went past one of its bounds (the message says which)."""


#: The longest one render may run (where a timer can stop it: in the main thread, with
#: SIGALRM free); real renders take milliseconds, a long agent history well under a second.
RENDER_SECONDS = 10.0
#: The most characters (or items) one value a template builds, or its whole output, may
#: hold; a prompt of a million tokens is a few million characters.
RENDER_SIZE = 64 << 20
#: The most ``range`` items one render may ask for, all calls together (Jinja's sandbox
#: bounds one call to 100,000; nested, they multiply).
RANGE_ITEMS = 10_000_000
#: The largest integer result of ``**`` one render may compute, in bits.
POWER_BITS = 1 << 16

#: A field width of nine digits or more in a format string: a value of 100 MB or more.
_WIDE_FIELD = re.compile(r"\d{9,}")


def _too_big(what: str) -> RenderStopped:
    return RenderStopped(f"{what}: more than {RENDER_SIZE:,} characters or items (the chat template's bound)")


#: What a size bound applies to.
_SIZED = (str, list, tuple, dict)


def _check_size(value: Any) -> Any:
    if isinstance(value, _SIZED) and len(value) > RENDER_SIZE:
        raise _too_big(f"a {type(value).__name__} value")
    return value


def _check_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Arguments no template needs: an integer past :data:`RENDER_SIZE` (a width or count:
    ``center``, ``ljust``, ``indent``, ``%*d``) or a value past it (a doubling macro)."""
    for value in (*args, *kwargs.values()) if kwargs else args:
        if type(value) is int:
            if abs(value) > RENDER_SIZE:
                raise RenderStopped(f"an integer argument of {value:,}: past the chat template's bound of {RENDER_SIZE:,}")
        elif isinstance(value, _SIZED) and len(value) > RENDER_SIZE:
            raise _too_big(f"a {type(value).__name__} argument")


def _check_format(fmt: Any) -> None:
    wide = _WIDE_FIELD.search(fmt) if isinstance(fmt, str) else None
    if wide is not None:
        raise RenderStopped(f"a format field {wide[0]} wide: past the chat template's bound")


def _format_filter(fmt: Any, *args: Any, **kwargs: Any) -> None:
    _check_format(fmt)


def _replaced_size(text: Any, old: Any = "", new: Any = "", count: Any = -1) -> None:
    """A ``replace`` whose result would pass :data:`RENDER_SIZE`, refused before it is built."""
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        n = text.count(old)
        if type(count) is int and count >= 0:
            n = min(n, count)
        if len(text) + n * (len(new) - len(old)) > RENDER_SIZE:
            raise _too_big("a replace")


def _joined_size(items: Any, sep: Any = "", *args: Any, **kwargs: Any) -> None:
    """A ``join`` of many items with a long separator, refused before it is built."""
    if isinstance(sep, str) and isinstance(items, _SIZED) and len(items) * len(sep) > RENDER_SIZE:
        raise _too_big("a join")


def _indented_size(text: Any, width: Any = 4, *args: Any, **kwargs: Any) -> None:
    """An ``indent`` of many lines with a long prefix, refused before it is built."""
    prefix = width if isinstance(width, str) else kwargs.get("width")
    if isinstance(text, str) and isinstance(prefix, str) and (text.count("\n") + 1) * len(prefix) > RENDER_SIZE:
        raise _too_big("an indent")


def _wrapped_size(text: Any, width: Any = 79, long_words: Any = True, wrap: Any = None, *args: Any,
                  **kwargs: Any) -> None:
    """A ``wordwrap`` with a long line separator (at most a line a character), refused first."""
    wrap = kwargs.get("wrapstring", wrap)
    if isinstance(text, str) and isinstance(wrap, str) and len(text) * (1 + len(wrap)) > RENDER_SIZE:
        raise _too_big("a wordwrap")


#: The filters (and ``str`` methods of the same name) that can build far more than they are
#: given, each with a check of the size it would build, run before it.
_PRECHECKS: dict[str, Callable[..., None]] = {
    "format": _format_filter, "replace": _replaced_size, "join": _joined_size, "indent": _indented_size,
    "wordwrap": _wrapped_size,
}


class _Budget(threading.local):
    """What the render running on this thread has used of :data:`RANGE_ITEMS`."""

    range_items = 0


_BUDGET = _Budget()


def _bounded_range(*args: int) -> range:
    items = safe_range(*args)  # at most 100,000 a call, as in transformers' sandbox
    _BUDGET.range_items += len(items)
    if _BUDGET.range_items > RANGE_ITEMS:
        raise RenderStopped(f"range: more than {RANGE_ITEMS:,} items in one render (the chat template's bound)")
    return items


class _BoundedNamespace(Namespace):
    """``namespace()``, whose attributes hold no value past :data:`RENDER_SIZE` (a loop that
    doubles ``ns.text`` would otherwise grow it until memory runs out)."""

    def __setitem__(self, name: str, value: Any) -> None:
        super().__setitem__(name, _check_size(value))


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with the one-step amplifiers bounded: ``*`` of a sequence,
    ``**`` of integers, ``%`` and ``str.format`` field widths, width and count arguments,
    ``replace``, and every call's arguments and result (a macro that doubles its argument)."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and type(n) is int and len(seq) * n > RENDER_SIZE:
                    raise _too_big("a repeated value")
        elif operator == "**":
            if type(left) is int and type(right) is int and right > 0 and right * abs(left).bit_length() > POWER_BITS:
                raise RenderStopped(f"{left} ** {right}: past {POWER_BITS:,} bits (the chat template's bound)")
        elif isinstance(left, str):  # %: string formatting
            _check_format(left)
            _check_args(right if isinstance(right, tuple) else (right,), {})
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - as the sandbox names them
        if args or kwargs:
            _check_args(args, kwargs)
        name = getattr(__obj, "__name__", None)
        if name in ("format", "format_map"):  # the sandbox's wrapper of str.format: the string it formats
            _check_format(getattr(getattr(__obj, "__wrapped__", None), "__self__", None))
        elif name in ("replace", "join") and isinstance(text := getattr(__obj, "__self__", None), str):
            if name == "replace":
                _replaced_size(text, *args, **kwargs)
            elif args:  # sep.join(items)
                _joined_size(args[0], text)
        return _check_size(super().call(__context, __obj, *args, **kwargs))


def _bounded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a filter) with its arguments and result held to :data:`RENDER_SIZE`, and what
    it would build checked before it runs where it can build far more (:data:`_PRECHECKS`).
    The filter's own attributes (how Jinja passes it the context) are kept."""
    before = _PRECHECKS.get(name)
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # the context Jinja passes first

    @functools.wraps(fn)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_args(args, kwargs)
        if before is not None:
            before(*args[skip : skip + 4], **kwargs)
        return _check_size(fn(*args, **kwargs))

    return bounded


class _Overtime(RenderStopped):
    def __init__(self) -> None:
        super().__init__(f"rendering took more than {RENDER_SECONDS:g} s (the chat template's bound)")


#: Whether a render on the main thread is under its timer now (the handler raises only then).
_timed = False
#: When the render under the timer must end, and whether one of its ticks may still be on
#: its way after it ended (it ran to its time).
_ends = 0.0
_late = False


def _on_alarm(signum: int, frame: Any) -> None:
    """Stop the render under the timer; ignore a tick that was on its way when a late
    render ended; any other alarm has SIGALRM's own default (the process ends), as if this
    handler, which stays once set, were not there."""
    global _late
    if _timed:
        raise _Overtime
    if _late:
        _late = False
        return
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGALRM)


def _arm(seconds: float) -> bool:
    """Raise :class:`_Overtime` after ``seconds`` (and every 50 ms after, in case the
    template's code swallowed one), by SIGALRM, if it can: where the platform has it, on
    the main thread, and only when nothing else uses it (a user's handler or running timer
    is left as it was). The handler, once set, stays: setting it costs more than a render.
    True when armed; :func:`_disarm` after."""
    global _timed, _ends, _late
    if _timed or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGALRM)
    if handler is not _on_alarm and handler != signal.SIG_DFL:
        return False
    if handler is not _on_alarm:
        signal.signal(signal.SIGALRM, _on_alarm)
    _timed, _late, _ends = True, False, time.monotonic() + seconds
    before = signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
    if before[0]:  # someone's timer was running: put it back as it was, its alarm as it was
        signal.setitimer(signal.ITIMER_REAL, *before)
        _timed = False
        if handler is not _on_alarm:
            signal.signal(signal.SIGALRM, handler)
        return False
    return True


def _disarm() -> None:
    """Stop the timer, then the handler's raising (a tick already on its way may still
    raise here: the render did run to its time)."""
    global _timed, _late
    try:
        signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        _timed = False
        _late = time.monotonic() >= _ends


def render(template: jinja2.Template, context: Mapping[str, Any]) -> str:
    """``template.render(**context)`` under the bounds: its output counted as it is
    written (an item a piece, so empty pieces count too), the run timed."""
    pieces: list[str] = []
    size = 0
    _BUDGET.range_items = 0
    armed = _arm(RENDER_SECONDS)
    try:
        for piece in template.generate(**context):
            size += len(piece) + 1
            if size > RENDER_SIZE:
                raise _too_big("the rendered prompt")
            pieces.append(piece)
    finally:
        if armed:
            _disarm()
    return "".join(pieces)


def environment(filters: Mapping[str, Callable[..., Any]], globals_: Mapping[str, Any],
                **options: Any) -> jinja2.Environment:
    """The bounded sandbox with these filters and globals added (``options`` as Jinja's),
    every filter held to the bounds."""
    env = _BoundedEnvironment(**options)
    env.filters.update(filters)
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals.update(globals_, range=_bounded_range, namespace=_BoundedNamespace)
    return env
