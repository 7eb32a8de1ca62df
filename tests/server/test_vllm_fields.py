"""vLLM's request fields: each one either works as in vLLM or is a 400 that says it is not
supported, and the server goes on serving (issue 15). The engine is the FakeEngine; the stages'
side of these fields is tested in tests/stages and tests/e2e."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import structlog
from quart import Quart

from stages.api import ChatPrompt
from tests.server.fake_engine import FakeEngine
from tests.server.test_errors import (
    CHAT,
    COMPLETIONS,
    assert_error,
    assert_still_serving,
    chat,
    completion,
)

pytestmark = pytest.mark.anyio

TOOL = {"type": "function", "function": {"name": "f"}}
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def _tool_turn(arguments: str) -> list[dict[str, Any]]:
    """A conversation whose assistant called a tool with `arguments`."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "done", "tool_call_id": "c1"},
    ]


REFUSED = [
    # (route, body, param, words the message must say)
    # Beam search ranks beams on the model's own distribution: what reshapes it is refused.
    (CHAT, chat(use_beam_search=True, temperature=0.7), "temperature", "beam search"),
    (CHAT, chat(use_beam_search=True, top_p=0.9), "top_p", "beam search"),
    (CHAT, chat(use_beam_search=True, repetition_penalty=1.2), "repetition_penalty", "beam"),
    (CHAT, chat(use_beam_search=True, logprobs=True), "logprobs", "beam search"),
    (COMPLETIONS, completion(use_beam_search=True, logprobs=2), "logprobs", "beam search"),
    (COMPLETIONS, completion(use_beam_search=True, min_tokens=2), "min_tokens", "beam search"),
    (
        CHAT,
        chat(use_beam_search=True, response_format={"type": "json_object"}),
        "response_format",
        "structured outputs cannot be used with beam search",
    ),
    (CHAT, chat(use_beam_search=True, early_stopping="always"), "early_stopping", ""),
    (CHAT, chat(thinking_token_budget=-2), "thinking_token_budget", "non-negative integer"),
    (COMPLETIONS, completion(thinking_token_budget=0), "thinking_token_budget", "not supported"),
    (CHAT, chat(vllm_xargs={"k": 1}), "vllm_xargs", "not supported"),
    (CHAT, chat(best_of=2), "best_of", "best_of is not supported"),
    (COMPLETIONS, completion(best_of=3, n=2), "best_of", "best_of is not supported"),
    (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": 5}}]),
        "tools[0].function.parameters",
        "JSON Schema object",
    ),
    (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "description": ["x"]}}]),
        "tools[0].function.description",
        "string",
    ),
    (
        CHAT,
        chat(messages=_tool_turn("{city: Paris}")),
        "messages[1].tool_calls[0].function.arguments",
        "not valid JSON",
    ),
    (CHAT, chat(kv_transfer_params={"do_remote_decode": True}), "kv_transfer_params", "KV"),
    (COMPLETIONS, completion(suffix="!"), "suffix", "suffix is not currently supported"),
    (CHAT, chat(tools=[], tool_choice="auto"), "tools", "must not be an empty array"),
    (CHAT, chat(tools=[], tool_choice="none"), "tools", "must not be an empty array"),
    (CHAT, chat(tools=[]), "tools", "must not be an empty array"),
    (CHAT, chat(seed=2**63), "seed", ""),
    (COMPLETIONS, completion(seed=-(2**63) - 1), "seed", ""),
    (CHAT, chat(cache_salt=""), "cache_salt", ""),
    (CHAT, chat(cache_salt="x" * 129), "cache_salt", ""),
    (CHAT, chat(cache_salt="a/b"), "cache_salt", ""),
    (CHAT, chat(cache_salt="a@b"), "cache_salt", ""),
    (COMPLETIONS, completion(cache_salt=5), "cache_salt", ""),
    (CHAT, chat(stream_interval=0), "stream_interval", ""),
    (CHAT, chat(truncation_side="middle", truncate_prompt_tokens=2), "truncation_side", ""),
    (CHAT, chat(reasoning_effort="extreme"), "reasoning_effort", ""),
    (CHAT, chat(logprob_token_ids=[5]), "logprob_token_ids", "`logprobs` must be set"),
    (COMPLETIONS, completion(logprob_token_ids=[5]), "logprob_token_ids", "must be set"),
    (CHAT, chat(logprobs=True, logprob_token_ids=[]), "logprob_token_ids", ""),
    (CHAT, chat(logprobs=True, logprob_token_ids=[1] * 129), "logprob_token_ids", ""),
    (CHAT, chat(logprobs=True, logprob_token_ids=[1000]), "logprob_token_ids[0]", "vocabulary"),
    (
        CHAT,
        chat(response_format={"type": "structural_tag", "format": {"type": "const_string"}}),
        "response_format",
        "not supported",
    ),
    (
        COMPLETIONS,
        completion(structured_outputs={"structural_tag": "{not json"}),
        "structured_outputs.structural_tag",
        "not valid JSON",
    ),
    (
        CHAT,
        chat(structured_outputs={"structural_tag": "{}", "regex": "a"}),
        "structured_outputs",
        "exactly one",
    ),
    (
        CHAT,
        chat(structured_outputs={"json": {}, "disable_additional_properties": True}),
        "structured_outputs.disable_additional_properties",
        "not supported",
    ),
    (
        COMPLETIONS,
        completion(structured_outputs={"json": {}, "whitespace_pattern": " ?"}),
        "structured_outputs.whitespace_pattern",
        "not supported",
    ),
    (CHAT, chat(chat_template=TEMPLATE), "chat_template", "--trust-request-chat-template"),
    (
        CHAT,
        chat(chat_template_kwargs={"chat_template": TEMPLATE}),
        "chat_template",
        "--trust-request-chat-template",
    ),
]


@pytest.mark.parametrize(("route", "body", "param", "words"), REFUSED)
async def test_refused_fields_are_openai_400s(
    app: Quart, route: str, body: dict[str, Any], param: str, words: str
) -> None:
    response = await app.test_client().post(route, json=body)
    assert response.status_code == 400
    payload = await response.get_json()
    assert_error(payload, "BadRequestError", param)
    assert words in payload["error"]["message"]
    await assert_still_serving(app)


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"thinking_token_budget": -1},  # vLLM: unlimited, the same as leaving it out
        {"vllm_xargs": {}},
        {"kv_transfer_params": {}},
        {"use_beam_search": False},
        {"cache_salt": "s" * 128},
        {"best_of": 1},  # one candidate a choice: what every request gets
        {"messages": _tool_turn('{"city": "Paris"}')},
        {"messages": _tool_turn("")},  # vLLM: no arguments, as {}
    ],
)
async def test_the_values_vllm_reads_as_nothing_are_accepted(
    app: Quart, fields: dict[str, Any]
) -> None:
    response = await app.test_client().post(CHAT, json=chat(**fields))
    assert response.status_code == 200, await response.get_json()


async def test_length_penalty_without_beam_search_changes_nothing(
    app: Quart, engine: FakeEngine
) -> None:
    # vLLM uses length_penalty only to score beams: without beam search it has no effect.
    plain = await app.test_client().post(CHAT, json=chat(temperature=0))
    penalised = await app.test_client().post(CHAT, json=chat(temperature=0, length_penalty=0.2))
    assert penalised.status_code == 200
    assert engine.requests[-1].sampling == engine.requests[-2].sampling
    plain_body, penalised_body = await plain.get_json(), await penalised.get_json()
    assert plain_body["choices"] == penalised_body["choices"]


async def test_beam_search_is_one_search_over_n_choices(app: Quart, engine: FakeEngine) -> None:
    body = chat(use_beam_search=True, n=3, length_penalty=0.5, early_stopping=True, temperature=0)
    response = await app.test_client().post(CHAT, json=body)
    assert response.status_code == 200, await response.get_json()
    assert len((await response.get_json())["choices"]) == 3
    beams = [r.sampling.beam for r in engine.requests[-3:]]
    assert all(b is not None for b in beams)
    assert [b.index for b in beams if b] == [0, 1, 2]
    assert len({b.group for b in beams if b}) == 1
    assert {(b.width, b.length_penalty, b.early_stopping) for b in beams if b} == {(3, 0.5, True)}
    await app.test_client().post(CHAT, json=body)
    assert engine.requests[-1].sampling.beam.group != beams[0].group  # type: ignore[union-attr]


async def test_cache_salt_travels_with_the_request(app: Quart, engine: FakeEngine) -> None:
    response = await app.test_client().post(COMPLETIONS, json=completion(cache_salt="tenant-a"))
    assert response.status_code == 200
    assert engine.requests[-1].cache_salt == "tenant-a"
    await app.test_client().post(COMPLETIONS, json=completion())
    assert engine.requests[-1].cache_salt is None


async def test_stream_interval_travels_with_the_request(app: Quart, engine: FakeEngine) -> None:
    response = await app.test_client().post(CHAT, json=chat(stream=True, stream_interval=5))
    assert response.status_code == 200
    assert engine.requests[-1].stream_interval == 5
    await app.test_client().post(COMPLETIONS, json=completion(stream_interval=2))
    assert engine.requests[-1].stream_interval == 2


async def test_request_chat_template_is_used_when_trusted(
    make_app: Callable[..., Quart], engine: FakeEngine
) -> None:
    app = make_app(trust_request_chat_template=True)
    response = await app.test_client().post(CHAT, json=chat(chat_template=TEMPLATE))
    assert response.status_code == 200
    prompt = engine.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt) and prompt.chat_template == TEMPLATE
    kwargs = {"chat_template": TEMPLATE, "enable_thinking": False}
    await app.test_client().post(CHAT, json=chat(chat_template_kwargs=kwargs))
    prompt = engine.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt) and prompt.chat_template == TEMPLATE
    # the template is not also one of its own variables
    assert prompt.chat_template_kwargs == {"enable_thinking": False}


TEMPLATE_FIELDS = [
    {"chat_template": TEMPLATE},
    {"chat_template_kwargs": {"chat_template": TEMPLATE}},
]


@pytest.mark.parametrize("fields", TEMPLATE_FIELDS)
async def test_tokenize_refuses_an_untrusted_chat_template_as_chat_completions_does(
    app: Quart, engine: FakeEngine, fields: dict[str, Any]
) -> None:
    refused = await app.test_client().post(CHAT, json=chat(**fields))
    body = {"messages": chat()["messages"], **fields}
    tokenized = await app.test_client().post("/tokenize", json=body)
    assert tokenized.status_code == refused.status_code == 400
    assert await tokenized.get_json() == await refused.get_json()
    assert not engine.tokenized  # refused before anything is rendered


@pytest.mark.parametrize("fields", TEMPLATE_FIELDS)
async def test_tokenize_renders_the_prompt_chat_completions_would_when_trusted(
    make_app: Callable[..., Quart], engine: FakeEngine, fields: dict[str, Any]
) -> None:
    """A trusted template reaches the engine's /tokenize prompt just as it reaches chat's (the
    real tokenizer's side: tests/stages/test_request_templates.py)."""
    app = make_app(trust_request_chat_template=True)
    assert (await app.test_client().post(CHAT, json=chat(**fields))).status_code == 200
    body = {"messages": chat()["messages"], **fields}
    assert (await app.test_client().post("/tokenize", json=body)).status_code == 200
    (prompt,) = engine.tokenized
    assert isinstance(prompt, ChatPrompt) and prompt.chat_template == TEMPLATE
    assert prompt == engine.requests[-1].prompt


async def test_reasoning_effort_is_a_template_variable(app: Quart, engine: FakeEngine) -> None:
    await app.test_client().post(CHAT, json=chat(reasoning_effort="low"))
    prompt = engine.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt)
    # as vLLM: the effort, and enable_thinking unless the request set it
    assert prompt.chat_template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    body = chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    await app.test_client().post(CHAT, json=body)
    prompt = engine.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt)
    assert prompt.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": True}
    await app.test_client().post(CHAT, json=chat(reasoning_effort="none"))
    prompt = engine.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt)
    assert prompt.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}


async def test_detokenizer_options_reach_the_engine(app: Quart, engine: FakeEngine) -> None:
    body = completion(
        spaces_between_special_tokens=False, truncate_prompt_tokens=1, truncation_side="right"
    )
    assert (await app.test_client().post(COMPLETIONS, json=body)).status_code == 200
    sampling = engine.requests[-1].sampling
    assert sampling.spaces_between_special_tokens is False
    assert sampling.truncation_side == "right"
    await app.test_client().post(COMPLETIONS, json=completion(truncate_prompt_tokens=1))
    sampling = engine.requests[-1].sampling
    assert sampling.spaces_between_special_tokens is True  # vLLM's defaults
    assert sampling.truncation_side == "left"


async def test_unknown_fields_are_ignored_and_logged_once(
    make_app: Callable[..., Quart],
) -> None:
    app = make_app(log_level="debug")
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            response = await app.test_client().post(CHAT, json=chat(frobnicate=1, max_tokens=2))
            assert response.status_code == 200
        await app.test_client().post(COMPLETIONS, json=completion(frobnicate=2, wibble=3))
    unknown = [entry for entry in logs if entry["event"] == "unknown request field ignored"]
    assert [(e["field"], e["log_level"]) for e in unknown] == [
        ("frobnicate", "debug"),
        ("wibble", "debug"),
    ]


async def test_unknown_structured_outputs_keys_are_logged_as_unknown_fields_are(
    make_app: Callable[..., Quart], engine: FakeEngine
) -> None:
    """A key vLLM's StructuredOutputsParams does not have is ignored as a top-level one is,
    and logged (once) under its path; the kinds and vLLM's options are not."""
    app = make_app(log_level="debug")
    schema = {"type": "object"}
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):
            body = chat(structured_outputs={"json": schema, "bogus": 1, "disable_fallback": True})
            response = await app.test_client().post(CHAT, json=body)
            assert response.status_code == 200, await response.get_json()
        body = completion(structured_outputs={"regex": "a+", "wibble": 2}, frobnicate=3)
        assert (await app.test_client().post(COMPLETIONS, json=body)).status_code == 200
    unknown = [entry for entry in logs if entry["event"] == "unknown request field ignored"]
    assert [(e["field"], e["schema"], e["log_level"]) for e in unknown] == [
        ("structured_outputs.bogus", "ChatCompletionRequest", "debug"),
        ("frobnicate", "CompletionRequest", "debug"),
        ("structured_outputs.wibble", "CompletionRequest", "debug"),
    ]
    assert engine.requests[-1].sampling.structured is not None  # the known key still applies


async def test_unknown_fields_are_not_looked_for_unless_logging_at_debug(app: Quart) -> None:
    with structlog.testing.capture_logs() as logs:
        response = await app.test_client().post(CHAT, json=chat(frobnicate=1))
    assert response.status_code == 200
    assert not [entry for entry in logs if entry["event"] == "unknown request field ignored"]


async def test_chat_return_token_ids_and_prompt_text(app: Quart, engine: FakeEngine) -> None:
    response = await app.test_client().post(
        CHAT, json=chat(return_token_ids=True, return_prompt_text=True)
    )
    body = await response.get_json()
    prompt_ids = engine.tokenize(engine.requests[-1].prompt)  # type: ignore[arg-type]
    assert body["prompt_token_ids"] == prompt_ids
    assert body["prompt_text"] == engine.detokenize(prompt_ids)
    choice = body["choices"][0]
    assert choice["token_ids"] == [engine.word_id("hello"), engine.word_id("there")]
    plain = await (await app.test_client().post(CHAT, json=chat())).get_json()
    # not asked for: vLLM's keys are null, so a client's attributes exist
    assert plain["prompt_token_ids"] is None and plain["prompt_text"] is None
    assert plain["prompt_logprobs"] is None and plain["choices"][0]["token_ids"] is None


def _events(raw: bytes) -> list[dict[str, Any]]:
    lines = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
    return [json.loads(line) for line in lines if line != b"[DONE]"]


async def test_chat_stream_return_token_ids(app: Quart, engine: FakeEngine) -> None:
    body = chat(
        stream=True,
        return_token_ids=True,
        return_prompt_text=True,
        stop=["ther"],  # "there" is cut: its token's text is held back, its id still comes
        messages=[{"role": "user", "content": "hello big there"}],
    )
    response = await app.test_client().post(CHAT, json=body)
    events = _events(await response.get_data())
    prompt_ids = engine.tokenize(engine.requests[-1].prompt)  # type: ignore[arg-type]
    assert events[0]["prompt_token_ids"] == prompt_ids
    assert events[0]["prompt_text"] == engine.detokenize(prompt_ids)
    assert all("prompt_token_ids" not in e and "prompt_text" not in e for e in events[1:])
    streamed = [i for e in events for c in e["choices"] for i in c.get("token_ids", ())]
    assert streamed == [engine.word_id(w) for w in ("hello", "big", "there")]
    assert all("token_ids" in c for e in events[1:] for c in e["choices"])


async def test_completion_return_token_ids(app: Quart, engine: FakeEngine) -> None:
    body = await (
        await app.test_client().post(COMPLETIONS, json=completion(return_token_ids=True))
    ).get_json()
    ids = [engine.word_id("hello"), engine.word_id("there")]
    assert body["choices"][0]["prompt_token_ids"] == ids
    assert body["choices"][0]["token_ids"] == ids
    plain = await (await app.test_client().post(COMPLETIONS, json=completion())).get_json()
    assert {"prompt_token_ids", "token_ids", "prompt_logprobs"} <= set(plain["choices"][0])
    assert all(plain["choices"][0][key] is None for key in ("prompt_token_ids", "token_ids"))
    response = await app.test_client().post(
        COMPLETIONS, json=completion(return_token_ids=True, stream=True, echo=True)
    )
    events = _events(await response.get_data())
    choices = [c for e in events for c in e["choices"]]
    assert choices[0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c for c in choices[1:])
    assert [i for c in choices for i in c["token_ids"]] == ids


async def test_logprob_token_ids_take_the_place_of_the_top_logprobs(
    app: Quart, engine: FakeEngine
) -> None:
    body = chat(logprobs=True, top_logprobs=5, logprob_token_ids=[7, 8])
    payload = await (await app.test_client().post(CHAT, json=body)).get_json()
    sampling = engine.requests[-1].sampling
    assert sampling.logprob_token_ids == (7, 8) and sampling.logprobs == 2
    entry = payload["choices"][0]["logprobs"]["content"][0]
    # the FakeEngine's alternatives are the sampled token and one more: the sampled one is
    # listed first and once
    assert [alt["token"] for alt in entry["top_logprobs"]] == [entry["token"], "alt0"]
    await app.test_client().post(COMPLETIONS, json=completion(logprobs=0, logprob_token_ids=[3]))
    assert engine.requests[-1].sampling.logprobs == 1


STRUCTURES = {
    "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
    "triggers": ["<f"],
}


async def test_structural_tags_reach_the_engine(app: Quart, engine: FakeEngine) -> None:
    body = chat(response_format={"type": "structural_tag", **STRUCTURES})
    assert (await app.test_client().post(CHAT, json=body)).status_code == 200
    structured = engine.requests[-1].sampling.structured
    assert structured is not None and structured.kind == "structural_tag"
    assert json.loads(structured.value) == STRUCTURES
    body = completion(structured_outputs={"structural_tag": json.dumps(STRUCTURES)})
    assert (await app.test_client().post(COMPLETIONS, json=body)).status_code == 200
    structured = engine.requests[-1].sampling.structured
    assert structured is not None and json.loads(structured.value) == STRUCTURES
    assert structured.param == "structured_outputs.structural_tag"


async def test_reasoning_effort_none_leaves_the_output_whole(
    make_app: Callable[..., Quart],
) -> None:
    """As vLLM: with reasoning_effort "none" nothing is split out as reasoning."""
    app = make_app(reasoning_parser="qwen3")
    text = "<think> pondering </think> the answer"
    body = chat(messages=[{"role": "user", "content": text}])
    split = (await (await app.test_client().post(CHAT, json=body)).get_json())["choices"][0]
    assert split["message"]["reasoning_content"].strip() == "pondering"
    whole = await app.test_client().post(CHAT, json={**body, "reasoning_effort": "none"})
    message = (await whole.get_json())["choices"][0]["message"]
    assert message["content"] == text and "reasoning_content" not in message


async def test_thinking_token_budget_reaches_the_engine(
    make_app: Callable[..., Quart], engine: FakeEngine
) -> None:
    app = make_app(reasoning_parser="deepseek_r1")
    assert (
        await app.test_client().post(CHAT, json=chat(thinking_token_budget=7))
    ).status_code == 200
    assert engine.requests[-1].sampling.thinking_token_budget == 7
    assert engine.requests[-1].reasoning_parser == "deepseek_r1"  # whose tags mark the thinking
    await app.test_client().post(CHAT, json=chat(thinking_token_budget=-1))  # unlimited
    assert engine.requests[-1].sampling.thinking_token_budget is None
