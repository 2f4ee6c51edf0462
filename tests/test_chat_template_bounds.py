"""A chat template is code from a folder or the Hub, run on every record: one that loops
without end, multiplies or doubles a value past any prompt's size fails its render with a
TemplateError naming the bound, quickly and without taking the machine's memory, and the
real families' templates write exactly what an unbounded sandbox writes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from test_families_support import SHARED
from tokenbridge.chat import TemplateError
from tokenbridge.chat import sandbox
from tokenbridge.chat import template as T
from tokenbridge.chat.template import template_renderer

HI = [{"role": "user", "content": " hi "}]


_S = "{% set s = 'x' * 60000000 %}"  # just under the size bound: what the amplifiers below start from


@pytest.mark.parametrize(("source", "message"), [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "range: more than 10,000,000 items in one render"),
    # a capture block keeps what the loops write away from the output's count
    ("{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}xx{% endfor %}{% endfor %}{% endset %}",
     "range: more than 10,000,000 items"),
    ("{{ 'x' * 10000000000 }}", "a repeated value: more than 67,108,864"),
    ("{{ 10000000000 * ['x'] }}", "a repeated value"),
    ("{{ 2 ** 1000000000 }}", r"2 \*\* 1000000000: past 65,536 bits"),
    ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "a product past 65,536 bits"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "a str value: more than 67,108,864"),
    ("{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('x', 80) }}",
     "a str value: more than 67,108,864"),
    ("{% for i in range(100000) %}{% for j in range(100) %}{{ 'x' * 10000 }}{% endfor %}{% endfor %}",
     "the rendered prompt: more than 67,108,864"),
    ("{% for i in range(100000) %}{% for j in range(100) %}{{ '' }}{% endfor %}{% endfor %}",
     "range: more than"),
    # a cold reviewer's escapes: doubling by + and ~ outside a loop, a join of long items,
    # expandtabs, a capture block, widths adding up, a quadratic sum in C
    (_S + "{% set b = s + s %}{% set c = b + b %}{{ c|length }}", "a sum of two values: more than"),
    (_S + "{% set b = s ~ s %}{% set c = b ~ b %}{{ c|length }}", "a str value: more than"),
    (_S + "{{ [s, s, s]|join|length }}", "a join: more than"),
    (_S + "{{ ('-').join([s, s, s])|length }}", "a join: more than"),
    ("{{ ('\t' * 1000).expandtabs(60000000)|length }}", "an expandtabs: more than"),
    (_S + "{% set t %}{% for i in range(40) %}{{ s }}{% endfor %}{% endset %}{{ t|length }}",
     "a block's text: more than"),
    (_S + "{% macro m() %}{% for i in range(40) %}{{ s }}{% endfor %}{% endmacro %}{{ m()|length }}",
     "a block's text: more than"),
    ("{{ ('{:60000000}' * 40).format(*([1] * 40)) }}", "a str.format: more than"),
    ("{{ ('%60000000d' * 40) % ((1,) * 40) }}", "a %-format: more than"),
    ("{{ ([[0] * 1000] * 20000)|sum(start=[])|length }}", r"a sum of sequences \(its copying\): more than"),
    ("{{ '{:>999999999}'.format(1) }}", "a str.format: more than"),
    ("{{ '{:{}}'.format(1, 999999999) }}", "a str.format: more than"),
    ("{{ '{0:>999999999}'.format_map({}) }}", "a str.format: more than"),
    ("{{ '%999999999d' % 1 }}", "a %-format: more than"),
    ("{{ '%*d' % (999999999, 1) }}", "a %-format: more than"),
    ("{{ '%.999999999f' % 1.5 }}", "a %-format: more than"),
    ("{{ '%999999999d'|format(1) }}", "a %-format: more than"),
    ("{{ 'x'|center(999999999) }}", "a width of 999,999,999: more than"),
    ("{{ 'x'.ljust(999999999) }}", "a width of 999,999,999: more than"),
    ("{{ 'x'.zfill(999999999) }}", "a width of 999,999,999: more than"),
    ("{{ ('x' * 1000000).replace('', 'y' * 1000) }}", "a replace: more than"),
    ("{{ ('x' * 1000000)|replace('', 'y' * 1000) }}", "a replace: more than"),
    ("{{ ('y' * 1000000).join(range(100000)|map('string')|list) }}", "a join: more than"),
    ("{{ range(100000)|list|join('y' * 1000000) }}", "a join: more than"),
    ("{{ ('\n' * 1000000)|indent('y' * 1000, true, true) }}", "an indent: more than"),
    ("{{ ('\n' * 1000000)|indent(1000, true, true) }}", "an indent: more than"),
    ("{{ ('x ' * 1000000)|wordwrap(1, true, 'y' * 100) }}", "a wordwrap: more than"),
    ("{{ [1]|batch(100000000, 'x')|list }}", "a batch of 100,000,000: past 10,000,000 items"),
    ("{{ [1]|slice(100000000)|list }}", "a slice into parts of 100,000,000: past 10,000,000 items"),
    ("{{ {'a': 1}|tojson(indent=100000000) }}", "tojson with an indent or separator of 100,000,000"),
    (_S + "{{ ([s] * 40)|string|length }}", "a repeated value: more than"),  # 40 references, 40 copies printed
    ("{{ ('x' * 1000000).translate({120: 'y' * 1000}) }}", "a translate: more than"),
    ("{{ lipsum(10000000)|length }}", "lipsum of 10,000,000 paragraphs: past 10,000"),
])
def test_a_template_past_a_bound_fails_its_render_quickly(source, message):
    render = template_renderer(source)
    start = time.perf_counter()
    with pytest.raises(TemplateError, match="chat template stopped: " + message):
        render(HI, None, True, {})
    assert time.perf_counter() - start < 30  # each well under a second alone; a hang would be hours


def test_a_template_that_runs_too_long_is_stopped_by_its_timer(monkeypatch):
    monkeypatch.setattr(sandbox, "RENDER_SECONDS", 0.3)
    render = template_renderer("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}")
    start = time.perf_counter()
    with pytest.raises(TemplateError, match=r"rendering took more than 0\.3 s"):
        render(HI, None, True, {})
    assert time.perf_counter() - start < 10
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # disarmed after
    assert template_renderer("{{ messages[0].content }}")(HI, None, True, {}) == " hi "  # the next render runs


def test_the_timer_leaves_a_users_handler_and_timer_alone():
    seen: list[int] = []

    def mine(signum, frame):
        seen.append(signum)

    before = signal.signal(signal.SIGALRM, mine)
    try:
        assert template_renderer("{{ messages[0].content }}")(HI, None, True, {}) == " hi "
        assert signal.getsignal(signal.SIGALRM) is mine
        signal.setitimer(signal.ITIMER_REAL, 2.0)  # longer than a render on a loaded machine
        assert template_renderer("{{ messages[0].role }}")(HI, None, True, {}) == "user"
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 2.0  # still running, not reset
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGALRM]  # the user's handler, not ours
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_a_running_timer_with_the_default_action_is_put_back():
    """A timer whose expiry ends the process (SIGALRM's default) is not ours to take over:
    the render runs untimed and the timer keeps its time."""
    code = ("import signal, time\nfrom tokenbridge.chat.template import template_renderer\n"
            "signal.setitimer(signal.ITIMER_REAL, 30)\n"
            "print(template_renderer('{{ 1 }}')([{'role': 'user', 'content': 'x'}], None, True, {}))\n"
            "left = signal.getitimer(signal.ITIMER_REAL)[0]\nprint(29 < left <= 30)\n"
            "signal.setitimer(signal.ITIMER_REAL, 0.05)\ntime.sleep(5)\nprint('survived')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGALRM, out.stderr  # the default action, as without tokenbridge
    assert out.stdout.split() == ["1", "True"]


def test_a_tick_after_a_late_render_is_ignored_and_any_other_alarm_keeps_its_action():
    code = ("import signal\nfrom tokenbridge.chat import sandbox\n"
            "from tokenbridge.chat.template import TemplateError, template_renderer\n"
            "sandbox.RENDER_SECONDS = 0.2\n"
            "slow = template_renderer(\"{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}"
            "{% endfor %}\")\n"
            "try:\n    slow([{'role': 'user', 'content': 'x'}], None, True, {})\n"
            "except TemplateError as exc:\n    print(exc)\n"
            "signal.raise_signal(signal.SIGALRM)\nprint('a late tick: ignored')\n"
            "print(template_renderer('{{ 1 }}')([{'role': 'user', 'content': 'x'}], None, True, {}))\n"
            "signal.raise_signal(signal.SIGALRM)\nprint('survived')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGALRM, out.stderr
    assert out.stdout.splitlines() == [
        "chat template stopped: rendering took more than 0.2 s (the chat template's bound)", "a late tick: ignored", "1"]


#: Run in a process of its own (one thread: pytest-xdist's workers run others, so no cap is
#: set there), with a safety cap 6 GiB above what it maps, so that a missing bound fails the
#: test with a MemoryError instead of taking the machine's memory.
_CAPPED_RUN = (
    "import resource, threading\nfrom tokenbridge.chat import sandbox\n"
    "from tokenbridge.chat.template import TemplateError, template_renderer\n"
    "resource.setrlimit(resource.RLIMIT_AS, (sandbox._mapped() + (6 << 30), resource.RLIM_INFINITY))\n"
    "sandbox.RENDER_MEMORY = 256 << 20\n"
    "HI = [{'role': 'user', 'content': 'x'}]\n"
    "def run(source):\n"
    "    try:\n        print(len(template_renderer(source)(HI, None, True, {})))\n"
    "    except TemplateError as exc:\n        print(exc)\n"
    "    print(resource.getrlimit(resource.RLIMIT_AS)[0] - sandbox._mapped() > (5 << 30))\n"
)


_LINUX_ONLY = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the memory cap reads /proc (Linux)")


@_LINUX_ONLY
@pytest.mark.parametrize("source", [
    # references to one long text, which no size of one value shows, printed: a list doubled by +,
    "{% set ns = namespace(x=['x' * 1000000]) %}{% for i in range(17) %}{% set ns.x = ns.x + ns.x %}{% endfor %}"
    "{{ ns.x }}",
    # a list of lists joined, and written as JSON
    "{% set s = 'x' * 1000000 %}{% set d = [[s] * 32] * 3000 %}{{ d|join(',') }}",
    "{% set s = 'x' * 1000000 %}{% set d = [[s] * 32] * 3000 %}{{ d|tojson }}",
])
def test_a_render_past_its_memory_stops_and_the_cap_is_lifted_after(source):
    code = _CAPPED_RUN + f"run({source!r})\nrun('{{{{ 1 }}}}')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "chat template stopped: rendering took more than 256 MiB of memory (the chat template's bound)", "True",
        "1", "True"]


@_LINUX_ONLY
def test_no_memory_cap_is_set_while_another_thread_runs():
    """The cap is the process's: another thread's allocation would fail too."""
    code = ("import threading\nfrom tokenbridge.chat import sandbox\n"
            "print(sandbox._memory_cap() is not None)\n"
            "done = threading.Event()\nt = threading.Thread(target=done.wait)\nt.start()\n"
            "print(sandbox._mapped(), sandbox._memory_cap())\n"
            "done.set()\nt.join()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "None", "None"]


def _plain(source: str) -> jinja2.Template:
    """transformers' environment, unbounded."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = T._tojson
    env.globals.update(raise_exception=T._raise_exception, strftime_now=T._strftime_now)
    return env.from_string(source)


def _template(family: str) -> str:
    folder = SHARED / family
    for name in ("chat_template.jinja", "chat_template.kimi-k2-thinking.jinja"):
        if (folder / name).is_file():
            return (folder / name).read_text(encoding="utf-8")
    return json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]


_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather, 天气",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                # big integers are data, not widths (a cold reviewer's: refused)
                                                "order_id": {"type": "integer", "default": 100000000},
                                                "since": {"type": "integer", "default": 1700000000123}},
                                                           "required": ["city"]}}}]
_CONVERSATIONS = [
    [{"role": "system", "content": "Be brief.\n" * 3}, {"role": "user", "content": "Wetter in 東京?"}],
    [{"role": "user", "content": "q1 %d {0} 100%"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
     {"role": "user", "content": "q2\n\n  indented"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "reasoning_content": "call it",
      "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
     {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
     {"role": "user", "content": "thanks"}],
    # arguments as objects, as the templates that iterate them (GLM) take them; big integers in them
    [{"role": "user", "content": "order?"},
     {"role": "assistant", "content": "", "reasoning_content": "look it up",
      "tool_calls": [{"id": "functions.get_weather:1", "type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Oslo", "order_id": 100000000,
                                                                        "since": 1700000000123}}}]},
     {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "cloudy"},
     {"role": "user", "content": "thanks"}],
]


@pytest.mark.parametrize("family", ["kimi-k2.5", "qwen3", "glm-4.5", "deepseek-v3.1", "gpt-oss"])
def test_real_templates_write_what_an_unbounded_sandbox_writes(family):
    source = _template(family)
    plain = _plain(source)
    rendered = 0
    for msgs in _CONVERSATIONS:
        for tools in (None, _TOOLS):
            for thinking in (True, False):
                context = {"thinking": thinking, "enable_thinking": thinking}
                try:
                    theirs = plain.render(messages=msgs, tools=tools, add_generation_prompt=True, **context)
                except Exception as exc:  # the family's template refuses this conversation: so must ours
                    with pytest.raises(TemplateError) as ours:
                        template_renderer(source)(msgs, tools, thinking, {})
                    assert str(exc) in str(ours.value)
                    continue
                assert template_renderer(source)(msgs, tools, thinking, {}) == theirs
                rendered += 1
    assert rendered >= 8


@pytest.mark.parametrize("source", [
    "{{ '%d' % 1700000000 }} {{ 1700000000|string }} {{ 100000000|tojson }} {{ -100000000 }}",
    "{{ 'id 1234567890123: %s' % 'x' }} {{ 'call {0} at 1234567890123'.format('x') }}",
    "{{ '%-10.3f|%5s|%(a)08d' % (1.5, 'x', 3) if false else '%-10.3f|%5s' % (1.5, 'x') }} {{ '{:>10}{:08.3f}'.format(1, 2.5) }}",
    "{{ [[1], [2, 3]]|sum(start=[]) }} {{ [1, 2, 3]|sum }} {{ 'a' + 'b' }} {{ [1] + [2] }} {{ 12345678901234567890 * 3 }}",
    "{{ {'a': [1, {'b': 2}]}|tojson(indent=2) }} {{ 'x'|center(9) }} {{ '\tx'.expandtabs(4) }} {{ ('ab\ncd')|indent(2, true) }}",
    "{% set t %}{% for m in messages %}[{{ m.content ~ '!' }}]{% endfor %}{% endset %}{{ t }}{{ [1, 2, 3]|batch(2, 0)|list }}",
    "{{ 2 ** 64 }} {{ 'ab'.replace('a', 'xyz') }} {{ ','.join(['a', 'b']) }} {{ [1, 2, 3, 4]|slice(2)|list }}",
    "{{ ['ab', 'c'] * 3 }} {{ 'abc'.translate({97: 'xy'}) }} {{ lipsum(2, false, 5, 6)|length > 0 }}",
    "{{ '100%% 123456789012 kids, %s' % 'x' }}",  # %% is a literal percent: what follows is no width
    "{{ 1 ** 100000000 }} {{ (-1) ** 100000001 }} {{ 0 ** 100000000 }}",
])
def test_ordinary_constructs_render_as_the_unbounded_sandbox_renders_them(source):
    """Integers are data (ids, timestamps, defaults), not widths; formats, sums, joins and
    blocks of ordinary size write what they always wrote."""
    assert template_renderer(source)(HI, None, True, {}) == _plain(source).render(
        messages=HI, tools=None, add_generation_prompt=True, thinking=True, enable_thinking=True)


def test_a_folder_whose_template_loops_fails_its_records_by_name(tmp_path):
    """Through the command: each record is a bad line naming the bound; the run ends."""
    folder = tmp_path / "qwen3"
    folder.mkdir()
    for src in (SHARED / "qwen3").iterdir():
        if src.name != "chat_template.jinja":
            (folder / src.name).symlink_to(src)
    (folder / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "request": {"messages": [{"role": "user", "content": "hi"}]},
                               "response": {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}}) + "\n")
    cli = str(Path(sys.executable).with_name("tokenbridge"))
    out = subprocess.run([cli, "reconstruct", str(src), "-o", str(tmp_path / "o.jsonl"), "--tokenizer", str(folder)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert (f"bad record: {src}:1: <record>: TemplateError: chat template stopped: range: more than 10,000,000 "
            "items in one render (the chat template's bound)") in out.stderr


def test_renders_that_end_as_their_time_runs_out_leave_no_timer_and_raise_nothing_after():
    """A tick that landed after the template's last step but before the timer was stopped
    raised in the clean-up: the timer kept running, every later render went untimed, and the
    next tick raised inside code that was no render (a cold reviewer's). Renders whose time
    runs out as they end, over and over: none leaves the timer armed or raises outside."""
    code = ("from tokenbridge.chat import sandbox\n"
            "from tokenbridge.chat.template import TemplateError, template_renderer\n"
            "r = template_renderer('{% for i in range(n) %}{{ i }}{% endfor %}')\n"
            "sandbox.RENDER_SECONDS = 0.001\n"
            "stopped = outside = 0\n"
            "for k in range(4000):\n"
            "    try:\n"
            "        try:\n"
            "            r([{'role': 'user', 'content': 'x'}], None, True, {'n': 500 + k % 9 * 600})\n"
            "        except TemplateError:\n"
            "            stopped += 1\n"
            "        sum(range(300))\n"
            "    except sandbox.RenderStopped:\n"
            "        outside += 1\n"
            "    assert not sandbox._timed, k\n"
            "import signal\n"
            "print(outside, signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), stopped > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "True", "True"]
