"""No client holds up the others: what takes long per request (tokenizing a huge body, parsing a
large one) runs in worker threads, and the event loop keeps answering everyone else."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import anyio.to_thread
import pytest
from quart import Quart

from server.openai_serving import INLINE_BODY_BYTES
from tests.server.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


async def test_health_and_a_stream_are_answered_while_tokenize_is_at_work(
    app: Quart, engine: FakeEngine
) -> None:
    gate = threading.Event()
    engine.tokenize_gate = gate  # the fake tokenizer holds its thread until the gate opens
    client = app.test_client()
    finished: list[str] = []

    async def call(name: str, path: str, body: Any = None) -> Any:
        response = await (client.get(path) if body is None else client.post(path, json=body))
        data = await response.get_data(as_text=True)
        finished.append(name)
        return response.status_code, data

    heavy = asyncio.create_task(call("tokenize", "/tokenize", {"prompt": "many many words"}))
    try:
        assert await anyio.to_thread.run_sync(engine.tokenizing.wait, 10)
        health = await call("health", "/health")
        stream = await call(
            "stream",
            CHAT,
            {"messages": [{"role": "user", "content": "one two three"}], "stream": True},
        )
    finally:
        gate.set()
    tokenized = await heavy
    assert finished == ["health", "stream", "tokenize"]
    assert health[0] == 200 and stream[0] == 200 and stream[1].endswith("data: [DONE]\n\n")
    assert tokenized[0] == 200 and json.loads(tokenized[1])["count"] == 3


async def test_detokenize_errors_from_the_worker_are_openai_errors(app: Quart) -> None:
    response = await app.test_client().post("/detokenize", json={"tokens": [10, 5000]})
    assert response.status_code == 400
    error = (await response.get_json())["error"]
    assert error["param"] == "tokens[1]"
    unknown = await app.test_client().post("/tokenize", json={"model": "gpt-4", "prompt": "x"})
    assert unknown.status_code == 404


def long_chat(**fields: Any) -> dict[str, Any]:
    """A chat body past INLINE_BODY_BYTES (parsed in a worker thread), with a short prompt."""
    messages = [{"role": "user", "content": "a b c"}]
    return {"messages": messages, "user": "u" * INLINE_BODY_BYTES, **fields}


async def test_a_large_body_is_served_and_checked_as_a_small_one(app: Quart) -> None:
    client = app.test_client()
    assert len(json.dumps(long_chat())) > INLINE_BODY_BYTES
    ok = await client.post(CHAT, json=long_chat(max_tokens=3))
    assert ok.status_code == 200, await ok.get_json()
    assert (await ok.get_json())["choices"][0]["message"]["content"] == "a b c"
    bad = await client.post(CHAT, json=long_chat(temperature=9))
    assert bad.status_code == 400
    assert (await bad.get_json())["error"]["param"] == "temperature"
    unknown = await client.post(CHAT, json=long_chat(model="gpt-4"))
    assert unknown.status_code == 404
