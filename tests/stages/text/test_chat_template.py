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


# --chat-template-content-format: how a message's content reaches the template.
STRING_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
PARTS_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]"
    "{% for part in m['content'] %}<{{ part['type'] }}:{{ part['text'] }}>{% endfor %}\n"
    "{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (STRING_TEMPLATE, "string"),
        (PARTS_TEMPLATE, "openai"),
        # through variables set from messages, attribute access, slices and filters
        (
            "{% set turns = messages[1:] %}{% for t in turns | list %}"
            "{% for p in t.content %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        # a loop over something else than a message's content
        ("{% for m in messages %}{% for c in m['tool_calls'] %}{% endfor %}{% endfor %}", "string"),
        (
            "{% for m in messages %}{{ m.content }}{% endfor %}{% for x in tools %}{% endfor %}",
            "string",
        ),
        ("{% for m in messages %}{% if x %}", "string"),  # does not parse
    ],
)
def test_detect_content_format(template, expected):
    from stages.text.chat_template import detect_content_format

    assert detect_content_format(template) == expected


def test_smollm2_template_reads_strings(bundle):
    from stages.text.chat_template import detect_content_format

    assert detect_content_format(bundle.chat_template) == "string"


PARTS_MESSAGE = [
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": "c"},
]


@pytest.mark.parametrize(
    ("template", "content_format", "expected"),
    [
        (STRING_TEMPLATE, "string", "[user] a\nb\n[assistant] c\n"),
        (STRING_TEMPLATE, "auto", "[user] a\nb\n[assistant] c\n"),
        # a string is one text part, as vLLM hands it over
        (PARTS_TEMPLATE, "openai", "[user]<text:a><text:b>[assistant]<text:c>"),
        (PARTS_TEMPLATE, "auto", "[user]<text:a><text:b>[assistant]<text:c>"),
        # a template that reads strings, given parts, prints the list
        (
            STRING_TEMPLATE,
            "openai",
            "[user] [{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}]\n[assistant] [{'type': 'text', 'text': 'c'}]\n",
        ),
    ],
)
def test_content_formats(template, content_format, expected):
    from stages.text.chat import render_chat as render_messages

    text = render_messages(
        template, PARTS_MESSAGE, add_generation_prompt=False, content_format=content_format
    )
    assert text == expected


def test_continue_final_message_with_parts_cuts_after_the_last_part():
    from stages.text.chat import render_chat as render_messages

    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "yz"}],
        },
    ]
    text = render_messages(
        PARTS_TEMPLATE,
        messages,
        add_generation_prompt=False,
        continue_final_message=True,
        content_format="openai",
    )
    assert text == "[user]<text:q>[assistant]<text:x><text:yz"


def test_tool_messages_stay_strings_with_parts():
    from stages.text.chat import render_chat as render_messages

    template = "{% for m in messages %}{{ m['content'] is string }}{% for p in [] %}{% endfor %}{% endfor %}"
    messages = [
        {"role": "tool", "content": [{"type": "text", "text": "1"}, {"type": "text", "text": "2"}]}
    ]
    assert render_messages(template, messages, content_format="openai") == "True"
