"""Every bad request gets its status and an OpenAI error body, and the next request still works."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from quart import Quart

from tests.server.fake_engine import BAD_TEMPLATE, FakeEngine

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello there"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": MESSAGES, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "hello there", **fields}


BIG_INT_FIELDS = ("max_tokens", "top_k", "truncate_prompt_tokens", "min_tokens", "n")
BAD_REQUESTS = [
    # (route, body, status, param)
    (CHAT, chat(temperature=2.5), 400, "temperature"),
    (CHAT, chat(temperature=-0.1), 400, "temperature"),
    (CHAT, chat(top_p=0), 400, "top_p"),
    (CHAT, chat(top_p=1.01), 400, "top_p"),
    (CHAT, chat(presence_penalty=2.1), 400, "presence_penalty"),
    (CHAT, chat(frequency_penalty=-2.1), 400, "frequency_penalty"),
    (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    (CHAT, chat(min_p=1.5), 400, "min_p"),
    (CHAT, chat(top_k=-2), 400, "top_k"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CHAT, chat(max_tokens=2, min_tokens=3), 400, "min_tokens"),
    (CHAT, chat(n=17), 400, "n"),
    (CHAT, chat(n=0), 400, "n"),
    (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, chat(stop=[""]), 400, "stop"),
    (CHAT, chat(stop=7), 400, "stop"),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT, chat(response_format={"type": "yaml"}), 400, "response_format.type"),
    (CHAT, chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema"),
    (
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": "{x"}}),
        400,
        "response_format.json_schema.schema",
    ),
    (CHAT, chat(guided_choice=[]), 400, "guided_choice"),
    (CHAT, chat(guided_regex="a", guided_choice=["b"]), 400, "guided_choice"),
    (CHAT, chat(structured_outputs={}), 400, "structured_outputs"),
    (
        COMPLETIONS,
        {"model": "fake-model", "prompt": "x", "structured_outputs": {"grammar": ""}},
        400,
        "structured_outputs.grammar",
    ),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice"),  # no tools
    (
        CHAT,
        chat(tool_choice="sometimes", tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "tool_choice",
    ),
    (CHAT, chat(tool_choice="auto"), 400, "tool_choice"),  # no tools
    # tools with "auto" need --enable-auto-tool-choice and a --tool-call-parser (as in vLLM)
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool_choice"),
    (
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
    ),
    (CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0]"),
    (CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"5": 101}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"5000": 1}), 400, "logit_bias"),
    (CHAT, chat(stop_token_ids=[1000]), 400, "stop_token_ids[0]"),
    (CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids[0]"),
    (CHAT, chat(stream=True, messages=[{"role": "user", "content": "w " * 80}]), 400, "messages"),
    (CHAT, chat(seed="x"), 400, "seed"),
    (CHAT, chat(priority=2**40), 400, "priority"),  # past int32 it would crash render
    # past int64 they would fail to pack into the request record: a 500
    *(
        (route, body(**{field: 2**64 + 1}), 400, field)
        for route, body, fields in (
            (CHAT, chat, (*BIG_INT_FIELDS, "max_completion_tokens", "thinking_token_budget")),
            (COMPLETIONS, completion, BIG_INT_FIELDS),
        )
        for field in fields
    ),
    (CHAT, chat(continue_final_message=True), 400, "continue_final_message"),
    (CHAT, {"model": "fake-model"}, 400, None),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages=[{"role": 5, "content": "hi"}]), 400, "messages[0].role"),
    (CHAT, chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content",
    ),
    (CHAT, chat(messages=[{"role": "user", "content": f"a {BAD_TEMPLATE}"}]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": "word " * 80}]), 400, "messages"),
    (CHAT, chat(model="gpt-4"), 404, "model"),
    (COMPLETIONS, completion(prompt=""), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=None, prompt_embeds=[]), 400, "prompt"),
    (COMPLETIONS, completion(prompt_embeds="AAAA"), 400, "prompt_embeds"),
    (COMPLETIONS, completion(prompt=[["one"]]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[[]]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=["one", ""]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[1, [2]]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[True]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[[5], [1000]]), 400, "prompt[1][0]"),
    (COMPLETIONS, completion(prompt=["a"] * 257), 400, "prompt"),
    (COMPLETIONS, completion(prompt=["a"] * 20, n=16), 400, "n"),
    (COMPLETIONS, completion(prompt=[1, "two"]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[-1]), 400, "prompt[0]"),
    (COMPLETIONS, completion(prompt=[5, 1000]), 400, "prompt[1]"),
    (COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    (COMPLETIONS, completion(logprobs=True), 400, "logprobs"),
    (COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    (COMPLETIONS, {"model": "fake-model"}, 400, "prompt"),
    (COMPLETIONS, completion(prompt="word " * 80), 400, "prompt"),
    (COMPLETIONS, completion(model="nope"), 404, "model"),
    ("/tokenize", {"model": "fake-model"}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/detokenize", {"tokens": [1_000_000]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


async def assert_still_serving(app: Quart) -> None:
    response = await app.test_client().post(CHAT, json=chat(max_tokens=2))
    assert response.status_code == 200
    assert (await response.get_json())["choices"][0]["message"]["content"] == "hello there"


def assert_error(body: dict[str, Any], type_: str, param: str | None = None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD_REQUESTS)
async def test_bad_request_gets_openai_error(
    app: Quart, route: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    response = await app.test_client().post(route, json=body)
    assert response.status_code == status
    assert_error(
        await response.get_json(), "BadRequestError" if status == 400 else "NotFoundError", param
    )
    await assert_still_serving(app)


async def test_unknown_model_is_model_not_found(app: Quart) -> None:
    response = await app.test_client().post(CHAT, json=chat(model="gpt-4"))
    error = (await response.get_json())["error"]
    assert error["code"] == "model_not_found"
    assert "gpt-4" in error["message"]


async def test_too_many_choices_says_the_limit(app: Quart) -> None:
    response = await app.test_client().post(CHAT, json=chat(n=99))
    assert "at most 16" in (await response.get_json())["error"]["message"]


async def test_prompt_too_long_keeps_engine_code(app: Quart) -> None:
    response = await app.test_client().post(COMPLETIONS, json=completion(prompt="w " * 80))
    assert (await response.get_json())["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
async def test_malformed_json_is_400(app: Quart, raw: bytes) -> None:
    response = await app.test_client().post(
        CHAT, data=raw, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert_error(await response.get_json(), "BadRequestError")
    await assert_still_serving(app)


@pytest.mark.parametrize(
    ("method", "route", "status", "type_"),
    [
        ("GET", CHAT, 405, "MethodNotAllowedError"),
        ("PUT", COMPLETIONS, 405, "MethodNotAllowedError"),
        ("POST", "/v1/models", 405, "MethodNotAllowedError"),
        ("GET", "/v1/embeddings", 404, "NotFoundError"),
        ("POST", "/nowhere", 404, "NotFoundError"),
    ],
)
async def test_routing_errors(app: Quart, method: str, route: str, status: int, type_: str) -> None:
    response = await app.test_client().open(route, method=method)
    assert response.status_code == status
    assert_error(await response.get_json(), type_)
    await assert_still_serving(app)


async def test_api_key(make_app: Callable[..., Quart]) -> None:
    app = make_app(api_key="sk-right")
    client = app.test_client()
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-right"}):
        response = await client.post(CHAT, json=chat(), headers=headers)
        assert response.status_code == 401
        assert_error(await response.get_json(), "AuthenticationError")
    response = await client.get("/v1/models")
    assert response.status_code == 401
    assert (await client.get("/health")).status_code == 200
    ok = await client.post(CHAT, json=chat(), headers={"Authorization": "Bearer sk-right"})
    assert ok.status_code == 200


async def test_api_key_guards_tokenize_detokenize_and_profile(
    make_app: Callable[..., Quart],
) -> None:
    """As in vLLM: what reads the model needs the key; the probes (/health, /version, /metrics)
    do not."""
    client = make_app(api_key="sk-right").test_client()
    calls = [
        ("POST", "/tokenize", {"prompt": "hello there"}),
        ("POST", "/detokenize", {"tokens": [10, 11]}),
        ("GET", "/debug/profile", None),
    ]
    for method, path, body in calls:
        refused = await client.open(path, method=method, json=body)
        assert refused.status_code == 401, path
        assert_error(await refused.get_json(), "AuthenticationError")
        allowed = await client.open(
            path, method=method, json=body, headers={"Authorization": "Bearer sk-right"}
        )
        assert allowed.status_code != 401, path
    for path in ("/health", "/version", "/metrics"):
        assert (await client.get(path)).status_code == 200, path


@pytest.mark.parametrize("header", ["bearer sk-right", "BEARER sk-right", "Bearer  sk-right"])
async def test_bearer_scheme_is_case_insensitive(
    make_app: Callable[..., Quart], header: str
) -> None:
    client = make_app(api_key="sk-right").test_client()
    response = await client.post(CHAT, json=chat(), headers={"Authorization": header})
    assert response.status_code == 200
    wrong = await client.post(CHAT, json=chat(), headers={"Authorization": "bearer sk-wrong"})
    assert wrong.status_code == 401


async def test_not_ready_engine(app: Quart, engine: FakeEngine) -> None:
    engine.ready = False
    client = app.test_client()
    health = await client.get("/health")
    assert health.status_code == 503 and health.headers["Retry-After"] == "5"
    assert_error(await health.get_json(), "ServiceUnavailableError")
    response = await client.post(CHAT, json=chat())
    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert_error(await response.get_json(), "ServiceUnavailableError")
    assert "not ready" in (await response.get_json())["error"]["message"]
    assert engine.requests == []
    engine.ready = True
    assert (await client.get("/health")).status_code == 200
    await assert_still_serving(app)


async def test_error_mid_stream_is_an_sse_error_then_done(app: Quart) -> None:
    body = chat(messages=[{"role": "user", "content": "a b FAIL_MIDSTREAM c"}], stream=True)
    response = await app.test_client().post(CHAT, json=body)
    assert response.status_code == 200
    events = (await response.get_data(as_text=True)).split("\n\n")
    assert events[-1] == ""
    assert events[-2] == "data: [DONE]"
    error = json.loads(events[-3].removeprefix("data: "))
    assert_error(error, "InternalServerError")
    assert error["error"]["message"] == "engine failure"
    await assert_still_serving(app)


async def test_engine_failure_without_streaming_is_500(app: Quart) -> None:
    body = chat(messages=[{"role": "user", "content": "a b FAIL_MIDSTREAM c"}])
    response = await app.test_client().post(CHAT, json=body)
    assert response.status_code == 500
    assert_error(await response.get_json(), "InternalServerError")
    await assert_still_serving(app)


def nested(depth: int) -> str:
    """JSON text whose arrays and objects nest `depth` deep (too deep for json.dumps to write)."""
    opening = "".join('{"k": ' if level % 2 == 0 else "[" for level in range(depth))
    closing = "".join("}" if level % 2 == 0 else "]" for level in reversed(range(depth)))
    return opening + '"bottom"' + closing


DEEP = "__DEEP__"


def with_deep(body: dict[str, Any], depth: int) -> bytes:
    """The body as JSON text, with `depth`-deep JSON where it holds DEEP."""
    return json.dumps(body).replace(json.dumps(DEEP), nested(depth)).encode()


async def post_raw(app: Quart, route: str, raw: bytes) -> Any:
    return await app.test_client().post(
        route, data=raw, headers={"Content-Type": "application/json"}
    )


DEEP_BODIES = [
    (CHAT, chat(chat_template_kwargs=DEEP), 1000),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "extra": DEEP}]), 100),
    (COMPLETIONS, completion(structured_outputs={"json": DEEP}), 500),
    ("/tokenize", {"prompt": "hello", "tools": [DEEP]}, 200),
    ("/detokenize", {"tokens": [10], "model": DEEP}, 1000),
]


@pytest.mark.parametrize(("route", "body", "depth"), DEEP_BODIES)
async def test_json_nested_too_deep_is_a_400_on_every_route(
    app: Quart, route: str, body: dict[str, Any], depth: int
) -> None:
    response = await post_raw(app, route, with_deep(body, depth))
    assert response.status_code == 400
    error = (await response.get_json())["error"]
    assert_error({"error": error}, "BadRequestError")
    assert "at most 64" in error["message"]
    await assert_still_serving(app)


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"guided_json": nested(2000)}, "guided_json"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "[" * 5000}}},
            "response_format.json_schema.schema",
        ),
    ],
)
async def test_json_text_nested_too_deep_is_a_400_naming_its_field(
    app: Quart, field: dict[str, Any], param: str
) -> None:
    response = await app.test_client().post(CHAT, json=chat(**field))
    assert response.status_code == 400
    error = (await response.get_json())["error"]
    assert error["param"] == param
    assert "at most 64" in error["message"]
    await assert_still_serving(app)


async def test_deep_tool_call_arguments_are_a_400(app: Quart) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 3000}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "done", "tool_call_id": "c1"},
    ]
    response = await app.test_client().post(CHAT, json=chat(messages=messages))
    assert response.status_code == 400
    error = (await response.get_json())["error"]
    assert error["param"] == "messages[1].tool_calls[0].function.arguments"


async def test_json_at_the_depth_limit_is_served(app: Quart) -> None:
    # the body, then `chat_template_kwargs` holding 63 levels: 64 in all
    response = await post_raw(app, CHAT, with_deep(chat(chat_template_kwargs=DEEP), 63))
    assert response.status_code == 200, await response.get_json()
    too_deep = await post_raw(app, CHAT, with_deep(chat(chat_template_kwargs=DEEP), 64))
    assert too_deep.status_code == 400


async def test_body_over_the_limit_is_a_413(make_app: Callable[..., Quart]) -> None:
    app = make_app(max_request_body_bytes=10_000)
    client = app.test_client()
    body = chat(messages=[{"role": "user", "content": "word " * 3000}])
    response = await client.post(CHAT, json=body)
    assert response.status_code == 413
    error = (await response.get_json())["error"]
    assert_error({"error": error}, "RequestEntityTooLargeError")
    assert "10000 bytes" in error["message"] and "--max-request-body-bytes" in error["message"]
    tokenize = await client.post("/tokenize", json={"prompt": "word " * 3000})
    assert tokenize.status_code == 413
    await assert_still_serving(app)
