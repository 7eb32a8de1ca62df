"""`pipeline-serve serve --model ...` with the engine-side flags a `vllm serve` user passes, as a
real process tree on the tiny model, driven by the official openai client: --tokenizer,
--chat-template with --chat-template-content-format, --generation-config with
--override-generation-config, --dtype half, several --served-model-name, --response-role."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from tests.e2e.serving import running_server
from tests.server.live import free_port
from tests.stages.tiny import SPECIALS, build_tiny_chat_model

# Reads content as OpenAI's list of parts, which --chat-template-content-format openai passes.
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for part in m['content'] %}[{{ part['text'] }}]{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GENERATION_MAX_TOKENS = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tiny_chat_model(tmp_path_factory.mktemp("tiny"))
    # --tokenizer: the same vocabulary, configured to put BOS first (the model's does not)
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    shutil.copy(model / "tokenizer.json", tokenizer)
    (tokenizer / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": "never used: --chat-template replaces it",
                "bos_token": SPECIALS[0],
                "eos_token": "<|im_end|>",
                "add_bos_token": True,
            }
        )
    )
    template = tmp_path_factory.mktemp("template") / "parts.jinja"
    template.write_text(PARTS_TEMPLATE)
    generation = tmp_path_factory.mktemp("generation")
    (generation / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 50})
    )
    port = free_port()
    args = [
        "serve",
        "--model",
        str(model),
        "--tokenizer",
        str(tokenizer),
        "--chat-template",
        str(template),
        "--chat-template-content-format",
        "openai",
        "--generation-config",
        str(generation),
        "--override-generation-config",
        json.dumps({"max_new_tokens": GENERATION_MAX_TOKENS}),
        "--dtype",
        "half",
        "--served-model-name",
        "tiny",
        "tiny-alias",
        "--response-role",
        "bot",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "2MiB",
        "--threads",
        "1",
    ]
    log_path = tmp_path_factory.mktemp("logs") / "serve.log"
    with running_server(args, port, log_path):
        yield port, log_path


@pytest.fixture(scope="module")
def client(server):
    port, _ = server
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


def _tokenize(port: int, body: dict) -> list[int]:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST", "/tokenize", json.dumps(body))
        return json.loads(connection.getresponse().read())["tokens"]
    finally:
        connection.close()


def _detokenize(port: int, tokens: list[int]) -> str:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST", "/detokenize", json.dumps({"tokens": tokens}))
        return json.loads(connection.getresponse().read())["prompt"]
    finally:
        connection.close()


def test_tokenizer_from_another_path(server):
    port, _ = server
    tokens = _tokenize(port, {"prompt": "Hello world!"})
    assert _detokenize(port, tokens[:1]) == SPECIALS[0]  # its BOS, which the model's omits


def test_chat_template_file_with_content_parts(server):
    port, _ = server
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}],
        },
        {"role": "assistant", "content": "Paris"},
    ]
    text = _detokenize(port, _tokenize(port, {"messages": messages}))
    assert text == (
        "<|im_start|>user\n[Hello][world]<|im_end|>\n<|im_start|>assistant\n[Paris]<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_generation_config_defaults(client):
    """temperature 0 from the generation config (greedy, so two runs agree) and max_tokens from
    --override-generation-config's max_new_tokens, for requests that set neither, and as the
    cap of those that do."""
    replies = [
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello world!"}],
            extra_body={"ignore_eos": True},
        )
        for _ in range(2)
    ]
    assert [r.usage.completion_tokens for r in replies] == [GENERATION_MAX_TOKENS] * 2
    assert replies[0].choices[0].finish_reason == "length"
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    shorter = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello world!"}],
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert shorter.usage.completion_tokens == 3  # a request's own max_tokens comes first
    # ... within vLLM's override_max_tokens: the max_new_tokens of a generation config given
    # as a directory caps a request's own max_tokens, and completions' default of 16
    longer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello world!"}],
        max_tokens=9,
        extra_body={"ignore_eos": True},
    )
    text = client.completions.create(model="tiny", prompt="Hello", extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == text.usage.completion_tokens == GENERATION_MAX_TOKENS


def test_half_precision_serves(server, client):
    _, log_path = server
    reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3
    ready = [
        json.loads(line) for line in log_path.read_text().splitlines() if '"model ready"' in line
    ]
    assert ready and ready[0]["dtype"] == "float16" and ready[0]["kv_cache_dtype"] == "float16"


def test_served_model_names_and_response_role(client):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    reply = client.chat.completions.create(
        model="tiny-alias", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert reply.model == "tiny" and reply.choices[0].message.role == "bot"
