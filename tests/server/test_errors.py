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
    (
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "f"}},
            response_format={"type": "json_object"},
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
    (CHAT, chat(continue_final_message=True), 400, "continue_final_message"),
    (CHAT, {"model": "fake-model"}, 400, None),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role"),
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
    (COMPLETIONS, completion(prompt=["one", "two"]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[1, "two"]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[-1]), 400, "prompt[0]"),
    (COMPLETIONS, completion(prompt=[5, 1000]), 400, "prompt[1]"),
    (COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    (COMPLETIONS, completion(logprobs=True), 400, "logprobs"),
    (COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    (COMPLETIONS, {"model": "fake-model"}, 400, None),
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
