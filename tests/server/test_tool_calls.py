"""Tool calls and reasoning as the official `openai` client sees them, streaming and not.

The fake engine replays the last message through the same parsers the detokenize stage runs, so
these tests put the model's "output" in the user message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionToolParam

from server.app import create_app
from server.config import ServerConfig
from tests.server.fake_engine import FakeEngine
from tests.server.live import LiveServer, free_port

TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'
TWO_CALLS = (
    CALL + ' <tool_call> {"name": "get_weather", "arguments": {"city": "Oslo"}} </tool_call>'
)
THINKING = "<think> it is sunny there </think> Sunny."


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    config = ServerConfig(
        host="127.0.0.1",
        port=free_port(),
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    with LiveServer(create_app(FakeEngine(), config), config) as live:
        yield live


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
        yield client


def ask(client: openai.OpenAI, said: str, **fields: Any) -> Any:
    return client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": said}], **fields
    )


def test_a_tool_call_comes_back_as_tool_calls(client: openai.OpenAI) -> None:
    response = ask(client, "Let me look. " + CALL, tools=TOOLS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look. "
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_tool_calls_accumulate_as_the_client_expects(client: openai.OpenAI) -> None:
    stream = ask(client, TWO_CALLS, tools=TOOLS, stream=True)
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            entry = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += part.id or ""
            entry["name"] += part.function.name or "" if part.function else ""
            entry["arguments"] += part.function.arguments or "" if part.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert sorted(calls) == [0, 1] and calls[0]["id"] != calls[1]["id"]
    assert [json.loads(c["arguments"])["city"] for c in calls.values()] == ["Paris", "Oslo"]
    assert all(c["name"] == "get_weather" for c in calls.values())


def test_parallel_tool_calls_false_keeps_the_first(client: openai.OpenAI) -> None:
    response = ask(client, TWO_CALLS, tools=TOOLS, parallel_tool_calls=False)
    (call,) = response.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_choice_none_and_no_tools_leave_the_text_alone(client: openai.OpenAI) -> None:
    for fields in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        response = ask(client, CALL, **fields)
        assert response.choices[0].message.content == CALL
        assert not response.choices[0].message.tool_calls
        assert response.choices[0].finish_reason == "stop"


def test_reasoning_is_split_out(client: openai.OpenAI) -> None:
    message = ask(client, THINKING).choices[0].message
    assert message.content == " Sunny."
    extra = message.model_extra or {}
    assert extra["reasoning_content"] == extra["reasoning"] == " it is sunny there "
    stream = ask(client, THINKING, stream=True)
    reasoning, content = "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == (" it is sunny there ", " Sunny.")


def test_usage_counts_the_reasoning_tokens(client: openai.OpenAI) -> None:
    # The words "it is sunny there" and " </think>", whose space is the reasoning's last.
    response = ask(client, THINKING)
    assert response.usage is not None and response.usage.completion_tokens == 7
    details = response.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == 5
    stream = ask(client, THINKING, stream=True, stream_options={"include_usage": True})
    *_, last = list(stream)
    assert last.usage is not None and last.usage.completion_tokens_details is not None
    assert last.usage.completion_tokens_details.reasoning_tokens == 5
    both = ask(client, THINKING, n=2)
    assert both.usage.completion_tokens_details.reasoning_tokens == 10  # summed over choices
    hidden = ask(client, THINKING, extra_body={"include_reasoning": False})
    assert hidden.usage.completion_tokens_details.reasoning_tokens == 5  # generated all the same
    plain = ask(client, "no reasoning at all")
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


def test_include_reasoning_false_drops_it(client: openai.OpenAI) -> None:
    message = ask(client, THINKING, extra_body={"include_reasoning": False}).choices[0].message
    assert message.content == " Sunny."
    assert "reasoning_content" not in (message.model_extra or {})


def test_reasoning_then_a_call(client: openai.OpenAI) -> None:
    message = ask(client, "<think> need weather </think> " + CALL, tools=TOOLS).choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == " need weather "
    assert message.content is None and message.tool_calls
    assert message.tool_calls[0].function.name == "get_weather"


def test_assistant_tool_calls_and_tool_results_are_accepted_in_the_history(
    client: openai.OpenAI,
) -> None:
    response = client.chat.completions.create(
        model="fake-model",
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    assert response.choices[0].message.content == "sunny"


def test_a_streamed_call_opens_with_its_name_then_streams_its_arguments(
    client: openai.OpenAI,
) -> None:
    """As vLLM streams auto tool calls: a delta with the id and name as soon as they are written,
    then the arguments piece by piece (the fake engine writes a word per token); joined, they are
    the non-streaming response's arguments, valid JSON."""
    said = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}} </tool_call>'
    stream = ask(client, said, tools=TOOLS, stream=True)
    pieces = [
        part
        for chunk in stream
        if chunk.choices
        for part in chunk.choices[0].delta.tool_calls or ()
    ]
    opening, rest = pieces[0], pieces[1:]
    assert opening.id and opening.type == "function" and opening.function
    assert opening.function.name == "get_weather"
    assert len(rest) >= 3 and all(p.id is None and p.index == 0 for p in rest)
    assert all(p.function and p.function.name is None for p in rest)
    arguments = "".join((p.function.arguments or "") if p.function else "" for p in pieces)
    assert json.loads(arguments) == {"city": "Paris", "days": 3}
    (whole,) = ask(client, said, tools=TOOLS).choices[0].message.tool_calls or []
    assert whole.function.arguments == arguments
    # the SDK's own accumulation agrees
    with client.chat.completions.stream(
        model="fake-model", messages=[{"role": "user", "content": said}], tools=TOOLS
    ) as events:
        final = events.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", arguments)
    assert final.choices[0].finish_reason == "tool_calls"
