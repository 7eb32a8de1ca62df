"""Chat templates render as transformers renders them, in a sandbox, with clear errors."""

from __future__ import annotations

import os

import pytest

from stages.text.chat_template import ChatTemplateError, render_chat
from stages.text.tokenizer import load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Und 3+3? 😊"},
    ],
]


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf)
    )


@pytest.fixture(scope="module")
def bundle(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(reference, bundle, messages, add_generation_prompt):
    ours = render_chat(
        bundle.chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bundle.bos_token,
        eos_token=bundle.eos_token,
    )
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == expected


def test_raise_exception_becomes_a_chat_template_error():
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    )
    assert render_chat(template, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="user first"):
        render_chat(template, [{"role": "assistant", "content": "x"}])


def test_sandbox_blocks_python_internals():
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(ChatTemplateError, match="compile"):
        render_chat("{% if %}", [])


def test_tojson_keeps_unicode_and_html():
    out = render_chat("{{ tools | tojson }}", [], tools=[{"name": "<b>é</b>"}])
    assert out == '[{"name": "<b>é</b>"}]'


def test_tool_call_arguments_reach_the_template_as_objects():
    """The wire carries an assistant's tool-call arguments as JSON text; templates index them
    (`tool_call.arguments.city`) or `tojson` them, so they are parsed first, as vLLM does."""
    from stages.text.chat import render_chat as render_request

    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}({{ c.function.arguments.city }}|{{ c.function.arguments | tojson }})"
        "{% endfor %}{% endfor %}"
    )
    call = {
        "id": "1",
        "type": "function",
        "function": {"name": "w", "arguments": '{"city": "Oslo"}'},
    }
    broken = {"id": "2", "type": "function", "function": {"name": "v", "arguments": "{oops"}}
    text = render_request(
        template,
        [{"role": "assistant", "content": None, "tool_calls": [call, broken]}],
        add_generation_prompt=False,
    )
    assert text == 'w(Oslo|{"city": "Oslo"})v(|"{oops")'


@pytest.mark.parametrize("content", [{"content": None}, {}], ids=["null", "missing"])
def test_a_tool_call_turn_without_content_reaches_the_template_as_empty_text(content):
    """The OpenAI SDK sends an assistant's tool-call turn back with `"content": null`; templates
    that concatenate content (ChatML's `'\\n' + message['content']`) need a string, as vLLM
    gives them."""
    from stages.text.chat import render_chat as render_request

    template = "{% for m in messages %}[{{ m.role + ':' + m.content }}]{% endfor %}"
    call = {"id": "1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [call], **content},
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
    ]
    text = render_request(template, messages, add_generation_prompt=False)
    assert text == "[user:weather?][assistant:][tool:sunny]"
