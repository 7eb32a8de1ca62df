"""vLLM's /render endpoints and /reset_prefix_cache on the fake engine: shapes, errors and keys."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from quart import Quart

from tests.server.fake_engine import BAD_TEMPLATE, MAX_MODEL_LEN, FakeEngine
from tests.server.test_errors import BAD_REQUESTS, assert_still_serving

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


async def test_chat_render_is_what_generation_sees(app: Quart, engine: FakeEngine) -> None:
    client = app.test_client()
    body = {"model": "fake-model", "messages": MESSAGES, "temperature": 0.25, "seed": 7}
    response = await client.post(f"{CHAT}/render", json=body)
    assert response.status_code == 200
    rendered = await response.get_json()
    assert engine.requests == []  # nothing generated
    tokenized = await (await client.post("/tokenize", json={"messages": MESSAGES})).get_json()
    assert rendered["token_ids"] == tokenized["tokens"]
    assert rendered["prompt"] == "user: the quick brown fox assistant:"
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["model"] == "fake-model"
    sampling = rendered["sampling_params"]
    assert sampling["temperature"] == 0.25 and sampling["seed"] == 7 and sampling["n"] == 1
    assert sampling["max_tokens"] == MAX_MODEL_LEN - len(rendered["token_ids"])  # resolved
    assert sampling["structured_outputs"] is None
    assert rendered["stream"] is False and rendered["stream_options"] is None
    assert rendered["priority"] == 0
    generated = await (await client.post(CHAT, json=body)).get_json()
    assert generated["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    assert engine.rendered[0].prompt == engine.requests[0].prompt
    assert engine.rendered[0].sampling == engine.requests[0].sampling


async def test_completion_render_is_a_list_of_one(app: Quart, engine: FakeEngine) -> None:
    client = app.test_client()
    response = await client.post(
        f"{COMPLETIONS}/render", json={"prompt": "hello there", "max_tokens": 5}
    )
    assert response.status_code == 200
    [rendered] = await response.get_json()
    assert rendered["request_id"].startswith("cmpl-")
    assert rendered["token_ids"] == engine.tokenize(engine.rendered[0].prompt)  # type: ignore[arg-type]
    assert rendered["prompt"] == "hello there" and rendered["sampling_params"]["max_tokens"] == 5
    ids = await (await client.post(f"{COMPLETIONS}/render", json={"prompt": [12, 11]})).get_json()
    assert ids[0]["token_ids"] == [12, 11]
    assert engine.requests == []


async def test_render_keeps_the_stream_fields_and_the_constraint(app: Quart) -> None:
    body = {
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    response = await app.test_client().post(f"{CHAT}/render", json=body)
    assert response.status_code == 200 and response.content_type == "application/json"
    rendered = await response.get_json()
    assert rendered["stream"] is True
    assert rendered["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert rendered["sampling_params"]["structured_outputs"] == {"choice": ["yes", "no"]}


def _render_route(route: str) -> str:
    return f"{route}/render"


@pytest.mark.parametrize(
    ("route", "body", "status", "param"), [r for r in BAD_REQUESTS if r[0] in (CHAT, COMPLETIONS)]
)
async def test_render_refuses_what_generation_refuses(
    app: Quart, route: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    client = app.test_client()
    real = await client.post(route, json=body)
    rendered = await client.post(_render_route(route), json=body)
    assert (rendered.status_code, await rendered.get_json()) == (
        real.status_code,
        await real.get_json(),
    )
    assert rendered.status_code == status
    await assert_still_serving(app)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (CHAT, {"model": "other-model", "messages": MESSAGES}),  # 404
        (CHAT, {"messages": [{"role": "user", "content": BAD_TEMPLATE}]}),  # the engine's 400
        (COMPLETIONS, {"prompt": " ".join(["word"] * MAX_MODEL_LEN)}),  # context length
        (
            CHAT,  # tools with "auto" need --enable-auto-tool-choice
            {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
        ),
    ],
)
async def test_render_errors_are_the_real_endpoints(
    app: Quart, route: str, body: dict[str, Any]
) -> None:
    client = app.test_client()
    real = await client.post(route, json=body)
    rendered = await client.post(_render_route(route), json=body)
    assert real.status_code in (400, 404)
    assert rendered.status_code == real.status_code
    assert await rendered.get_json() == await real.get_json()
    await assert_still_serving(app)


async def test_render_needs_a_ready_engine_and_the_key(
    make_app: Callable[..., Quart], engine: FakeEngine
) -> None:
    client = make_app(api_key="sk-right").test_client()
    key = {"Authorization": "Bearer sk-right"}
    for route in (CHAT, COMPLETIONS):
        body = {"messages": MESSAGES} if route == CHAT else {"prompt": "hi"}
        assert (await client.post(_render_route(route), json=body)).status_code == 401
        engine.ready = False
        refused = await client.post(_render_route(route), json=body, headers=key)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        engine.ready = True
        assert (await client.post(_render_route(route), json=body, headers=key)).status_code == 200


async def test_reset_prefix_cache(make_app: Callable[..., Quart], engine: FakeEngine) -> None:
    client = make_app(api_key="sk-right").test_client()
    key = {"Authorization": "Bearer sk-right"}
    refused = await client.post("/reset_prefix_cache")
    assert refused.status_code == 401 and engine.prefix_cache_resets == 0
    response = await client.post("/reset_prefix_cache", headers=key)
    assert response.status_code == 200 and await response.get_data() == b""
    assert engine.prefix_cache_resets == 1
    assert (await client.get("/reset_prefix_cache", headers=key)).status_code == 405
    engine.ready = False
    unready = await client.post("/reset_prefix_cache", headers=key)
    assert unready.status_code == 503
    assert (await unready.get_json())["error"]["type"] == "ServiceUnavailableError"
    engine.ready = True
    assert engine.prefix_cache_resets == 1
