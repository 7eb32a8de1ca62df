"""What vLLM's own entrypoint tests expect of its API (issue 36), row by row, against the
FakeEngine: the streamed finish, null keys, -1 logprob counts, custom roles, batched prompts."""

from __future__ import annotations

import json
from typing import Any

import pytest
from quart import Quart

from stages.api import ChatPrompt, TokensPrompt
from tests.server.fake_engine import VOCAB_SIZE, FakeEngine
from tests.server.test_errors import CHAT, COMPLETIONS, assert_error, chat, completion

pytestmark = pytest.mark.anyio

SENTENCE = [{"role": "user", "content": "one two three four five"}]


def events(raw: bytes) -> list[dict[str, Any]]:
    lines = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
    return [json.loads(line) for line in lines if line != b"[DONE]"]


async def stream(app: Quart, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await app.test_client().post(route, json={**body, "stream": True})
    assert response.status_code == 200
    return events(await response.get_data())


@pytest.mark.parametrize(
    ("route", "body"),
    [(CHAT, chat(messages=SENTENCE)), (COMPLETIONS, completion(prompt="one two three four five"))],
)
async def test_the_last_token_and_the_finish_share_a_chunk(
    app: Quart, route: str, body: dict[str, Any]
) -> None:
    """vLLM's test_chat_streaming: one chunk a token, the finish on the last of them, and
    continuous usage counts each token once (no chunk repeats the one before's count)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = await stream(app, route, {**body, "max_tokens": 4, "stream_options": options})
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    key = "delta" if route == CHAT else None
    texts = [
        (c["choices"][0][key].get("content") if key else c["choices"][0]["text"]) for c in chunks
    ]
    with_text = [t for t in texts if t]
    assert len(with_text) == 4 and "".join(with_text).split() == ["one", "two", "three", "four"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "length" and finishes.count(None) == len(chunks) - 1
    assert texts[-1] == " four"
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[1:] == sorted(set(counts[1:])), counts  # strictly rising after the role chunk


async def test_a_finish_without_text_still_has_its_chunk(app: Quart) -> None:
    """A stop string that cuts the last token leaves no text: the finish goes in an empty delta."""
    chunks = await stream(app, CHAT, chat(messages=SENTENCE, stop=[" thr"]))
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": " thr",
    }
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "one two"


async def test_keys_vllm_defines_are_null_when_not_asked_for(app: Quart) -> None:
    body = await (await app.test_client().post(CHAT, json=chat())).get_json()
    assert body["prompt_logprobs"] is None and body["prompt_token_ids"] is None
    assert body["choices"][0]["token_ids"] is None
    asked = await (await app.test_client().post(CHAT, json=chat(prompt_logprobs=1))).get_json()
    assert len(asked["prompt_logprobs"]) > 1


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (CHAT, chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
        (CHAT, chat(prompt_logprobs=-1), "prompt_logprobs"),
        (COMPLETIONS, completion(logprobs=-1), "logprobs"),
        (COMPLETIONS, completion(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
async def test_minus_one_is_the_whole_vocabulary_within_max_logprobs(
    make_app: Any, engine: FakeEngine, route: str, body: dict[str, Any], param: str
) -> None:
    """-1 asks for every token; the default --max-logprobs 20 refuses it (as vLLM's
    test_prompt_logprobs_chat expects), --max-logprobs -1 grants it."""
    response = await make_app().test_client().post(route, json=body)
    assert response.status_code == 400
    error = await response.get_json()
    assert_error(error, "BadRequestError", param)
    assert f"of {VOCAB_SIZE}, which is greater than max allowed: 20" in error["error"]["message"]
    response = await make_app(max_logprobs=-1).test_client().post(route, json=body)
    assert response.status_code == 200
    sampling = engine.requests[-1].sampling
    assert VOCAB_SIZE in (sampling.logprobs, sampling.prompt_logprobs)


@pytest.mark.parametrize("value", [-2, -100])
async def test_counts_below_minus_one_are_refused(app: Quart, value: int) -> None:
    response = await app.test_client().post(CHAT, json=chat(prompt_logprobs=value))
    assert response.status_code == 400
    assert_error(await response.get_json(), "BadRequestError", "prompt_logprobs")


async def test_a_custom_role_reaches_the_chat_template(app: Quart, engine: FakeEngine) -> None:
    """vLLM's test_custom_role: any role string is the template's to interpret, as a string or
    as content parts."""
    for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}]):
        messages = [{"role": "my-custom-role", "content": content}]
        response = await app.test_client().post(CHAT, json=chat(messages=messages))
        assert response.status_code == 200
        prompt = engine.requests[-1].prompt
        assert isinstance(prompt, ChatPrompt) and prompt.messages[0]["role"] == "my-custom-role"


async def test_a_text_completion_takes_a_batch_of_prompts(app: Quart, engine: FakeEngine) -> None:
    """OpenAI's prompt forms (vLLM's test_batch_completions): a list of strings, or of lists of
    token ids, is one choice per prompt (x n), numbered prompt by prompt; usage counts every
    prompt once and every choice's tokens."""
    ids = [engine.word_id(w) for w in ("red", "green", "blue")]
    for prompt in (["red green", "blue"], [ids[:2], ids[2:]]):
        response = await app.test_client().post(COMPLETIONS, json=completion(prompt=prompt, n=2))
        assert response.status_code == 200
        body = await response.get_json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in body["choices"]] == ["red green"] * 2 + ["blue"] * 2
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
        assert "metrics" not in body  # one choice's figures are not the request's
    assert len({r.request_id for r in engine.requests[-4:]}) == 1  # the response's id


async def test_batched_prompts_stream_one_choice_a_chunk(app: Quart) -> None:
    chunks = await stream(app, COMPLETIONS, completion(prompt=["red green", "blue"], echo=True))
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "red greenred green", 1: "blueblue"}  # each echoes its own prompt
    assert finishes == {0: "stop", 1: "stop"}


async def test_batched_prompts_render_one_request_each(app: Quart) -> None:
    response = await app.test_client().post(
        f"{COMPLETIONS}/render", json=completion(prompt=["red green", "blue"])
    )
    rendered = await response.get_json()
    assert [r["prompt"] for r in rendered] == ["red green", "blue"]


async def test_a_prompt_that_fails_fails_the_batch_and_frees_the_others(
    app: Quart, engine: FakeEngine
) -> None:
    response = await app.test_client().post(
        COMPLETIONS, json=completion(prompt=["red", "word " * 80])
    )
    assert response.status_code == 400
    assert_error(await response.get_json(), "BadRequestError", "prompt")
    assert not engine.running


async def test_tokenize_gives_token_strs_only_when_asked(app: Quart, engine: FakeEngine) -> None:
    """vLLM's test_tokenize_with_return_token_strs: `token_strs` is null unless asked for."""
    client = app.test_client()
    plain = await (await client.post("/tokenize", json={"prompt": "red green"})).get_json()
    assert plain["token_strs"] is None and plain["count"] == 2
    asked = await (
        await client.post("/tokenize", json={"prompt": "red green", "return_token_strs": True})
    ).get_json()
    assert asked["tokens"] == plain["tokens"] and asked["token_strs"] == ["red", "green"]


async def test_tokenize_passes_add_special_tokens_for_messages(
    app: Quart, engine: FakeEngine
) -> None:
    """For messages vLLM's default is off (the template writes BOS); on, the prompt asks for it."""
    client = app.test_client()
    for asked, expected in ((None, False), (True, True), (False, False)):
        body: dict[str, Any] = {"messages": SENTENCE}
        if asked is not None:
            body["add_special_tokens"] = asked
        engine.tokenized.clear()
        assert (await client.post("/tokenize", json=body)).status_code == 200
        (prompt,) = engine.tokenized
        assert isinstance(prompt, ChatPrompt) and prompt.add_special_tokens is expected
    await client.post(CHAT, json=chat(add_special_tokens=True))
    assert engine.requests[-1].prompt.add_special_tokens is True  # type: ignore[union-attr]


async def test_tokenizer_info_is_served_only_with_its_flag(make_app: Any) -> None:
    response = await make_app().test_client().get("/tokenizer_info")
    assert response.status_code == 404
    app = make_app(enable_tokenizer_info_endpoint=True)
    info = await (await app.test_client().get("/tokenizer_info")).get_json()
    assert info["tokenizer_class"] == "FakeWordTokenizer"


async def test_load_counts_generation_requests_in_flight(make_app: Any, engine: FakeEngine) -> None:
    """vLLM's test_server_load: 0, 1 while a request runs (a stream until its last chunk), 0."""
    app = make_app()
    engine.token_delay_s = 0.05
    client = app.test_client()

    async def load() -> int:
        body = await (await client.get("/load")).get_json()
        return int(body["server_load"])

    assert await load() == 0
    async with client.request(COMPLETIONS, method="POST") as connection:
        await connection.send(json.dumps(completion(prompt="a b c d", stream=True)).encode())
        await connection.send_complete()
        await connection.receive()  # the stream has begun
        assert await load() == 1
        while await connection.receive():
            pass
    assert await load() == 0
    response = await client.post(COMPLETIONS, json=completion(prompt=["a b", "c"]))
    assert response.status_code == 200 and await load() == 0
    refused = await client.post(COMPLETIONS, json=completion(prompt="word " * 80))
    assert refused.status_code == 400 and await load() == 0


async def test_invocations_answers_chat_and_completion_bodies(app: Quart) -> None:
    """SageMaker's entry point, as vLLM routes it: by the body's shape."""
    client = app.test_client()
    chat_body = await (await client.post("/invocations", json=chat())).get_json()
    assert chat_body["object"] == "chat.completion"
    assert chat_body["choices"][0]["message"]["content"] == "hello there"
    text_body = await (await client.post("/invocations", json=completion())).get_json()
    assert text_body["object"] == "text_completion" and text_body["choices"][0]["text"]
    response = await client.post("/invocations", json={"input": "x"})
    assert response.status_code == 400
    assert_error(await response.get_json(), "BadRequestError", "messages")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"options": {"$ref": "#/$defs/WeatherOptions"}},
            "required": ["options"],
            "$defs": {
                "WeatherOptions": {
                    "type": "object",
                    "properties": {"unit": {"type": "string", "enum": ["C", "F"]}},
                    "required": ["unit"],
                }
            },
        },
    },
}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_tool_schemas_with_defs_compile_under_a_forced_choice(
    app: Quart, engine: FakeEngine, tool_choice: Any
) -> None:
    """vLLM's test_completion_with_function_calling: `$ref`s into a tool's `$defs` resolve under
    `required` (whose grammar nests each tool's parameters, so the defs move to its root)."""
    from stages.text.structured import compile_grammar

    body = chat(tools=[WEATHER_TOOL], tool_choice=tool_choice)
    response = await app.test_client().post(CHAT, json=body)
    assert response.status_code == 200
    spec = engine.requests[-1].sampling.structured
    assert spec is not None and "WeatherOptions" in json.loads(spec.value)["$defs"]
    compile_grammar(spec)  # raises EngineError on a dangling pointer


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
@pytest.mark.parametrize(
    "other",
    [
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"regex": "[a-z]+"}},
    ],
)
async def test_a_forced_call_takes_the_place_of_another_structured_output(
    app: Quart, engine: FakeEngine, tool_choice: Any, other: dict[str, Any]
) -> None:
    """vLLM's test_response_format_with_tool_choice_required: the call's schema constrains the
    output and the reply is the call (a forced call has no content for response_format to
    shape); a malformed other is still refused."""
    messages = [{"role": "user", "content": '[{"name": "get_weather", "parameters": {}}]'}]
    if tool_choice != "required":
        messages = [{"role": "user", "content": "{}"}]
    body = chat(messages=messages, tools=[WEATHER_TOOL], tool_choice=tool_choice, **other)
    response = await app.test_client().post(CHAT, json=body)
    assert response.status_code == 200
    spec = engine.requests[-1].sampling.structured
    assert spec is not None and spec.kind == "json" and "WeatherOptions" in spec.value
    choice = (await response.get_json())["choices"][0]
    # a named choice finishes "stop" (the call was the reply asked for), as in vLLM and OpenAI
    assert choice["finish_reason"] == ("tool_calls" if tool_choice == "required" else "stop")
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    malformed = chat(
        tools=[WEATHER_TOOL], tool_choice=tool_choice, response_format={"type": "yaml"}
    )
    refused = await app.test_client().post(CHAT, json=malformed)
    assert refused.status_code == 400
    assert_error(await refused.get_json(), "BadRequestError", "response_format.type")


async def test_two_tools_defining_one_name_differently_are_refused(app: Quart) -> None:
    other = json.loads(json.dumps(WEATHER_TOOL))
    other["function"]["name"] = "get_forecast"
    other["function"]["parameters"]["$defs"]["WeatherOptions"]["required"] = []
    response = await app.test_client().post(
        CHAT, json=chat(tools=[WEATHER_TOOL, other], tool_choice="required")
    )
    assert response.status_code == 400
    assert_error(await response.get_json(), "BadRequestError", "tools")


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_a_forced_call_cut_by_max_tokens_is_no_call(app: Quart, tool_choice: Any) -> None:
    """vLLM's test_max_tokens_with_tool_choice_required: finish "length", no tool_calls, empty
    content (the partial JSON is neither a call nor a reply)."""
    messages = [{"role": "user", "content": '{"options": {"unit": "C"}}'}]
    body = chat(messages=messages, tools=[WEATHER_TOOL], tool_choice=tool_choice, max_tokens=1)
    choice = (await (await app.test_client().post(CHAT, json=body)).get_json())["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"] and choice["message"]["content"] == ""


async def test_the_batch_chat_endpoint_answers_each_conversation(
    app: Quart, engine: FakeEngine
) -> None:
    """vLLM's test_batched_chat_completions: one choice per conversation, indexed in order."""
    conversations = [
        [{"role": "user", "content": "alpha one"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "beta"}],
    ]
    response = await app.test_client().post(
        f"{CHAT}/batch", json={"messages": conversations, "max_tokens": 5}
    )
    assert response.status_code == 200
    body = await response.get_json()
    assert body["object"] == "chat.completion"
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [
        (0, "alpha one"),
        (1, "beta"),
    ]
    prompts = [r.prompt for r in engine.requests[-2:]]
    assert [len(p.messages) for p in prompts] == [1, 2]  # type: ignore[union-attr]
    assert body["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"tools": [WEATHER_TOOL]}, "tools"),
        ({"messages": [[{"role": "user", "content": "a"}], []]}, "messages[1]"),
        ({"messages": [[{"role": "user", "content": "a"}], [{"role": 5}]]}, "messages[1][0].role"),
        (
            {"kv_transfer_params": {"prompt_token_ids": [1, 2]}},
            "kv_transfer_params['prompt_token_ids']",
        ),
    ],
)
async def test_the_batch_chat_endpoint_refuses_what_vllm_refuses(
    app: Quart, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": [[{"role": "user", "content": "a"}]], **extra}
    response = await app.test_client().post(f"{CHAT}/batch", json=body)
    assert response.status_code == 400
    assert_error(await response.get_json(), "BadRequestError", param)


@pytest.mark.parametrize("metrics_format", ["TEXT", "json"])
async def test_an_orca_load_report_rides_on_a_generation_response(
    app: Quart, metrics_format: str
) -> None:
    """vLLM's test_orca_metrics: the header asks, the response carries the engine's load."""
    response = await app.test_client().post(
        CHAT, json=chat(), headers={"endpoint-load-metrics-format": metrics_format}
    )
    report = response.headers["endpoint-load-metrics"]
    if metrics_format == "TEXT":
        assert report == (
            "TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=0.0"
        )
    else:
        kind, _, body = report.partition(" ")
        assert kind == "JSON" and json.loads(body)["named_metrics"]["kv_cache_usage_perc"] == 0.25
    plain = await app.test_client().post(CHAT, json=chat())
    assert "endpoint-load-metrics" not in plain.headers


@pytest.mark.parametrize(
    ("route", "body", "words"),
    [
        (CHAT, chat(seed=2**63), "less_than_equal"),  # vLLM's test_long_seed
        (CHAT, chat(seed=-(2**63) - 1), "greater_than_equal"),
        (COMPLETIONS, {"prompt": None, "prompt_embeds": []}, "Either prompt or prompt_embeds"),
        (COMPLETIONS, completion(prompt=[999999]), "out of vocabulary"),
        # every bad logit_bias key named at once (vLLM's test_chat_logit_bias_validation)
        (CHAT, chat(logit_bias={"bad1": 1.0, "bad2": 2.0}), "['bad1', 'bad2']"),
        (CHAT, chat(logit_bias={"5": 1.0, "999999": 2.0, "-1": 0.5}), "[999999, -1]"),
    ],
)
async def test_errors_carry_the_words_vllm_clients_look_for(
    app: Quart, route: str, body: dict[str, Any], words: str
) -> None:
    response = await app.test_client().post(route, json=body)
    assert response.status_code == 400
    assert words in (await response.get_json())["error"]["message"]


async def test_a_priority_needs_the_priority_policy(make_app: Any, engine: FakeEngine) -> None:
    """vLLM's --scheduling-policy: under fcfs (its default) a priority would be ignored, so it
    is refused; under priority it reaches the scheduler."""
    response = await make_app().test_client().post(CHAT, json=chat(priority=3))
    assert response.status_code == 400
    assert_error(await response.get_json(), "BadRequestError", "priority")
    assert (await make_app().test_client().post(CHAT, json=chat(priority=0))).status_code == 200
    app = make_app(scheduling_policy="priority")
    assert (await app.test_client().post(CHAT, json=chat(priority=3))).status_code == 200
    assert engine.requests[-1].priority == 3


def _sample(text: str, name: str) -> float:
    """The value of one unlabelled-but-for-model_name sample of the exposition text."""
    prefix = f'{name}{{model_name="fake-model"}} '
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].removeprefix(prefix))


async def test_the_per_request_histograms_vllm_exports(app: Quart, engine: FakeEngine) -> None:
    """vLLM's request_params_n and request_max_num_generation_tokens count a request once its
    choices are done; request_params_max_tokens, request_num_preemptions and
    request_time_per_output_token_seconds count each of them."""
    client = app.test_client()
    one = await (await client.post(CHAT, json=chat(max_tokens=5))).get_json()
    three = await (await client.post(CHAT, json=chat(n=3, max_tokens=7))).get_json()
    assert len(three["choices"]) == 3
    text = (await (await client.get("/metrics")).get_data()).decode()
    assert _sample(text, "vllm:request_params_n_count") == 2
    assert _sample(text, "vllm:request_params_n_sum") == 1 + 3
    assert _sample(text, "vllm:request_params_max_tokens_count") == 1 + 3
    assert _sample(text, "vllm:request_params_max_tokens_sum") == 5 + 3 * 7
    assert _sample(text, "vllm:request_max_num_generation_tokens_count") == 2
    # the first request's one choice, and at least the mean of the other's three
    most = _sample(text, "vllm:request_max_num_generation_tokens_sum")
    assert most >= one["usage"]["completion_tokens"] + three["usage"]["completion_tokens"] / 3
    assert _sample(text, "vllm:request_num_preemptions_count") == 4
    assert _sample(text, "vllm:request_time_per_output_token_seconds_count") == 4
    assert _sample(text, "vllm:prompt_tokens_cached_total") == 0
    # nothing cached: every prompt token of each choice was computed
    assert _sample(text, "vllm:request_prefill_kv_computed_tokens_count") == 4
    computed = one["usage"]["prompt_tokens"] + 3 * three["usage"]["prompt_tokens"]
    assert _sample(text, "vllm:request_prefill_kv_computed_tokens_sum") == computed
    engine.cached_prompt_tokens = 2  # a request whose prompt starts in the prefix cache
    again = await (await client.post(CHAT, json=chat(max_tokens=5))).get_json()
    text = (await (await client.get("/metrics")).get_data()).decode()
    computed += again["usage"]["prompt_tokens"] - 2
    assert _sample(text, "vllm:request_prefill_kv_computed_tokens_sum") == computed
    assert _sample(text, "vllm:prompt_tokens_cached_total") == 2


@pytest.mark.parametrize("exclude", [False, True])
async def test_tools_leave_the_prompt_when_tool_choice_is_none_if_the_server_says_so(
    make_app: Any, engine: FakeEngine, exclude: bool
) -> None:
    """vLLM's --exclude-tools-when-tool-choice-none: off, the template sees the tools of a request
    that may call none; on, it does not."""
    app = make_app(exclude_tools_when_tool_choice_none=exclude)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    response = await app.test_client().post(CHAT, json=chat(tools=tools, tool_choice="none"))
    assert response.status_code == 200
    prompt = engine.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt)
    assert prompt.tools == (None if exclude else tools)


async def test_metrics_say_which_backend_compiles_the_grammars(make_app: Any) -> None:
    """--structured-outputs-config's backend is served by llguidance (vLLM's guidance): the
    substitution is in /metrics, not only in the start's log."""
    for requested in ("xgrammar", "auto"):
        text = await (
            await make_app(structured_outputs_backend=requested).test_client().get("/metrics")
        ).get_data(as_text=True)
        assert (
            f'vllm:structured_outputs_info{{backend="guidance",model_name="fake-model",'
            f'requested="{requested}"}} 1.0'
        ) in text


async def test_prompt_ids_forwarded_in_kv_transfer_params_are_the_prompt(
    app: Quart, engine: FakeEngine
) -> None:
    """vLLM's decode-side reuse (test_kv_transfer_prompt_token_ids_round_trip): the ids a
    prefill server tokenized are used as they are, whatever the messages say; with echo the
    messages are rendered; other kv_transfer_params still need a KV connector."""
    client = app.test_client()
    reused = {"kv_transfer_params": {"prompt_token_ids": [7, 8, 9]}, "return_token_ids": True}
    body = await (await client.post(CHAT, json=chat(max_tokens=2, **reused))).get_json()
    assert body["prompt_token_ids"] == [7, 8, 9]
    assert isinstance(engine.requests[-1].prompt, TokensPrompt)
    await client.post(CHAT, json=chat(max_tokens=2, echo=True, **reused))
    assert isinstance(engine.requests[-1].prompt, ChatPrompt)  # echo renders the messages
    for params, param in (
        ({"prompt_token_ids": []}, "kv_transfer_params.prompt_token_ids"),
        ({"prompt_token_ids": [1, True]}, "kv_transfer_params.prompt_token_ids"),
        ({"prompt_token_ids": [10**7]}, "kv_transfer_params.prompt_token_ids"),
        ({"prompt_token_ids": [1], "do_remote_prefill": True}, "kv_transfer_params"),
    ):
        response = await client.post(CHAT, json=chat(max_tokens=2, kv_transfer_params=params))
        assert response.status_code == 400, params
        assert (await response.get_json())["error"]["param"] == param
