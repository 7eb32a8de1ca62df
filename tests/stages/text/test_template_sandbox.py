"""The sandbox that renders requests' own chat templates in child processes: the same text as
rendering in this process, a template past a limit is a ChatTemplateError naming it and its
child is replaced, and a child outlives the thread that started it."""

from __future__ import annotations

import threading
import time

import pytest

from stages.text.chat_template import ChatTemplateError, render_chat
from stages.text.template_sandbox import TemplateSandbox

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}{% endfor %}{{ x }}"


@pytest.fixture
def sandbox():
    sandbox = TemplateSandbox(timeout_s=1.0, memory_bytes=256 << 20)
    yield sandbox
    sandbox.close()


def test_it_renders_what_this_process_renders(sandbox):
    assert sandbox.render(TEMPLATE, MESSAGES, x="!") == render_chat(TEMPLATE, MESSAGES, x="!")
    with pytest.raises(ChatTemplateError, match="rejected the conversation: no"):
        sandbox.render("{{ raise_exception('no') }}", MESSAGES)


def test_a_template_past_a_limit_is_an_error_and_the_next_renders(sandbox):
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="within 1 s"):
        sandbox.render(
            "{% for i in range(100000) %}{% for j in range(30000) %}{% endfor %}{% endfor %}",
            MESSAGES,
        )
    assert time.monotonic() - started < 3
    with pytest.raises(ChatTemplateError, match="more than 256 MiB"):
        sandbox.render("{{ ('%999999999s' % 'a')|length }}", MESSAGES)
    assert sandbox.render(TEMPLATE, MESSAGES, x="") == "<user>HI<assistant>HELLO"
    assert sandbox.num_replaced == 1  # the one killed for its time; memory left its child alive


def test_a_child_outlives_the_thread_that_started_it(sandbox):
    """The kernel's parent-death signal follows the thread that started a child, and render's
    worker threads come and go."""
    worker = threading.Thread(target=sandbox.render, args=(TEMPLATE, MESSAGES))
    worker.start()
    worker.join()
    time.sleep(0.3)
    assert sandbox.render(TEMPLATE, MESSAGES, x="?").endswith("?")
    assert sandbox.num_replaced == 0
