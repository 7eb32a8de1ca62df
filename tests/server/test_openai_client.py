"""The app on a real Hypercorn server, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from server.app import create_app
from server.config import ServerConfig
from tests.server.fake_engine import FakeEngine
from tests.server.live import LiveServer, free_port

API_KEY = "sk-test"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "the quick brown fox jumps"}
]
CHAT_PROMPT_TOKENS = 7  # "user:" + five words + "assistant:"


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[LiveServer]:
    config = ServerConfig(
        host="127.0.0.1", port=free_port(), api_key=API_KEY, enable_per_request_metrics=True
    )
    with LiveServer(create_app(engine, config), config) as live:
        yield live


@pytest.fixture
def client(server: LiveServer, engine: FakeEngine) -> Iterator[openai.OpenAI]:
    engine.token_delay_s = 0.0
    engine.ready = True
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


def raw_request(
    server: LiveServer,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        payload = None if body is None else json.dumps(body)
        all_headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        connection.request(method, path, payload, all_headers | (headers or {}))
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == "the quick brown fox jumps"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.system_fingerprint
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == CHAT_PROMPT_TOKENS
    assert completion.usage.completion_tokens == 5
    assert completion.usage.total_tokens == CHAT_PROMPT_TOKENS + 5
    assert completion.usage.completion_tokens_details is None  # no reasoning parser


def test_chat_max_tokens_is_length(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, max_completion_tokens=2
    )
    assert completion.choices[0].message.content == "the quick"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 2


def test_per_request_metrics_on_response(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="fake-model", messages=MESSAGES)
    metrics: dict[str, Any] = completion.model_extra["metrics"]  # type: ignore[index]
    for key in ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms"):
        assert metrics[key] >= 0
    assert metrics["tokens_per_second"] > 0
    assert set(metrics["stage_time_ms"]) == {"render", "queue", "prefill", "decode", "detokenize"}
    assert metrics["speculative_decoding"]["num_draft_tokens"] == 4
    assert metrics["speculative_decoding"]["draft_acceptance_rate"] == pytest.approx(0.75)


def test_chat_streaming_chunk_sequence(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    # as vLLM streams it: the last token's text and the finish in one chunk, a chunk a token
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].delta.content == " jumps"
    contents = [c.choices[0].delta.content for c in chunks[1:]]
    assert "".join(contents) == "the quick brown fox jumps"
    assert len(contents) == 5
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_stream_include_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="fake-model",
            messages=MESSAGES,
            stream=True,
            max_tokens=3,
            stream_options={"include_usage": True},
        )
    )
    final = chunks[-1]
    assert final.choices == []
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (CHAT_PROMPT_TOKENS, 3)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert final.model_extra["metrics"]["time_to_first_token_ms"] >= 0  # type: ignore[index]


def test_stream_continuous_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="fake-model",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(c.usage is not None for c in chunks)
    completion_tokens = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert completion_tokens[0] == 0
    assert completion_tokens == sorted(completion_tokens)
    assert completion_tokens[-1] == 5


def test_stop_string(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, stop=["brown"]
    )
    choice = completion.choices[0]
    assert choice.message.content == "the quick "
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "brown"  # type: ignore[index]
    streamed = client.chat.completions.create(
        model="fake-model",
        messages=MESSAGES,
        stop="fox",
        stream=True,
        extra_body={"include_stop_str_in_output": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "the quick brown fox"


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, logprobs=True, top_logprobs=3, max_tokens=2
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [entry.token for entry in logprobs.content] == ["the", " quick"]
    first = logprobs.content[0]
    assert first.logprob == pytest.approx(-0.25)
    assert first.bytes == list(b"the")
    assert len(first.top_logprobs) == 3
    assert first.top_logprobs[0].token == "the"
    streamed = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, logprobs=True, max_tokens=2, stream=True
    )
    entries = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or ()
    ]
    assert [e.token for e in entries] == ["the", " quick"]
    assert all(e.top_logprobs == [] for e in entries)


def test_completions(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="fake-model", prompt="one two three", max_tokens=2)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == "one two"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 2)


def test_completions_token_prompt_echo_and_logprobs(
    client: openai.OpenAI, engine: FakeEngine
) -> None:
    ids = [engine.word_id(w) for w in ("alpha", "beta", "gamma")]
    completion = client.completions.create(
        model="fake-model", prompt=ids, echo=True, logprobs=2, max_tokens=2
    )
    choice = completion.choices[0]
    assert choice.text == "alpha beta gammaalpha beta"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == ["alpha", " beta", " gamma", "alpha", " beta"]
    assert choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.text_offset == [0, 5, 10, 16, 21]
    assert choice.logprobs.top_logprobs is not None
    assert choice.logprobs.top_logprobs[3] == {"alpha": -0.25, "alt0": -1.25}


def test_completions_streaming(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="fake-model",
            prompt="one two three",
            stream=True,
            logprobs=0,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "one two three"
    offsets = [
        o
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for o in c.choices[0].logprobs.text_offset or ()
    ]
    assert offsets == [0, 3, 7]
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_raw_stream_ends_with_done(server: LiveServer) -> None:
    status, headers, body = raw_request(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": MESSAGES, "stream": True, "max_tokens": 2},
    )
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "the"},
        {"content": " quick"},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(set(c) >= {"id", "object", "created", "model"} for c in chunks)


def test_error_mid_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "a b FAIL_MIDSTREAM"}],
        stream=True,
    )
    with pytest.raises(openai.APIError, match="engine failure"):
        list(stream)
    assert client.chat.completions.create(model="fake-model", messages=MESSAGES).choices


def test_request_ids_are_prefixed_as_vllm_prefixes_them(
    server: LiveServer, client: openai.OpenAI, engine: FakeEngine
) -> None:
    """X-Request-Id, else the body's request_id, else a new id, after chatcmpl- or cmpl-; no
    X-Request-Id in the answer without --enable-request-id-headers."""
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=MESSAGES, extra_headers={"X-Request-Id": "req-123"}
    )
    assert "x-request-id" not in raw.headers
    assert raw.parse().id == "chatcmpl-req-123"
    assert engine.requests[-1].request_id == "chatcmpl-req-123"
    completion = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, extra_body={"request_id": "body-7"}
    )
    assert completion.id == "chatcmpl-body-7"
    both = client.chat.completions.create(
        model="fake-model",
        messages=MESSAGES,
        extra_body={"request_id": "body-8"},
        extra_headers={"X-Request-Id": "header-8"},
    )
    assert both.id == "chatcmpl-header-8"
    text = client.completions.create(
        model="fake-model", prompt="x", extra_headers={"X-Request-Id": "t-1"}
    )
    assert text.id == "cmpl-t-1"
    generated = client.completions.create(model="fake-model", prompt="x")
    assert generated.id.startswith("cmpl-") and len(generated.id) == len("cmpl-") + 32
    stream = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, stream=True, extra_body={"request_id": "s-1"}
    )
    assert {chunk.id for chunk in stream} == {"chatcmpl-s-1"}


def test_enable_request_id_headers(engine: FakeEngine) -> None:
    """--enable-request-id-headers: every answer has X-Request-Id, the request's or a new one."""
    config = ServerConfig(
        host="127.0.0.1", port=free_port(), api_key=API_KEY, enable_request_id_headers=True
    )
    with (
        LiveServer(create_app(engine, config), config) as live,
        openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0) as client,
    ):
        raw = client.chat.completions.with_raw_response.create(
            model="fake-model", messages=MESSAGES, extra_headers={"X-Request-Id": "req-123"}
        )
        assert raw.headers["x-request-id"] == "req-123"
        assert raw.parse().id == "chatcmpl-req-123"
        fresh = client.chat.completions.with_raw_response.create(
            model="fake-model", messages=MESSAGES
        )
        assert len(fresh.headers["x-request-id"]) == 32
        status, headers, _ = raw_request(live, "GET", "/v1/models", headers={"X-Request-Id": "m-1"})
        assert (status, headers["x-request-id"]) == (200, "m-1")
        status, headers, _ = raw_request(
            live, "GET", "/v1/nowhere", headers={"X-Request-Id": "e-1"}
        )
        assert (status, headers["x-request-id"]) == (404, "e-1")


def test_disconnect_aborts(server: LiveServer, engine: FakeEngine) -> None:
    engine.token_delay_s = 0.05
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    body = {"messages": [{"role": "user", "content": "w " * 40}], "stream": True}
    connection.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(body),
        {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "leaver"},
    )
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    connection.close()
    deadline = time.monotonic() + 5
    while "chatcmpl-leaver" not in engine.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "chatcmpl-leaver" in engine.aborted
    assert "chatcmpl-leaver" not in engine.finished


def test_health_follows_engine_readiness(server: LiveServer, engine: FakeEngine) -> None:
    engine.ready = False
    assert raw_request(server, "GET", "/health")[0] == 503
    engine.ready = True
    assert raw_request(server, "GET", "/health")[0] == 200


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["fake-model"]
    assert models[0].model_extra["max_model_len"] == 64  # type: ignore[index]


def test_retrieve_model(client: openai.OpenAI, server: LiveServer) -> None:
    card = client.models.retrieve("fake-model")
    assert card.id == "fake-model" and card.object == "model" and card.owned_by
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("other-model")
    assert missing.value.code == "model_not_found"
    assert "other-model" in missing.value.message
    # A Hugging Face name has a slash in it: still one model id, not another route.
    status, _, body = raw_request(server, "GET", "/v1/models/org/other-model")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    assert client.models.retrieve("fake-model").id == "fake-model"  # still serving


def test_ping_follows_engine_readiness_as_health(server: LiveServer, engine: FakeEngine) -> None:
    for method in ("GET", "POST"):
        engine.ready = False
        status, headers, body = raw_request(server, method, "/ping", headers={"Authorization": ""})
        assert status == 503 and {k.lower(): v for k, v in headers.items()}["retry-after"] == "5"
        assert json.loads(body)["error"]["type"] == "ServiceUnavailableError"
        engine.ready = True
        assert raw_request(server, method, "/ping", headers={"Authorization": ""})[0] == 200


def test_tokenize_and_detokenize(server: LiveServer, engine: FakeEngine) -> None:
    status, _, body = raw_request(server, "POST", "/tokenize", {"prompt": "red green red"})
    tokenized = json.loads(body)
    assert status == 200
    assert tokenized["count"] == 3 and tokenized["max_model_len"] == 64
    assert tokenized["tokens"][0] == tokenized["tokens"][2] == engine.word_id("red")
    status, _, body = raw_request(server, "POST", "/detokenize", {"tokens": tokenized["tokens"]})
    assert (status, json.loads(body)) == (200, {"prompt": "red green red"})
    status, _, body = raw_request(
        server, "POST", "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}
    )
    assert json.loads(body)["count"] == CHAT_PROMPT_TOKENS - 1


def test_version(server: LiveServer) -> None:
    status, _, body = raw_request(server, "GET", "/version")
    assert status == 200 and json.loads(body)["version"]


def test_metrics_use_vllm_names(client: openai.OpenAI, server: LiveServer) -> None:
    client.chat.completions.create(model="fake-model", messages=MESSAGES)
    status, headers, body = raw_request(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        'vllm:request_success_total{finished_reason="stop",model_name="fake-model"}',
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
    ):
        assert name in text, name
    assert 'vllm:kv_cache_usage_perc{model_name="fake-model"} 0.25' in text


def test_wrong_api_key_is_401(server: LiveServer) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="fake-model", messages=MESSAGES)


def test_disconnect_before_a_non_streaming_answer_aborts(
    server: LiveServer, engine: FakeEngine
) -> None:
    engine.token_delay_s = 0.05
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    body = {"messages": [{"role": "user", "content": "w " * 40}]}
    connection.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(body),
        {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "impatient"},
    )
    deadline = time.monotonic() + 5
    while not any(r.request_id == "chatcmpl-impatient" for r in engine.requests):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    connection.close()
    while "chatcmpl-impatient" not in engine.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "chatcmpl-impatient" in engine.aborted


def test_concurrent_streams_keep_their_own_text(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.token_delay_s = 0.005
    prompts = [
        " ".join(f"{word}{i}" for word in ("red", "green", "blue", "cyan")) for i in range(6)
    ]

    def run(prompt: str) -> str:
        stream = client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": prompt}], stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(max_workers=6) as pool:
        assert list(pool.map(run, prompts)) == prompts


def test_chunked_body_over_the_limit_is_a_413(server: LiveServer) -> None:
    """A body sent without a Content-Length is cut off at --max-request-body-bytes too."""
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    # Just over the limit: the server answers once it has read past it, and what is left of the
    # body fits in the socket's buffers, so sending it does not race the answer.
    content = "w" * ServerConfig().max_request_body_bytes
    payload = json.dumps({"model": "fake-model", "prompt": content}).encode()
    chunks = (payload[i : i + 65536] for i in range(0, len(payload), 65536))
    try:
        connection.request(
            "POST",
            "/v1/completions",
            chunks,
            {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
            encode_chunked=True,
        )
        response = connection.getresponse()
        status, body = response.status, json.loads(response.read())
    finally:
        connection.close()
    assert status == 413
    assert body["error"]["type"] == "RequestEntityTooLargeError"
    assert "--max-request-body-bytes" in body["error"]["message"]
    assert raw_request(server, "GET", "/health")[0] == 200


# -- regressions of issue 15 (vLLM parity) ------------------------------------------------------


def sse_chunks(body: bytes) -> list[dict[str, Any]]:
    events = body.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def test_streamed_chunks_carry_no_system_fingerprint(server: LiveServer) -> None:
    """vLLM's chat and completion chunks have no system_fingerprint (its stream response types
    lack the field), the usage chunk included; the non-streaming response keeps it."""
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES, **usage}),
        ("/v1/completions", {"prompt": "one two", **usage}),
    ):
        status, _, raw = raw_request(server, "POST", path, body)
        chunks = sse_chunks(raw)
        assert status == 200 and len(chunks) >= 3 and chunks[-1]["usage"]
        assert all("system_fingerprint" not in c for c in chunks)
        body.pop("stream"), body.pop("stream_options")
        status, _, raw = raw_request(server, "POST", path, body)
        assert status == 200 and json.loads(raw)["system_fingerprint"]


def test_completions_default_to_16_tokens(client: openai.OpenAI, engine: FakeEngine) -> None:
    """OpenAI and vLLM: /v1/completions without max_tokens writes 16 tokens; chat keeps its
    default (what is left of the context)."""
    words = " ".join(f"w{i}" for i in range(30))
    completion = client.completions.create(model="fake-model", prompt=words)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 16
    assert engine.requests[-1].sampling.max_tokens == 16
    chat = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": words}]
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 30
    assert engine.requests[-1].sampling.max_tokens is None


def test_without_a_generation_prompt_the_reply_has_the_last_role(client: openai.OpenAI) -> None:
    """vLLM's get_chat_request_role: the assistant's role only after a generation prompt."""
    extra = {"add_generation_prompt": False}
    reply = client.chat.completions.create(model="fake-model", messages=MESSAGES, extra_body=extra)
    assert reply.choices[0].message.role == "user"  # type: ignore[comparison-overlap]
    stream = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, stream=True, extra_body=extra
    )
    assert next(iter(stream)).choices[0].delta.role == "user"  # type: ignore[comparison-overlap]
    assert (
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
        .choices[0]
        .message.role
        == "assistant"
    )


def test_chat_echo_puts_the_last_message_first(client: openai.OpenAI) -> None:
    """vLLM's chat echo: the last message's content when its role is the reply's (an assistant
    prefix with continue_final_message), ahead of the reply; streamed as its own chunk right
    after the role chunk. With a generation prompt the last message is the user's: no echo."""
    start = "The capital of France is"
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "capital?"},
        {"role": "assistant", "content": start},
    ]
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    plain = {"add_generation_prompt": False, "continue_final_message": True}
    reply = client.chat.completions.create(
        model="fake-model", messages=messages, extra_body=plain
    ).choices[0]
    assert reply.message.content == start  # the fake engine replays the last message
    echoed = client.chat.completions.create(model="fake-model", messages=messages, extra_body=extra)
    assert echoed.choices[0].message.content == start + start
    chunks = list(
        client.chat.completions.create(
            model="fake-model", messages=messages, stream=True, extra_body=extra
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == start
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == start + start
    user_last = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, extra_body={"echo": True}
    )
    assert user_last.choices[0].message.content == "the quick brown fox jumps"


def test_per_request_metrics_are_left_out_for_n_above_one(client: openai.OpenAI) -> None:
    """One choice's figures are not the request's (vLLM leaves them out for n > 1)."""
    several = client.chat.completions.create(model="fake-model", messages=MESSAGES, n=2)
    assert len(several.choices) == 2 and "metrics" not in (several.model_extra or {})
    chunks = list(
        client.chat.completions.create(
            model="fake-model",
            messages=MESSAGES,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all("metrics" not in (c.model_extra or {}) for c in chunks)
    finishes = list(client.completions.create(model="fake-model", prompt="a b", n=2, stream=True))
    assert all("metrics" not in (c.model_extra or {}) for c in finishes)
    one = client.chat.completions.create(model="fake-model", messages=MESSAGES, n=1)
    assert one.model_extra is not None and one.model_extra["metrics"]["num_generated_tokens"] == 5


def post_with_content_type(
    server: LiveServer, path: str, content_type: str | None, body: bytes
) -> tuple[int, dict[str, Any]]:
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.putrequest("POST", path)
        connection.putheader("Authorization", f"Bearer {API_KEY}")
        if content_type is not None:
            connection.putheader("Content-Type", content_type)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


JSON_BODIES = [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
    ("/v1/completions", {"prompt": "one two", "max_tokens": 1}),
    ("/tokenize", {"prompt": "one two"}),
    ("/detokenize", {"tokens": [10]}),
]


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonp",
        "text/json",
    ],
)
def test_a_body_that_is_not_json_is_a_415(server: LiveServer, content_type: str) -> None:
    """What a web page can make a browser post to any origin without a CORS preflight is not a
    request body (as FastAPI decided after CVE-2021-32677)."""
    for path, body in JSON_BODIES:
        status, error = post_with_content_type(
            server, path, content_type, json.dumps(body).encode()
        )
        assert status == 415, (path, error)
        assert error["error"]["type"] == "UnsupportedMediaTypeError"
        assert "Content-Type" in error["error"]["message"]
    status, answer = post_with_content_type(
        server, "/tokenize", "application/json", b'{"prompt": "one"}'
    )
    assert status == 200 and answer["count"] == 1  # the server keeps serving


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/json; charset=utf-8", "Application/JSON", None],
)
def test_json_media_types_and_no_content_type_are_served(
    server: LiveServer, content_type: str | None
) -> None:
    """application/json with parameters, any application/*+json, and (as FastAPI reads it) a
    body with no Content-Type at all."""
    for path, body in JSON_BODIES:
        status, answer = post_with_content_type(
            server, path, content_type, json.dumps(body).encode()
        )
        assert status == 200, (path, answer)
    status, _ = post_with_content_type(
        server, "/tokenize", "application/vnd.api+json", b'{"prompt": "one"}'
    )
    assert status == 200
