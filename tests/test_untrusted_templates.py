"""Chat templates are untrusted programs (a GGUF's template comes from the file): every render is bounded.

A template that runs away at load is refused with one line and exit 2; one that
runs away on a certain message gives that request a 400, leaves no worker
thread behind, and other requests keep answering.
"""

from __future__ import annotations

import concurrent.futures
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lucebox.chat.template import ChatTemplate, TemplateError, TemplateLimitError
from tests.test_api_info import call

ROOT = Path(__file__).resolve().parents[1]
NESTED_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"

# Each of these runs for hours or builds gigabytes without the bounds.
ATTACKS = {
    "nested_range": NESTED_LOOP + "x",
    "nested_empty_loops": "{% set x = range(100000)|list %}{%- for a in x -%}{%- for b in x -%}{%- endfor -%}"
                          "{%- endfor -%}",
    "repeat": "{{ 'a'*10**8 }}",
    "list_repeat": "{{ ([1]*10**9)|length }}",
    "power": "{{ 2**(10**10) }}",
    "concat_chain": "{% set a = 'x' * 4000000 %}{% set b = a~a %}{% set c = b~b %}{% set d = c~c %}{{ d|length }}",
    "namespace_doubling": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s|length }}",
    "plus_doubling": "{% set ns = namespace(s=['ab']) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}{{ ns.s|length }}",
    "center_method": "{{ 'a'.center(10**9) }}",
    "center_filter": "{{ 'a'|center(10**9) }}",
    "format_width": "{{ '{:>1000000000}'.format(1) }}",
    "format_fields": "{% set s = 'y' * 1000000 %}{{ ('{0}' * 100000).format(s)|length }}",
    "percent_width": "{{ '%1000000000d' % 1 }}",
    "format_filter": "{{ '%1000000000d'|format(1) }}",
    "replace": "{% set s = 'a' * 1000000 %}{{ s.replace('a', s)|length }}",
    "replace_filter": "{% set s = 'a' * 1000000 %}{{ s|replace('a', s)|length }}",
    "join": "{% set s = 'a' * 1000000 %}{{ s.join(range(10000)|map('string'))|length }}",
    "indent": "{% set s = '\n' * 1000000 %}{{ s|indent('        ' * 100)|length }}",
    "wordwrap": "{% set s = 'a ' * 1000000 %}{{ s|wordwrap(1, true, 'x' * 1000)|length }}",
    "lipsum": "{{ lipsum(1000000) }}",
    "output": "{% for i in range(100000) %}{% for j in range(100) %}{{ 'a' * 1000 }}{% endfor %}{% endfor %}",
    "macro_fanout": "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}x{% endmacro %}{{ f(40) }}",
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_runaway_template_fails_inside_the_render(name: str) -> None:
    """Each attack stops within the deadline, with a one-line TemplateLimitError and no big allocation."""
    template = ChatTemplate(ATTACKS[name], origin="gguf")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(TemplateLimitError) as err:
        template.render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < template.limits.seconds + 2
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024 < 400 << 20  # peak grew < 400 MB
    message = str(err.value)
    assert message.startswith("chat template (gguf) is too costly to render: ") and "\n" not in message


def test_bounds_leave_ordinary_templates_alone() -> None:
    """Operators, loops, concatenation and filters still give what jinja gives, within the bounds."""
    src = ("{{ 'ab' * 3 }}|{{ [1, 2] + [3] }}|{{ '%s-%03d' % ('a', 7) }}|{{ 'x' ~ 1 ~ none }}|{{ 2 ** 10 }}|"
           "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ ',' if not loop.last }}{% endfor %}|"
           "{{ messages | map(attribute='content') | join(' ') | upper | center(11) }}|{{ 'a-b'.replace('-', '+') }}|"
           "{{ '{}={}'.format('k', 2) }}|{{ 'l1\nl2' | indent(2) }}|{{ [3, 1, 2] | sort | join }}")
    got = ChatTemplate(src).render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert got == "ababab|[1, 2, 3]|a-007|x1None|1024|1/2,2/2|   HI YO   |a+b|k=2|l1\n  l2|123"


def test_large_ordinary_conversation_renders() -> None:
    """The bounds grow with the input: a long conversation through a real template is not refused."""
    src = (Path(__file__).parent / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    chat = [{"role": r, "content": f"message {i} " * 500} for i in range(1000) for r in ("user", "assistant")]
    text = ChatTemplate(src).render(chat)
    assert len(text) > 8 << 20 and "message 999" in text


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lucebox", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.mark.parametrize(("attack", "where"), [("nested_range", "gguf"), ("repeat", "file"),
                                               ("namespace_doubling", "gguf")])
def test_serve_refuses_a_runaway_template_at_load(tiny_gguf, tmp_path, attack: str, where: str) -> None:
    """`serve` exits 2 with one error line in bounded time (it stayed "loading" forever, or was OOM-killed)."""
    if where == "gguf":
        model = tiny_gguf("llama", "Q8_0", chat_template=ATTACKS[attack])
        extra: tuple[str, ...] = ()
    else:
        model = tiny_gguf("llama", "Q8_0")
        (tmp_path / "t.jinja").write_text(ATTACKS[attack])
        extra = ("--chat-template-file", str(tmp_path / "t.jinja"))
    start = time.monotonic()
    done = run_cli("serve", "--model", str(model), "--port", "0", "--device", "cpu", *extra)
    assert time.monotonic() - start < 60
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("lucebox: error: chat template"), done.stderr[-2000:]
    assert "too costly to render" in errors[0] and "--chat-template-file" in errors[0]


# A ChatML template that runs away only when a message says "boom".
BOOM = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
        "{%- if m.content == 'boom' %}" + NESTED_LOOP + "{% endif %}{% endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def boom_server(tiny_gguf):
    from tests.live_server import start_server

    server = start_server(tiny_gguf("llama", "Q8_0", chat_template=BOOM), kv_tokens=2048)
    yield server
    server.stop()


def _rendering_threads() -> list[str]:
    """Names of threads whose stack is inside a chat template render right now."""
    frames = sys._current_frames()
    busy = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident)
        while frame is not None:
            if frame.f_code.co_name == "_render" and frame.f_code.co_filename.endswith("template.py"):
                busy.append(thread.name)
                break
            frame = frame.f_back
    return busy


def test_template_runaway_on_one_message_is_a_400_and_pins_no_thread(boom_server) -> None:
    url = boom_server.url
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    boom = {"messages": [{"role": "user", "content": "boom"}], "max_tokens": 2}
    assert call(url, "POST", "/v1/chat/completions", chat).status == 200
    counts = []
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        for _ in range(2):  # two rounds: the second must not add threads (none left behind by the first)
            booms = [pool.submit(call, url, "POST", "/v1/chat/completions", boom) for _ in range(8)]
            booms.append(pool.submit(call, url, "POST", "/v1/messages", {**boom, "model": "m"}))
            # Meanwhile the server keeps answering (6 pinned workers stopped chat and /tokenize).
            assert call(url, "POST", "/tokenize", {"content": "hello"}, timeout=30).status == 200
            assert call(url, "POST", "/v1/chat/completions", chat, timeout=30).status == 200
            replies = [f.result(timeout=60) for f in booms]
            counts.append(threading.active_count())
            for reply in replies[:-1]:
                assert reply.status == 400, reply.body
                error = reply.json()["error"]
                assert error["type"] == "invalid_request_error"
                assert error["message"].startswith("chat template (gguf) is too costly to render")
            anthropic = replies[-1]
            assert anthropic.status == 400 and anthropic.json()["type"] == "error"
            assert anthropic.json()["error"]["type"] == "invalid_request_error"
    assert _rendering_threads() == []
    assert counts[1] <= counts[0]
    assert call(url, "POST", "/v1/chat/completions", chat).status == 200


def test_template_errors_are_one_line_template_errors() -> None:
    """Bad template sources from a file: wrong type, too long, nested past the parser's depth."""
    with pytest.raises(TemplateError, match=r"chat template \(gguf\) is a int, not text"):
        ChatTemplate(7, origin="gguf")  # type: ignore[arg-type]
    with pytest.raises(TemplateError, match="characters long"):
        ChatTemplate("x" * (2 << 20), origin="gguf")
    with pytest.raises(TemplateError) as err:
        ChatTemplate("{{" + "(" * 5000 + "1" + ")" * 5000 + "}}", origin="gguf")
    assert "\n" not in str(err.value)
