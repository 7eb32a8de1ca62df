"""pipeline-serve as a real process tree (server + four stages) on a tiny random model, driven by
the official openai client."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import signal
import subprocess
import threading
import time

import openai
import pytest

from pipeline.names import names_in_shm, pid_alive
from tests.cpu_levels import NATIVE_LEVELS
from tests.e2e.serving import http_get, running_server
from tests.server.live import free_port
from tests.stages.tiny import build_tiny_chat_model


def metric(port: int, name: str) -> float:
    _, text = http_get(port, "/metrics")
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("logs") / "serve.log"


@pytest.fixture(scope="module")
def server(tmp_path_factory, server_log):
    model = build_tiny_chat_model(tmp_path_factory.mktemp("tiny"))
    port = free_port()
    log_path = server_log
    args = [
        str(model),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "2MiB",
        "--max-num-seqs",
        "64",
        "--threads",
        "1",
        "--enable-per-request-metrics",
        "--enable-prompt-tokens-details",
        "--trust-request-chat-template",
    ]
    with running_server(args, port, log_path) as process:
        yield port, process


@pytest.fixture(scope="module")
def client(server):
    port, _ = server
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


def chat(client, content="Hello world!", **kwargs):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], **kwargs
    )


def test_the_kernels_that_run_the_model_are_named(server, server_log):
    """The startup log, /version and /metrics say which kernels run the model: the CPU kernels'
    ISA level (gpu/cpu_isa.py) here, never a silent fallback to the torch path."""
    port, _ = server
    expected = NATIVE_LEVELS[-1] if NATIVE_LEVELS else "torch"
    lines = [
        json.loads(line) for line in server_log.read_text().splitlines() if line.startswith("{")
    ]
    ready = [line for line in lines if line.get("event") in ("model ready", "engine ready")]
    assert {line["event"]: line["kernels"] for line in ready} == {
        "model ready": expected,
        "engine ready": expected,
    }
    _, version = http_get(port, "/version")
    assert json.loads(version)["kernels"] == expected
    _, text = http_get(port, "/metrics")
    assert f'vllm:kernels_info{{kernels="{expected}",model_name="tiny"}} 1.0' in text


def test_the_kv_cache_configuration_is_an_info_gauge(server):
    """vLLM's cache_config_info: the cache's block size, element type, prefix caching and block
    count as labels of a gauge at 1."""
    port, _ = server
    _, text = http_get(port, "/metrics")
    info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and info[0].endswith(" 1.0")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info[0]))
    assert labels["block_size"] == "16" and labels["enable_prefix_caching"] == "True"
    assert labels["cache_dtype"] in ("float32", "bfloat16")
    # the engine's count, known at start (schedule's gauge of it comes with its first step)
    assert int(labels["num_gpu_blocks"]) > 0


def test_non_streaming_usage_and_metrics(client):
    response = chat(client, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert response.usage.completion_tokens == 10
    assert response.usage.total_tokens == response.usage.prompt_tokens + 10
    metrics = response.model_extra["metrics"]
    assert metrics["time_to_first_token_ms"] > 0 and metrics["generation_time_ms"] > 0
    assert set(metrics["stage_time_ms"]) >= {"render", "queue", "prefill", "decode", "detokenize"}


def test_streaming_matches_non_streaming_and_reports_usage(client):
    full = chat(client, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    stream = chat(
        client,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_prompt_logprobs_through_the_pipeline(client):
    response = chat(client, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2})
    scored = response.model_extra["prompt_logprobs"]
    assert len(scored) == response.usage.prompt_tokens and scored[0] is None
    for entry in scored[1:]:
        ranks = sorted(e["rank"] for e in entry.values())
        # the prompt's own token, and the top two (it may be one of them)
        assert ranks[:2] == [1, 2] and len(entry) in (2, 3)
        assert all(
            e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entry.values()
        )


def test_echo_with_logprobs_scores_the_prompt(client):
    response = client.completions.create(
        model="tiny", prompt="Hello world!", max_tokens=3, echo=True, logprobs=1, temperature=0
    )
    choice = response.choices[0]
    logprobs = choice.logprobs
    n_prompt = response.usage.prompt_tokens
    assert len(logprobs.tokens) == n_prompt + 3
    assert logprobs.token_logprobs[0] is None and all(
        lp is not None for lp in logprobs.token_logprobs[1:]
    )
    assert "".join(logprobs.tokens[:n_prompt]) == "Hello world!"
    assert choice.text.startswith("Hello world!")


def test_prompt_logprobs_of_a_one_token_request(client):
    """max_tokens 1 is how a prompt is scored: every position comes back, chat and completions."""
    response = chat(client, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1})
    scored = response.model_extra["prompt_logprobs"]
    assert len(scored) == response.usage.prompt_tokens > 1 and scored[0] is None
    assert all(entry for entry in scored[1:])
    completion = client.completions.create(
        model="tiny", prompt="Hello world!", max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    scored = completion.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == completion.usage.prompt_tokens > 1 and scored[0] is None
    assert all(len(entry) == 1 for entry in scored[1:])


def post_json(port, path, body):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_a_tool_loop_turn_without_content_renders(server, client):
    """The OpenAI SDK sends an assistant's tool-call turn back with `"content": null` in every
    tool loop; the ChatML template concatenates content, so it gets "" as vLLM gives it (and so
    does a turn without the key). /tokenize renders it the same way."""
    port, _ = server
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
    }
    for turn in (
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "tool_calls": [call]},
    ):
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            turn,
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        assert reply.usage.completion_tokens >= 1
        status, tokenized = post_json(port, "/tokenize", {"model": "tiny", "messages": messages})
        assert status == 200 and tokenized["count"] == reply.usage.prompt_tokens


def test_chat_echo_with_continue_final_message(client):
    """As vLLM: echo puts the assistant's start ahead of its continuation, and a stream sends it
    right after the role chunk."""
    start = "The capital of France is"
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": start},
    ]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    kwargs = dict(model="tiny", messages=messages, max_tokens=6, temperature=0)
    rest = client.chat.completions.create(**kwargs, extra_body=options).choices[0].message
    echoed = client.chat.completions.create(**kwargs, extra_body={**options, "echo": True})
    assert echoed.choices[0].message.content == start + rest.content
    stream = list(
        client.chat.completions.create(**kwargs, stream=True, extra_body={**options, "echo": True})
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert stream[1].choices[0].delta.content == start
    assert "".join(c.choices[0].delta.content or "" for c in stream) == start + rest.content


def test_stop_string_and_seed(client):
    base = (
        chat(client, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
        .choices[0]
        .message.content
    )
    stop = base[4:7]
    cut = chat(
        client, max_tokens=20, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == base[: base.find(stop)]
    seeded = [
        chat(client, max_tokens=10, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_64_concurrent_streams_all_complete(client):
    def one(i: int) -> int:
        stream = chat(
            client,
            content=f"stream number {i}",
            max_tokens=16,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        return [c for c in stream][-1].usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        assert list(pool.map(one, range(64))) == [16] * 64


def test_disconnect_frees_every_kv_block(server, client):
    port, _ = server
    streams = [
        chat(
            client,
            content=f"long {i}",
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for i in range(6)
    ]
    for stream in streams:
        next(iter(stream))
    assert metric(port, "vllm:kv_cache_usage_perc") > 0
    for stream in streams:
        stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(port, "vllm:kv_cache_usage_perc") > 0:
        time.sleep(0.1)
    assert metric(port, "vllm:kv_cache_usage_perc") == 0
    assert metric(port, "vllm:num_requests_running") == 0


def test_n_choices_streamed_and_not(server, client):
    kwargs = dict(max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    response = chat(client, n=3, **kwargs)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == 18  # every choice's tokens
    assert response.usage.total_tokens == response.usage.prompt_tokens + 18  # the prompt once
    texts = [c.message.content for c in response.choices]
    assert len(set(texts)) > 1  # seed + i per choice: they differ...
    assert [
        c.message.content for c in chat(client, n=3, **kwargs).choices
    ] == texts  # ...and repeat
    assert chat(client, n=1, **kwargs).choices[0].message.content == texts[0]

    stream = chat(client, n=2, stream=True, stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    by_index: dict[int, list] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        by_index[choice.index].append(choice)
    for index in (0, 1):
        pieces = by_index[index]
        assert pieces[0].delta.role == "assistant" and pieces[-1].finish_reason == "length"
        assert "".join(p.delta.content or "" for p in pieces) == texts[index]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    completion = client.completions.create(model="tiny", prompt="Hello", n=2, **kwargs)
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.usage.completion_tokens == 12

    # A client that leaves an n = 4 stream early frees the blocks of all four.
    port, _ = server
    early = chat(client, n=4, stream=True, max_tokens=200, extra_body={"ignore_eos": True})
    next(iter(early))
    early.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(port, "vllm:kv_cache_usage_perc") > 0:
        time.sleep(0.1)
    assert metric(port, "vllm:kv_cache_usage_perc") == 0


def test_bad_requests_get_openai_errors_and_the_next_request_succeeds(client):
    cases = [
        (dict(model="nope"), openai.NotFoundError),
        (dict(temperature=5), openai.BadRequestError),
        (dict(max_tokens=0), openai.BadRequestError),
        (dict(max_tokens=10_000), openai.BadRequestError),  # past max_model_len
        (dict(n=17), openai.BadRequestError),
        (dict(extra_body={"top_k": "x"}), openai.BadRequestError),
    ]
    for kwargs, error in cases:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kwargs}
        with pytest.raises(error) as info:
            client.chat.completions.create(**body)
        assert info.value.body and "message" in json.dumps(info.value.body)
        ok = chat(client, max_tokens=2, extra_body={"ignore_eos": True})
        assert ok.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        chat(client, content="word " * 400, max_tokens=2)


def test_health_is_answered_while_a_huge_tokenize_runs(server):
    """3.5 MB of text takes the tokenizer seconds. It runs in a worker thread that lets go of
    the GIL, so fifty /health calls made one after another once it is sent all come back first
    (with the tokenizer on the event loop, none would while it runs)."""
    port, _ = server
    text = "The quick brown fox jumps over the lazy dog. " * (3_500_000 // 45)
    finished = []
    sent = threading.Event()

    def tokenize():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            body = json.dumps({"model": "tiny", "prompt": text})
            connection.request("POST", "/tokenize", body, {"Content-Type": "application/json"})
            sent.set()
            response = connection.getresponse()
            finished.append(("tokenize", response.status, json.loads(response.read())))
        finally:
            connection.close()

    worker = threading.Thread(target=tokenize)
    worker.start()
    assert sent.wait(60)
    for _ in range(50):
        finished.append(("health", http_get(port, "/health")[0], None))
    worker.join(120)
    assert [(name, status) for name, status, _ in finished] == [("health", 200)] * 50 + [
        ("tokenize", 200)
    ]
    assert finished[-1][2]["count"] > 500_000


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def test_response_format_json_schema_streamed_and_not(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "maximum": 99}},
        "required": ["answer", "n"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    for seed in (1, 2):
        response = chat(
            client, max_tokens=40, temperature=1, seed=seed, response_format=response_format
        )
        value = json.loads(response.choices[0].message.content)
        assert value["answer"] in ("yes", "no") and isinstance(value["n"], int)
        assert response.choices[0].finish_reason == "stop"
        stream = chat(
            client,
            max_tokens=40,
            temperature=1,
            seed=seed,
            response_format=response_format,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == response.choices[0].message.content  # same seed, same JSON
    reply = chat(client, max_tokens=30, temperature=0, response_format={"type": "json_object"})
    assert reply.choices[0].message.content.startswith("{")
    guided = chat(client, max_tokens=8, extra_body={"guided_choice": ["left", "right"]})
    assert guided.choices[0].message.content in ("left", "right")
    regex = chat(client, max_tokens=8, extra_body={"structured_outputs": {"regex": "[a-c]{3}"}})
    assert len(regex.choices[0].message.content) == 3


def test_forced_tool_choice_named_and_required(client):
    named = chat(
        client,
        max_tokens=30,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    message = named.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    assert named.choices[0].finish_reason == "stop"  # as OpenAI answers a forced function

    required = chat(
        client, max_tokens=60, temperature=0, tools=[WEATHER, TIME], tool_choice="required"
    )
    calls = required.choices[0].message.tool_calls
    assert calls and required.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        assert set(json.loads(call.function.arguments)) <= {"city", "zone"}

    stream = chat(
        client,
        max_tokens=30,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
        seed=3,
    )
    chunks = [c for c in stream if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert not any(d.content for d in deltas)  # the JSON goes out as the call, not as content
    streamed = [tc for d in deltas for tc in d.tool_calls or ()]
    # as OpenAI streams a call: the first piece opens it, the others carry its arguments
    assert streamed[0].id and streamed[0].function.name == "get_weather"
    assert all(tc.index == 0 and tc.id is None for tc in streamed[1:]) and len(streamed) > 2
    arguments = "".join(tc.function.arguments for tc in streamed)
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_structured_output_errors(client):
    cases = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
        {"extra_body": {"guided_regex": "[0-9"}},  # compiled by render: its 400
        {"extra_body": {"guided_json": {"type": "nonsense"}}},
        {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [WEATHER], "tool_choice": {"type": "function"}},
        {"tool_choice": "required"},  # no tools
        {"extra_body": {"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}},
    ]
    for kwargs in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, max_tokens=4, **kwargs)
        assert info.value.body["message"]
        ok = chat(client, max_tokens=2, extra_body={"ignore_eos": True})
        assert ok.usage.completion_tokens == 2


def test_what_no_client_may_send_is_refused_and_the_server_keeps_serving(server, client):
    port, process = server
    deep = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
    deep += '"chat_template_kwargs": ' + "[" * 1000 + "]" * 1000 + "}"
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(
            "POST", "/v1/chat/completions", deep, {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert (
            response.status == 400
            and "at most 64" in json.loads(response.read())["error"]["message"]
        )
        # 5 MiB announced: answered from the Content-Length, before any of it is sent
        connection.putrequest("POST", "/v1/chat/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(5 << 20))
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 413
        assert "--max-request-body-bytes" in json.loads(response.read())["error"]["message"]
    finally:
        connection.close()
    for field in ("max_tokens", "max_completion_tokens", "top_k", "truncate_prompt_tokens"):
        with pytest.raises(openai.BadRequestError, match=field):  # past int64: not a 500
            chat(client, extra_body={field: 2**64 + 1})
    assert process.poll() is None
    ok = chat(client, max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


def test_allowed_token_ids_truncation_and_token_ids_as_names(client):
    allowed = [40, 41, 42]
    reply = chat(
        client,
        max_tokens=5,
        temperature=1,
        seed=1,
        logprobs=True,
        top_logprobs=2,
        extra_body={
            "allowed_token_ids": allowed,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
        },
    )
    tokens = [entry.token for entry in reply.choices[0].logprobs.content]
    assert len(tokens) == 5 and all(t in {f"token_id:{i}" for i in allowed} for t in tokens)
    # bad_words reaches the sampler (what it bans: tests/stages/test_engine.py)
    banned = chat(client, max_tokens=6, extra_body={"ignore_eos": True, "bad_words": ["the"]})
    assert banned.usage.completion_tokens == 6
    long_prompt = "word " * 400  # past max_model_len (256) untruncated
    kept = chat(
        client, content=long_prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": 50}
    )
    assert kept.usage.prompt_tokens == 50
    fit = chat(client, content=long_prompt, max_tokens=6, extra_body={"truncate_prompt_tokens": -1})
    assert fit.usage.prompt_tokens == 256 - 6
    for extra in (
        {"allowed_token_ids": []},
        {"allowed_token_ids": [10**6]},
        {"truncate_prompt_tokens": 0},
        {"bad_words": "the"},
    ):
        with pytest.raises(openai.BadRequestError):
            chat(client, max_tokens=2, extra_body=extra)


def test_prefix_cache_counters_and_per_request_figure(server, client):
    port, _ = server
    system = "You are a terse assistant that answers in one word. " * 4
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    hits = metric(port, "vllm:prefix_cache_hits_total")
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    messages[-1]["content"] = "Hello"  # same system prompt, another question
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    cached = second.model_extra["metrics"]["num_cached_prompt_tokens"]
    assert first.model_extra["metrics"]["num_cached_prompt_tokens"] == 0 and cached >= 32
    assert metric(port, "vllm:prefix_cache_hits_total") - hits == cached
    assert second.usage.prompt_tokens_details.cached_tokens == cached
    # vLLM's created_cache_tokens: the prompt tokens each request wrote into the cache
    created = [
        r.usage.prompt_tokens_details.model_extra["created_cache_tokens"] for r in (first, second)
    ]
    assert cached <= created[0] <= first.usage.prompt_tokens  # the first wrote what the second read
    assert 0 <= created[1] <= second.usage.prompt_tokens - cached
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    *_, last = list(stream)
    assert last.usage.prompt_tokens_details.cached_tokens >= cached
    assert metric(port, "vllm:prefix_cache_queries_total") > 0


def http_post(port: int, path: str, body: object = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        payload = None if body is None else json.dumps(body)
        connection.request("POST", path, payload, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_render_endpoints_give_the_prompt_generation_runs_on(server, client):
    port, _ = server
    messages = [{"role": "user", "content": "What is the capital of France? " * 4}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 3, "truncate_prompt_tokens": 9}
    status, raw = http_post(port, "/v1/chat/completions/render", body)
    assert status == 200
    rendered = json.loads(raw)
    assert len(rendered["token_ids"]) == 9 and rendered["sampling_params"]["max_tokens"] == 3
    generated = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, extra_body={"truncate_prompt_tokens": 9}
    )
    assert generated.usage.prompt_tokens == 9
    _, tokenized = http_post(port, "/tokenize", {"model": "tiny", "messages": messages})
    assert rendered["token_ids"] == json.loads(tokenized)["tokens"][-9:]
    status, raw = http_post(port, "/v1/completions/render", {"model": "tiny", "prompt": "Hello"})
    [text] = json.loads(raw)
    assert status == 200 and text["prompt"] == "Hello" and text["request_id"].startswith("cmpl-")
    bad = {"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "["}}
    status, raw = http_post(port, "/v1/completions/render", bad)
    assert status == 400 and json.loads(raw)["error"]["param"] == "structured_outputs.regex"
    assert chat(client, max_tokens=2).choices[0].finish_reason in ("length", "stop")


def test_reset_prefix_cache_over_http(server, client):
    port, _ = server
    messages = [{"role": "user", "content": "Reset the prefix cache, then ask again. " * 5}]

    def cached_tokens() -> int:
        response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
        return response.usage.prompt_tokens_details.cached_tokens

    cached_tokens()
    assert cached_tokens() > 0
    assert http_post(port, "/reset_prefix_cache") == (200, b"")
    assert cached_tokens() == 0
    assert cached_tokens() > 0


def test_cache_salt_keeps_tenants_apart_in_the_prefix_cache(client):
    """vLLM's cache_salt: the same prompt under another salt (or none) finds nothing cached; under
    the same salt it does."""
    system = "Salted system prompt, long enough to fill several KV blocks of sixteen. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1, extra_body=extra
        )
        return reply.model_extra["metrics"]["num_cached_prompt_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") >= 32
    assert cached(None) >= 32
    with pytest.raises(openai.BadRequestError):
        cached("")


def test_truncation_side_token_ids_and_prompt_text(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    full = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, extra_body={"return_token_ids": True}
    )
    ids = full.choices[0].model_extra["prompt_token_ids"]
    assert len(ids) == full.usage.prompt_tokens > 10 and len(set(ids[:5] + ids[-5:])) > 5
    assert len(full.choices[0].model_extra["token_ids"]) == 1
    for side, kept in (("left", ids[-5:]), ("right", ids[:5])):
        reply = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=1,
            extra_body={
                "truncate_prompt_tokens": 5,
                "truncation_side": side,
                "return_token_ids": True,
            },
        )
        assert reply.choices[0].model_extra["prompt_token_ids"] == kept, side
    reply = chat(
        client,
        content="Paris",
        max_tokens=1,
        extra_body={"return_prompt_text": True, "return_token_ids": True},
    )
    assert (
        reply.model_extra["prompt_text"]
        == "<|im_start|>user\nParis<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(reply.model_extra["prompt_token_ids"]) == reply.usage.prompt_tokens


def test_a_request_chat_template_renders_in_the_sandbox(client):
    own = "{% for m in messages %}{{ m.role }}: {{ m.content }}|{{ effort }}{% endfor %}"
    reply = chat(
        client,
        content="Paris",
        max_tokens=1,
        reasoning_effort="low",
        extra_body={
            "chat_template": "{{ reasoning_effort }}/" + own,
            "chat_template_kwargs": {"effort": "e"},
            "return_prompt_text": True,
        },
    )
    assert reply.model_extra["prompt_text"] == "low/user: Paris|e"
    with pytest.raises(openai.BadRequestError):
        chat(client, max_tokens=1, extra_body={"chat_template": "{{ ().__class__ }}"})


def test_spaces_between_special_tokens(client):
    special = 1  # <|im_start|>, kept in the text when skip_special_tokens is false
    texts = {}
    for spaces in (True, False):
        reply = client.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=6,
            seed=3,
            temperature=1,
            extra_body={
                "allowed_token_ids": [special, 40],
                "ignore_eos": True,
                "skip_special_tokens": False,
                "spaces_between_special_tokens": spaces,
                "return_token_ids": True,
            },
        )
        texts[spaces] = reply.choices[0].text
        token_ids = reply.choices[0].model_extra["token_ids"]
    pieces = [
        client.post("/../detokenize", body={"tokens": [t]}, cast_to=object)["prompt"]
        for t in token_ids
    ]
    assert texts[False] == "".join(pieces)
    runs: list[str] = []
    for token, piece in zip(token_ids, pieces, strict=True):
        if token == special or not runs or runs[-1] == "<|im_start|>":
            runs.append(piece)
        else:
            runs[-1] += piece
    assert texts[True] == " ".join(runs) and special in token_ids


def test_logprob_token_ids_report_the_tokens_asked_for(client):
    as_ids = {"return_tokens_as_token_ids": True}
    top = chat(
        client, max_tokens=2, temperature=0, logprobs=True, top_logprobs=20, extra_body=as_ids
    )
    first = top.choices[0].logprobs.content[0]
    scores = {int(alt.token.split(":")[1]): alt.logprob for alt in first.top_logprobs}
    picked = [int(alt.token.split(":")[1]) for alt in first.top_logprobs[5:8]]  # not sampled
    asked = chat(
        client,
        max_tokens=2,
        temperature=0,
        logprobs=True,
        extra_body={"logprob_token_ids": picked, **as_ids},
    )
    assert asked.choices[0].message.content == top.choices[0].message.content
    entry = asked.choices[0].logprobs.content[0]
    assert entry.token == first.token and entry.logprob == pytest.approx(first.logprob, abs=1e-5)
    # vLLM's shape: the sampled token, then the tokens asked for, in their order
    assert [alt.token for alt in entry.top_logprobs] == [
        entry.token,
        *(f"token_id:{i}" for i in picked),
    ]
    for token_id, alt in zip(picked, entry.top_logprobs[1:], strict=True):
        assert alt.logprob == pytest.approx(scores[token_id], abs=1e-5)
    completion = client.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=1,
        temperature=0,
        logprobs=0,
        extra_body={"logprob_token_ids": picked, **as_ids},
    )
    alternatives = completion.choices[0].logprobs.top_logprobs[0]
    assert set(alternatives) >= {f"token_id:{i}" for i in picked}
    for extra in ({"logprob_token_ids": picked}, {"logprob_token_ids": []}):
        with pytest.raises(openai.BadRequestError):
            chat(client, max_tokens=1, extra_body=extra)  # no logprobs / empty


def test_thinking_token_budget_needs_a_reasoning_parser(client):
    # this server runs none (tests/stages/test_engine.py has the budget forcing the end tag)
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=2, extra_body={"thinking_token_budget": 3})
    assert "--reasoning-parser" in info.value.message
    assert chat(client, max_tokens=2, extra_body={"thinking_token_budget": -1}).choices


def test_structural_tag_compiles_in_render(client):
    tag = {
        "type": "structural_tag",
        "structures": [
            {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"},
        ],
        "triggers": ["<f"],
    }
    reply = chat(client, max_tokens=4, response_format=tag)
    assert reply.choices[0].finish_reason in ("stop", "length")
    tag["structures"][0]["begin"] = "<g>"  # starts with no trigger: render refuses it
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=4, response_format=tag)
    assert "trigger" in info.value.message


def test_without_lora_the_adapter_routes_do_not_exist(server, client):
    """No --enable-lora and no VLLM_ALLOW_RUNTIME_LORA_UPDATING: as in vLLM, no load route, and
    an adapter's name is an unknown model."""
    port, _ = server
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = json.dumps({"lora_name": "a", "lora_path": "/tmp"})
        connection.request(
            "POST", "/v1/load_lora_adapter", body, {"Content-Type": "application/json"}
        )
        assert connection.getresponse().status == 404
    finally:
        connection.close()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a", prompt="hi", max_tokens=1)


# Last: it stops the module's server.
def test_sigterm_stops_every_process_and_leaves_no_names(server):
    port, process = server
    assert http_get(port, "/health")[0] == 200
    found = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout
    children = [int(pid) for pid in found.split()]
    assert len(children) >= 4  # render, schedule, execute, detokenize
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    assert not [n for n in names_in_shm() if f"pserve.{process.pid}." in n]
    deadline = time.monotonic() + 10  # the stages are gone; multiprocessing's tracker follows
    while [pid for pid in children if pid_alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in children if pid_alive(pid)]
