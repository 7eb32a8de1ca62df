"""SSE framing and the abort path, driven without a network (Quart's test client, direct calls)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from quart import Quart

from server.chat import stream_chat
from server.drain import Drain
from server.metrics import ServerMetrics
from server.schemas import ChatCompletionRequest
from server.serving import Choice, ResponseContext, Tracker, start
from stages.api import ChatPrompt, GenerateRequest, SamplingParams
from tests.server.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "one two three four"}]


def events(text: str) -> list[Any]:
    frames = text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    return [json.loads(frame.removeprefix("data: ")) for frame in frames[:-2]]


async def test_metrics_ride_on_finish_chunk_without_include_usage(app: Quart) -> None:
    response = await app.test_client().post(
        "/v1/chat/completions", json={"messages": MESSAGES, "stream": True}
    )
    chunks = events(await response.get_data(as_text=True))
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["metrics"]["stage_time_ms"]["queue"] == pytest.approx(1.0)
    assert all("metrics" not in c for c in chunks[:-1])


async def test_no_metrics_unless_enabled(make_app: Any) -> None:
    app = make_app()
    client = app.test_client()
    response = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert "metrics" not in await response.get_json()
    response = await client.post(
        "/v1/completions",
        json={"prompt": "a b", "stream": True, "stream_options": {"include_usage": True}},
    )
    assert all("metrics" not in c for c in events(await response.get_data(as_text=True)))


async def test_completion_echo_streams_prompt_first(app: Quart) -> None:
    response = await app.test_client().post(
        "/v1/completions", json={"prompt": "red blue", "echo": True, "stream": True}
    )
    chunks = events(await response.get_data(as_text=True))
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts == ["red blue", "red", " blue"]  # the last text with the finish, as vLLM
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_closing_the_stream_aborts_the_request(engine: FakeEngine) -> None:
    metrics = ServerMetrics(engine.stats, "fake-model")
    body = ChatCompletionRequest(messages=MESSAGES, stream=True)
    request = GenerateRequest("r-1", ChatPrompt(MESSAGES), SamplingParams(), 0, time.monotonic_ns())
    tracker = Tracker(metrics, "r-1", request.arrival_ns)
    drain = Drain(timeout_s=30.0)
    first, outputs = await start(engine, request, drain)
    assert drain.in_flight == 1
    ctx = ResponseContext("r-1", "fake-model", 0, "fp", False)
    stream = stream_chat(ctx, body, [Choice(0, first, outputs, tracker)])
    pieces = [await anext(stream), await anext(stream), await anext(stream)]
    assert b'"content":" two"' in pieces[-1]
    await stream.aclose()  # what Quart does when the client goes away
    assert engine.aborted == ["r-1"]
    assert drain.in_flight == 0
    assert tracker.finish_reason == "abort"
    assert b'vllm:request_success_total{finished_reason="abort",model_name="fake-model"} 1.0' in (
        metrics.render()
    )


async def test_counters_follow_the_outputs(app: Quart) -> None:
    client = app.test_client()
    for _ in range(2):
        await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2})
    text = (await (await client.get("/metrics")).get_data(as_text=True)).splitlines()
    assert 'vllm:prompt_tokens_total{model_name="fake-model"} 6.0' in text
    assert 'vllm:generation_tokens_total{model_name="fake-model"} 4.0' in text
    assert (
        'vllm:request_success_total{finished_reason="length",model_name="fake-model"} 2.0' in text
    )
    assert 'vllm:time_to_first_token_seconds_count{model_name="fake-model"} 2.0' in text
    assert 'vllm:inter_token_latency_seconds_count{model_name="fake-model"} 2.0' in text


async def test_sampling_params_reach_the_engine(make_app, engine: FakeEngine) -> None:
    app = make_app(
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        scheduling_policy="priority",
    )
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}],
            }
        ],
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "seed": 3,
        "max_completion_tokens": 9,
        "max_tokens": 99,
        "min_tokens": 1,
        "stop": "x",
        "stop_token_ids": [2],
        "ignore_eos": True,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "logprobs": True,
        "top_logprobs": 4,
        "logit_bias": {"12": -5},
        "priority": -1,
        "add_generation_prompt": False,
        "continue_final_message": False,
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto",
        "response_format": {"type": "text"},
    }
    response = await app.test_client().post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    request = engine.requests[-1]
    assert request.priority == -1
    assert request.sampling == SamplingParams(
        temperature=0.0,
        top_p=0.5,
        top_k=7,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        seed=3,
        max_tokens=9,
        min_tokens=1,
        stop=("x",),
        stop_token_ids=(2,),
        ignore_eos=True,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        logprobs=4,
        logit_bias={12: -5.0},
    )
    prompt = request.prompt
    assert isinstance(prompt, ChatPrompt)
    # content parts reach the engine as given; render formats them for the template
    assert prompt.messages == body["messages"]
    assert prompt.add_generation_prompt is False
    assert prompt.chat_template_kwargs == {"enable_thinking": False}
    assert prompt.tools == [{"type": "function", "function": {"name": "f"}}]
    assert (request.reasoning_parser, request.tool_call_parser) == ("qwen3", "hermes")


async def test_defaults_are_the_engines_but_16_completion_tokens(
    app: Quart, engine: FakeEngine
) -> None:
    await app.test_client().post("/v1/completions", json={"prompt": "a"})
    assert engine.requests[-1].sampling == SamplingParams(max_tokens=16)  # as OpenAI and vLLM
    await app.test_client().post("/v1/chat/completions", json={"messages": MESSAGES})
    assert engine.requests[-1].sampling == SamplingParams()


async def test_prompt_logprobs_in_vllm_shape(app: Quart, engine: FakeEngine) -> None:
    client = app.test_client()
    body = {"messages": [{"role": "user", "content": "one two three"}], "prompt_logprobs": 2}
    response = await client.post("/v1/chat/completions", json=body)
    data = await response.get_json()
    prompt_ids = engine.tokenize(engine.requests[-1].prompt)  # type: ignore[arg-type]
    scored = data["prompt_logprobs"]
    assert engine.requests[-1].sampling.prompt_logprobs == 2
    assert len(scored) == len(prompt_ids) == data["usage"]["prompt_tokens"] and scored[0] is None
    for token_id, entry in zip(prompt_ids[1:], scored[1:], strict=True):
        own = entry[str(token_id)]
        assert own["rank"] == 1 and own["decoded_token"] == " " + engine.detokenize([token_id])
        assert len(entry) == 2  # its own token (the best here) and one alternative
        assert sorted(e["rank"] for e in entry.values()) == [1, 2]
    response = await client.post(
        "/v1/completions", json={"prompt": "a b c", "prompt_logprobs": 0, "max_tokens": 1}
    )
    choice = (await response.get_json())["choices"][0]
    assert [e if e is None else len(e) for e in choice["prompt_logprobs"]] == [None, 1, 1]
    # echo + logprobs and prompt_logprobs together: the engine computes the larger count
    await client.post(
        "/v1/completions",
        json={"prompt": "a b", "prompt_logprobs": 1, "echo": True, "logprobs": 3},
    )
    assert engine.requests[-1].sampling.prompt_logprobs == 3
    response = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 400
    assert (await response.get_json())["error"]["param"] == "prompt_logprobs"


async def test_choices_wait_for_a_client_that_stops_reading() -> None:
    """n > 1: the choices' streams are pulled only as far as a few pieces ahead of the client,
    so one that stops reading leaves their output in the engine, which bounds it."""
    from server.serving import INTERLEAVED_PIECES, _interleave

    pulled = [0, 0, 0]

    async def endless(i: int):
        while True:
            pulled[i] += 1
            yield b"piece"
            await asyncio.sleep(0)

    pieces = _interleave([endless(i) for i in range(3)])
    assert await anext(pieces) == b"piece"
    await asyncio.sleep(0.3)  # the client reads nothing: thousands of pieces' time
    assert max(pulled) <= INTERLEAVED_PIECES * 3 + 2
    await pieces.aclose()
