"""One render of a chat template, bounded: transformers' immutable sandbox, plus bounds.

A template is code from a folder or the Hub, run on every record. transformers leaves
it unbounded; here a template that loops without end, multiplies or doubles a value past
any prompt's size stops with :class:`RenderStopped` (its render, not the run or the
machine): a time limit (:data:`RENDER_SECONDS`, by SIGALRM), a size for every value it
builds (by an operator, a call, a filter, a block or ``~``) and for what it writes
(:data:`RENDER_SIZE`), checked before building wherever one step can build far more than
it is given (``*``, format widths, ``replace``, ``join``...: C code no timer stops), a
``range`` budget (:data:`RANGE_ITEMS`), and integer ``*`` and ``**`` up to
:data:`POWER_BITS`. Integers are data (ids, timestamps): only those a step uses as a
width or count are bounded. Within the bounds, what a template writes is what the
unbounded sandbox writes.

What no check of one value sees, a value printed that holds many references to one long
text (a list doubled by ``+`` 17 times, printed: 131,072 copies), is bounded by memory:
where the process runs only the render's thread, its address space may grow by at most
:data:`RENDER_MEMORY` while the render runs (Linux; a cap is the process's, so with
other threads it is not set).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import signal
import string
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import Namespace

resource: ModuleType | None
try:
    import resource
except ImportError:  # not on Windows: no memory cap there
    resource = None

__all__ = ["POWER_BITS", "RANGE_ITEMS", "RENDER_MEMORY", "RENDER_SECONDS", "RENDER_SIZE", "RenderStopped", "environment",
           "render"]


class RenderStopped(Exception):
    """A render went past one of its bounds (the message says which)."""


#: The longest one render may run (where a timer can stop it: in the main thread, with
#: SIGALRM free); real renders take milliseconds, a long agent history well under a second.
RENDER_SECONDS = 10.0
#: The most characters (or items) one value a template builds, or its whole output, may
#: hold; a prompt of a million tokens is a few million characters.
RENDER_SIZE = 64 << 20
#: The most ``range`` items one render may ask for, all calls together (Jinja's sandbox
#: bounds one call to 100,000; nested, they multiply), and the most items one filter may
#: make from a count (``batch``'s fill, ``slice``).
RANGE_ITEMS = 10_000_000
#: The largest integer ``*`` or ``**`` may compute, in bits (C-level arithmetic no timer stops).
POWER_BITS = 1 << 16
#: The most address space one render may add (where it can be capped, see the module's
#: doc): a value of :data:`RENDER_SIZE` characters takes up to 256 MiB, a few of them fit.
RENDER_MEMORY = 2 << 30
#: The widest ``tojson`` indent or separator (a template's are a few characters).
JSON_INDENT = 1024
#: The most paragraphs of ``lipsum`` one call may write.
LIPSUM_PARAGRAPHS = 10_000

#: A printf-style conversion's width and precision (``%-10.3f``, ``%*d``).
_PRINTF_FIELD = re.compile(r"%%|%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")  # %%: a literal %
_DIGITS = re.compile(r"\d+")


def _too_big(what: str) -> RenderStopped:
    return RenderStopped(f"{what}: more than {RENDER_SIZE:,} characters or items (the chat template's bound)")


#: What a size bound applies to.
_SIZED = (str, list, tuple, dict)


def _check_size(value: Any) -> Any:
    if isinstance(value, _SIZED) and len(value) > RENDER_SIZE:
        raise _too_big(f"a {type(value).__name__} value")
    return value


def _check_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """No argument past :data:`RENDER_SIZE` (a macro that doubles its argument stops at the
    first one past it)."""
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, _SIZED) and len(value) > RENDER_SIZE:
            raise _too_big(f"a {type(value).__name__} argument")


def _text_size(seq: str | list[Any] | tuple[Any, ...]) -> int:
    """A sequence's items, and for a list its strings' characters too: ``[s] * 40`` is 40
    references to one text, and 40 copies of it once printed or joined."""
    if isinstance(seq, str):
        return len(seq)
    return len(seq) + sum(len(x) for x in seq if isinstance(x, str))


def _translated_size(text: Any, table: Any = None, *args: Any, **kwargs: Any) -> None:
    """``translate`` with a table mapping a character to a long text, refused first."""
    if isinstance(text, str) and isinstance(table, Mapping):
        longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
        if len(text) * longest > RENDER_SIZE:
            raise _too_big("a translate")


def _ints(values: Any) -> int:
    """The sum of the integers among ``values`` (a ``*`` width or precision takes one)."""
    items = values if isinstance(values, (tuple, list)) else values.values() if isinstance(values, Mapping) else (values,)
    return sum(abs(v) for v in items if type(v) is int)


def _printf_size(fmt: Any, args: Any) -> None:
    """``fmt % args`` refused before it is built when its fields' widths and precisions
    (``*`` ones taken from ``args``) add up past :data:`RENDER_SIZE`."""
    if not isinstance(fmt, str) or "%" not in fmt:
        return
    total, star = 0, False
    for m in _PRINTF_FIELD.finditer(fmt):
        for part in m.groups():
            if part == "*":
                star = True
            elif part:
                total += int(part)
    if star:
        total += _ints(args)
    if total > RENDER_SIZE:
        raise _too_big("a %-format")


def _format_size(fmt: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """``fmt.format(...)`` likewise: the widths and precisions of its fields, nested
    ``{}`` ones taken from the arguments."""
    if not isinstance(fmt, str) or "{" not in fmt:
        return
    total, nested = 0, False
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:  # malformed: format() itself says so
        return
    for _, _, spec, _ in fields:
        if spec:
            total += sum(int(d) for d in _DIGITS.findall(spec))
            nested = nested or "{" in spec
    if nested:
        total += _ints(args) + _ints(kwargs)
    if total > RENDER_SIZE:
        raise _too_big("a str.format")


def _replaced_size(text: Any, old: Any = "", new: Any = "", count: Any = -1, *args: Any, **kwargs: Any) -> None:
    """A ``replace`` whose result would pass :data:`RENDER_SIZE`, refused before it is built."""
    old, new, count = kwargs.get("old", old), kwargs.get("new", new), kwargs.get("count", count)
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        n = text.count(old)
        if type(count) is int and count >= 0:
            n = min(n, count)
        if len(text) + n * (len(new) - len(old)) > RENDER_SIZE:
            raise _too_big("a replace")


def _joined_size(items: Any, sep: Any = "", *args: Any, **kwargs: Any) -> None:
    """A ``join`` whose items and separators add up past :data:`RENDER_SIZE`, refused
    before it is built (items that are not yet a list are counted as they are joined)."""
    sep = kwargs.get("d", sep)
    if isinstance(sep, str) and isinstance(items, (list, tuple)):
        total = len(sep) * max(0, len(items) - 1) + sum(len(x) for x in items if isinstance(x, str))
        if total > RENDER_SIZE:
            raise _too_big("a join")


def _padded_size(text: Any, width: Any = 0, *args: Any, **kwargs: Any) -> None:
    """``center``, ``ljust``, ``rjust``, ``zfill``: the width is the result's size."""
    width = kwargs.get("width", width)
    if type(width) is int and width > RENDER_SIZE:
        raise _too_big(f"a width of {width:,}")


def _tabbed_size(text: Any, tabsize: Any = 8, *args: Any, **kwargs: Any) -> None:
    tabsize = kwargs.get("tabsize", tabsize)
    if isinstance(text, str) and type(tabsize) is int and len(text) + text.count("\t") * tabsize > RENDER_SIZE:
        raise _too_big("an expandtabs")


def _indented_size(text: Any, width: Any = 4, *args: Any, **kwargs: Any) -> None:
    """An ``indent`` of many lines with a long prefix, refused before it is built."""
    width = kwargs.get("width", width)
    prefix = width if isinstance(width, str) else width if type(width) is int else 0
    size = len(prefix) if isinstance(prefix, str) else prefix
    if isinstance(text, str) and len(text) + (text.count("\n") + 1) * size > RENDER_SIZE:
        raise _too_big("an indent")


def _wrapped_size(text: Any, width: Any = 79, long_words: Any = True, wrap: Any = None, *args: Any,
                  **kwargs: Any) -> None:
    """A ``wordwrap`` with a long line separator (at most a line a character), refused first."""
    wrap = kwargs.get("wrapstring", wrap)
    if isinstance(text, str) and isinstance(wrap, str) and len(text) * (1 + len(wrap)) > RENDER_SIZE:
        raise _too_big("a wordwrap")


def _counted(count: Any, what: str) -> None:
    if type(count) is int and count > RANGE_ITEMS:
        raise RenderStopped(f"{what} of {count:,}: past {RANGE_ITEMS:,} items (the chat template's bound)")


def _batch_size(items: Any, linecount: Any = 1, fill_with: Any = None, *args: Any, **kwargs: Any) -> None:
    if kwargs.get("fill_with", fill_with) is not None:  # the last batch is filled up to the count
        _counted(kwargs.get("linecount", linecount), "a batch")


def _slice_size(items: Any, slices: Any = 1, *args: Any, **kwargs: Any) -> None:
    _counted(kwargs.get("slices", slices), "a slice into parts")


def _json_size(value: Any, *args: Any, **kwargs: Any) -> None:
    """``tojson``'s indent and separators are written once a line and item."""
    indent, separators = kwargs.get("indent"), kwargs.get("separators")
    if len(args) > 1:
        indent = args[1]
    if len(args) > 2:
        separators = args[2]
    widths = [indent if type(indent) is int else len(indent) if isinstance(indent, str) else 0]
    if isinstance(separators, (tuple, list)):
        widths += [len(s) for s in separators if isinstance(s, str)]
    if max(widths) > JSON_INDENT:
        raise RenderStopped(f"tojson with an indent or separator of {max(widths):,} characters: past "
                            f"{JSON_INDENT:,} (the chat template's bound)")


#: The filters that can build far more than they are given (or, ``sum`` of sequences,
#: take time no timer stops), each with a check of what it would build, run before it;
#: with the value filtered first (the context Jinja passes is left out).
_FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "format": lambda fmt, *args, **kwargs: _printf_size(fmt, args or kwargs), "replace": _replaced_size,
    "join": _joined_size, "indent": _indented_size, "wordwrap": _wrapped_size, "center": _padded_size,
    "batch": _batch_size, "slice": _slice_size, "tojson": _json_size,
}
#: The same for ``str`` methods, by name.
_METHOD_CHECKS: dict[str, Callable[..., None]] = {
    "replace": _replaced_size, "center": _padded_size, "ljust": _padded_size, "rjust": _padded_size,
    "zfill": _padded_size, "expandtabs": _tabbed_size, "translate": _translated_size,
}


def _summed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The ``sum`` filter, refusing a sum of sequences (``start=[]``) whose result passes
    :data:`RENDER_SIZE` or whose copying (each step copies all before it: quadratic, in C,
    where no timer stops it) passes it too."""

    @functools.wraps(fn)
    def summed(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        if isinstance(start, _SIZED):
            iterable = list(iterable)
            total = len(start) + sum(len(x) for x in iterable if isinstance(x, _SIZED))
            if total > RENDER_SIZE or len(iterable) * total > RENDER_SIZE:
                raise _too_big("a sum of sequences (its copying)")
        return fn(environment, iterable, attribute, start)

    return summed


def _bounded_lipsum(env: jinja2.Environment) -> Callable[..., Any]:
    """Jinja's ``lipsum`` global, at most :data:`LIPSUM_PARAGRAPHS` paragraphs (each one up to
    100 words: ``lipsum(10**7)`` built gigabytes in a loop)."""
    lipsum: Callable[..., Any] = env.globals["lipsum"]  # type: ignore[assignment]  # Jinja's, a function

    @functools.wraps(lipsum)
    def bounded(n: Any = 5, *args: Any, **kwargs: Any) -> Any:
        if type(n) is int and n > LIPSUM_PARAGRAPHS:
            raise RenderStopped(f"lipsum of {n:,} paragraphs: past {LIPSUM_PARAGRAPHS:,} (the chat template's bound)")
        return lipsum(n, *args, **kwargs)

    return bounded


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


def _bounded_concat(pieces: Any) -> str:
    """``environment.concat``: what a ``{% set %}`` block, a macro's body or a filter block
    wrote, joined only when it is within :data:`RENDER_SIZE` (an item a piece)."""
    if not isinstance(pieces, list):
        pieces = list(pieces)
    if len(pieces) + sum(map(len, pieces)) > RENDER_SIZE:
        raise _too_big("a block's text")
    return "".join(pieces)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with each ``~`` concatenation's result checked (it compiles to
    a join of its own, which neither a binary operator nor ``concat`` sees)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_size(")
        super().visit_Concat(node, frame)
        self.write(")")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with what can build far more than it is given bounded: ``*``
    and ``+`` of sequences, ``*`` and ``**`` of integers, ``%`` and ``str.format`` widths,
    the amplifying ``str`` methods and filters, every call's arguments and result (a
    macro that doubles its argument), what blocks and ``~`` join."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _BoundedCodeGenerator
    concat = staticmethod(_bounded_concat)  # Jinja's is "".join

    @staticmethod
    def checked_size(value: Any) -> Any:
        return _check_size(value)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":  # templates build their text with it: the common case first, and cheap
            if isinstance(left, _SIZED) and isinstance(right, _SIZED) and len(left) + len(right) > RENDER_SIZE:
                raise _too_big("a sum of two values")
            return left + right
        if operator == "*":
            if type(left) is int and type(right) is int:
                if left.bit_length() + right.bit_length() > POWER_BITS:
                    raise RenderStopped(f"a product past {POWER_BITS:,} bits (the chat template's bound)")
            else:
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and type(n) is int and n > 0 and n * _text_size(seq) > RENDER_SIZE:
                        raise _too_big("a repeated value")
        elif operator == "**":
            if (type(left) is int and type(right) is int and right > 0 and abs(left) > 1
                    and right * abs(left).bit_length() > POWER_BITS):  # 1 ** n and (-1) ** n stay small
                raise RenderStopped(f"{left} ** {right}: past {POWER_BITS:,} bits (the chat template's bound)")
        else:  # %: string formatting (or a remainder)
            _printf_size(left, right)
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - as the sandbox names them
        if args or kwargs:
            _check_args(args, kwargs)
        name = getattr(__obj, "__name__", None)
        if name in ("format", "format_map"):  # the sandbox's wrapper of str.format: the string it formats
            fmt = getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
            _format_size(fmt, args, args[0] if name == "format_map" and args else kwargs)
        elif isinstance(text := getattr(__obj, "__self__", None), str):
            if name == "join" and args:  # sep.join(items)
                _joined_size(args[0], text)
            elif name in _METHOD_CHECKS:
                _METHOD_CHECKS[name](text, *args, **kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))


def _bounded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a filter) with its arguments and result held to :data:`RENDER_SIZE`, and what
    it would build checked before it runs where it can build far more (:data:`_FILTER_CHECKS`).
    The filter's own attributes (how Jinja passes it the context) are kept."""
    if name == "sum":
        fn = _summed(fn)
    before = _FILTER_CHECKS.get(name)
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # the context Jinja passes first

    @functools.wraps(fn)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_args(args, kwargs)
        if before is not None:
            before(*args[skip:], **kwargs)
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


def _can_arm() -> bool:
    """Whether a render here may be timed by SIGALRM: the platform has it, this is the main
    thread, and nothing else uses it (a user's handler or running timer is left as it was).
    Sets the handler the first time; it stays (setting it costs more than a render)."""
    if _timed or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGALRM)
    if handler is not _on_alarm:
        if handler != signal.SIG_DFL or signal.getitimer(signal.ITIMER_REAL)[0]:
            return False
        signal.signal(signal.SIGALRM, _on_alarm)
    return not signal.getitimer(signal.ITIMER_REAL)[0]


def _start(seconds: float) -> None:
    """Raise :class:`_Overtime` after ``seconds``, and every 50 ms after (in case the
    template's code swallowed one)."""
    global _timed, _ends, _late
    _timed, _late, _ends = True, False, time.monotonic() + seconds
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)


def _disarm() -> None:
    """Stop the timer, then the handler's raising (a tick already on its way may still
    raise here: the render did run to its time)."""
    global _timed, _late
    try:
        signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        _timed = False
        _late = time.monotonic() >= _ends


def _mapped() -> int | None:
    """The bytes of address space this process maps now, where it runs one thread only
    (Linux's ``/proc/self/stat``); else None."""
    try:
        fd = os.open("/proc/self/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    fields = stat.rpartition(b")")[2].split()  # after the command's name, which may hold anything
    try:  # fields 20 and 23 of proc(5): num_threads, vsize
        return int(fields[20]) if int(fields[17]) == 1 else None
    except (IndexError, ValueError):
        return None


def _memory_cap() -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(the address-space limits now, the cap for a render: what is mapped now plus
    :data:`RENDER_MEMORY`), where this is the process's only thread and no tighter cap is
    set; else None. Nothing is set here."""
    mapped = _mapped()
    if mapped is None or resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + RENDER_MEMORY
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        return None
    return (soft, hard), (cap, hard)


def render(template: jinja2.Template, context: Mapping[str, Any]) -> str:
    """``template.render(**context)`` under the bounds: its output counted as it is
    written (an item a piece, so empty pieces count too), the run timed, its memory capped."""
    pieces: list[str] = []
    size = 0
    _BUDGET.range_items = 0
    armed = False
    limits = _memory_cap()
    try:
        if limits is not None and resource is not None:  # before the timer: no tick lands before the clean-up's try
            resource.setrlimit(resource.RLIMIT_AS, limits[1])
        if _can_arm():
            armed = True  # before the timer runs: from here on, whatever raises, it is stopped below
            _start(RENDER_SECONDS)
        written = template.generate(**context)
        while batch := list(itertools.islice(written, 1024)):  # counted a batch at a time: cheaper than a piece
            size += len(batch) + sum(map(len, batch))
            if size > RENDER_SIZE:
                raise _too_big("the rendered prompt")
            pieces += batch
    except MemoryError:
        if limits is None:
            raise
        pieces.clear()
        raise RenderStopped(f"rendering took more than {RENDER_MEMORY >> 20:,} MiB of memory "
                            "(the chat template's bound)") from None
    finally:
        try:
            while armed:  # a tick may land before (or in) the disarming: it raised; disarm again
                try:
                    _disarm()
                    armed = False
                except _Overtime:
                    pass
        finally:  # whatever else lands there (Ctrl-C), the cap is lifted
            if limits is not None and resource is not None:
                resource.setrlimit(resource.RLIMIT_AS, limits[0])
    return "".join(pieces)


def environment(filters: Mapping[str, Callable[..., Any]], globals_: Mapping[str, Any],
                **options: Any) -> jinja2.Environment:
    """The bounded sandbox with these filters and globals added (``options`` as Jinja's),
    every filter held to the bounds."""
    env = _BoundedEnvironment(**options)
    env.filters.update(filters)
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals.update(globals_, range=_bounded_range, namespace=_BoundedNamespace, lipsum=_bounded_lipsum(env))
    return env
