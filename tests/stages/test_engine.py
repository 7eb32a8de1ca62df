"""The engine end to end through its four processes, on a tiny random model."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import pytest
from msgspec.structs import replace

from pipeline.clock import now_ns
from stages.api import (
    ChatPrompt,
    EngineError,
    GenerateRequest,
    SamplingParams,
    StructuredOutput,
    TextPrompt,
    TokensPrompt,
)


def request(prompt="Hello world!", rid="r", **sampling) -> GenerateRequest:
    if isinstance(prompt, str):
        prompt = TextPrompt(prompt)
    return GenerateRequest(rid, prompt, SamplingParams(**sampling), arrival_ns=now_ns())


async def collect(engine, req):
    return [out async for out in engine.generate(req)]


def test_greedy_stream_counts_and_metrics(engine_loop):
    engine, loop = engine_loop
    outs = loop.run(collect(engine, request(temperature=0, max_tokens=12, ignore_eos=True)))
    final = outs[-1]
    assert final.finish_reason == "length"
    assert final.num_output_tokens == 12
    assert sum(len(o.token_ids) for o in outs) == 12
    assert final.num_prompt_tokens == len(engine.bundle.encode("Hello world!"))
    m = final.metrics
    assert m is not None and m.arrival_ns <= m.rendered_ns <= m.scheduled_ns <= m.first_token_ns
    assert m.first_token_ns <= m.last_token_ns <= m.finished_ns
    assert m.prefill_s > 0 and m.decode_s > 0 and m.num_generated_tokens == 12
    # The text is the detokenization of exactly the tokens generated.
    ids = [t for o in outs for t in o.token_ids]
    assert "".join(o.text for o in outs) == engine.bundle.decode(ids, skip_special_tokens=True)


def test_greedy_is_deterministic_and_seed_reproducible(engine_loop):
    engine, loop = engine_loop
    greedy = [
        loop.run(collect(engine, request(temperature=0, max_tokens=8, ignore_eos=True)))
        for _ in range(2)
    ]
    flat = [[t for o in run for t in o.token_ids] for run in greedy]
    assert flat[0] == flat[1]
    seeded = [
        loop.run(collect(engine, request(temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)))
        for _ in range(2)
    ]
    flat = [[t for o in run for t in o.token_ids] for run in seeded]
    assert flat[0] == flat[1]
    other = loop.run(
        collect(engine, request(temperature=1.0, seed=124, max_tokens=8, ignore_eos=True))
    )
    assert [t for o in other for t in o.token_ids] != flat[0]


def test_chat_prompt_uses_the_template(engine_loop):
    engine, loop = engine_loop
    prompt = ChatPrompt([{"role": "user", "content": "What is the capital of France?"}])
    expected = engine.tokenize(prompt)
    assert engine.detokenize(expected).startswith("<|im_start|>user\nWhat is the capital")
    outs = loop.run(collect(engine, request(prompt, temperature=0, max_tokens=4, ignore_eos=True)))
    assert outs[-1].num_prompt_tokens == len(expected)


def test_stop_string_finishes_and_is_not_streamed(engine_loop):
    engine, loop = engine_loop
    base = loop.run(collect(engine, request(temperature=0, max_tokens=24, ignore_eos=True)))
    text = "".join(o.text for o in base)
    stop = text[5:8]
    assert len(stop) == 3 and stop in text
    outs = loop.run(
        collect(engine, request(temperature=0, max_tokens=24, ignore_eos=True, stop=(stop,)))
    )
    got = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert got == text[: text.find(stop)]
    kept = loop.run(
        collect(
            engine,
            request(
                temperature=0,
                max_tokens=24,
                ignore_eos=True,
                stop=(stop,),
                include_stop_str_in_output=True,
            ),
        )
    )
    assert "".join(o.text for o in kept) == text[: text.find(stop) + len(stop)]


def test_output_parsers_run_in_the_detokenize_stage(engine_loop):
    """The random model writes no tags, so: deepseek_r1 (reasoning from the first token) turns the
    whole output into reasoning, qwen3 into content unless the prompt opened <think>, and the
    hermes tool parser passes it through (with special tokens kept, as tool parsers need)."""
    engine, loop = engine_loop

    def run(prompt="Hello world!", **parsers):
        req = request(prompt, temperature=0, max_tokens=16, ignore_eos=True)
        outs = loop.run(collect(engine, replace(req, **parsers)))
        ids = [t for o in outs for t in o.token_ids]
        text, reasoning = "".join(o.text for o in outs), "".join(o.reasoning for o in outs)
        assert not any(o.tool_calls for o in outs) and outs[-1].finish_reason == "length"
        return ids, text, reasoning

    ids, plain, _ = run()
    assert run(reasoning_parser="deepseek_r1") == (ids, "", plain)
    assert run(reasoning_parser="qwen3") == (ids, plain, "")
    opened_ids, opened, _ = run("Hello world! <think>")
    assert run("Hello world! <think>", reasoning_parser="qwen3") == (opened_ids, "", opened)
    kept = engine.bundle.decode(ids, skip_special_tokens=False)
    assert run(tool_call_parser="hermes") == (ids, kept, "")
    with pytest.raises(EngineError, match="unknown tool-call parser"):
        run(tool_call_parser="nope")


def test_prompt_logprobs_arrive_with_the_first_output_across_prefill_chunks(engine_loop):
    engine, loop = engine_loop
    text = " ".join(f"word{i}" for i in range(40))  # more tokens than a step's budget (64)
    ids = engine.bundle.encode(text)
    assert len(ids) > 64
    outs = loop.run(collect(engine, request(text, temperature=0, max_tokens=2, prompt_logprobs=3)))
    first = outs[0]
    assert first.prompt_token_ids == tuple(ids)
    scored = first.prompt_logprobs
    assert scored is not None and len(scored) == len(ids) and scored[0] is None
    assert all(o.prompt_logprobs is None for o in outs[1:])
    for token_id, entry in zip(ids[1:], scored[1:], strict=True):
        assert entry is not None and entry.token_id == token_id and entry.rank >= 1
        assert len(entry.top) == 3 and entry.top[0][3] >= entry.top[1][3] >= entry.top[2][3]
        if entry.rank == 1:
            assert entry.top[0][0] == token_id and abs(entry.top[0][3] - entry.logprob) < 1e-5
        else:
            assert entry.logprob <= entry.top[0][3]
    again = loop.run(collect(engine, request(text, temperature=0, max_tokens=2, prompt_logprobs=3)))
    assert [e.logprob for e in again[0].prompt_logprobs[1:]] == [e.logprob for e in scored[1:]]


def test_prompt_logprobs_of_a_one_token_request(engine_loop):
    """max_tokens 1 (how a prompt is scored) finishes the request in the step that computes its
    last prompt chunk: the prompt logprobs still come back, every position."""
    engine, loop = engine_loop
    for text in ("Hello world, how are you", " ".join(f"word{i}" for i in range(40))):
        ids = engine.bundle.encode(text)
        outs = loop.run(collect(engine, request(text, max_tokens=1, prompt_logprobs=1)))
        assert len(outs) == 1 and outs[0].finish_reason == "length"
        scored = outs[0].prompt_logprobs
        assert scored is not None and len(scored) == len(ids) and scored[0] is None
        assert [e.token_id for e in scored[1:]] == ids[1:]


def test_too_long_prompt_is_a_400_and_the_engine_keeps_serving(engine_loop):
    engine, loop = engine_loop
    with pytest.raises(EngineError) as info:
        loop.run(collect(engine, request(TokensPrompt([5] * 600), max_tokens=4)))
    assert info.value.status == 400 and "maximum context length" in info.value.message
    with pytest.raises(EngineError, match="out of vocabulary"):
        loop.run(collect(engine, request(TokensPrompt([10_000]), max_tokens=4)))
    with pytest.raises(EngineError, match=r"chat template error|need"):
        loop.run(
            collect(
                engine,
                request(
                    ChatPrompt(
                        [{"role": "user", "content": "x"}],
                        continue_final_message=True,
                        add_generation_prompt=False,
                    )
                ),
            )
        )
    outs = loop.run(collect(engine, request(temperature=0, max_tokens=3, ignore_eos=True)))
    assert outs[-1].num_output_tokens == 3


def test_many_concurrent_streams_all_complete(engine_loop):
    engine, loop = engine_loop

    async def many():
        reqs = [
            request(
                f"stream {i} says hello",
                rid=f"c{i}",
                temperature=0.8,
                seed=i,
                max_tokens=20,
                ignore_eos=True,
            )
            for i in range(64)
        ]
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    results = loop.run(many(), timeout=300)
    assert all(r[-1].finish_reason == "length" and r[-1].num_output_tokens == 20 for r in results)
    # Schedule publishes its gauges once it has sent the last tokens on; on a loaded machine the
    # client can have them first.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.stats()["num_requests_running"] > 0:
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["num_requests_running"] == 0 and stats["kv_cache_usage_perc"] == 0


def test_disconnect_aborts_and_frees_every_kv_block(engine_loop):
    engine, loop = engine_loop

    async def leave_early():
        streams = [
            engine.generate(
                request(f"long request {i}", rid=f"d{i}", max_tokens=400, ignore_eos=True)
            )
            for i in range(8)
        ]
        for s in streams:
            await anext(s)
        busy = engine.stats()["kv_cache_usage_perc"]
        for s in streams:
            await s.aclose()  # what a client that disconnects looks like to the engine
        return busy

    busy = loop.run(leave_early())
    assert busy > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.stats()["kv_cache_usage_perc"] > 0:
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["kv_cache_usage_perc"] == 0 and stats["num_requests_running"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_dummy_execute_runs_the_pipeline_without_a_model(tiny_chat_model):
    from stages.config import EngineConfig
    from stages.engine import Engine
    from tests.stages.conftest import LoopThread

    runner = LoopThread()
    engine = Engine(
        EngineConfig(
            model_path=tiny_chat_model,
            dummy=True,
            max_num_batched_tokens=64,  # a 40-word prompt takes two chunks
            log_format="json",
            log_level="warning",
        )
    )
    try:
        runner.run(engine.start())
        outs = runner.run(collect(engine, request(max_tokens=50)))
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 50
        again = runner.run(collect(engine, request(max_tokens=50)))
        tokens = [t for o in outs for t in o.token_ids]
        assert len(tokens) == 50 and [t for o in again for t in o.token_ids] == tokens
        # a grammar is ready at once there (the null model writes what it writes)
        spec = StructuredOutput("regex", "[a-z]+")
        shaped = runner.run(collect(engine, request(max_tokens=5, structured=spec)))
        assert shaped[-1].num_output_tokens == 5
        # prompt logprobs come back there too, for a one-token request as for a longer one
        text = " ".join(f"word{i}" for i in range(40))
        ids = engine.bundle.encode(text)
        for max_tokens in (1, 2):
            for k in (0, 2):
                outs = runner.run(
                    collect(engine, request(text, max_tokens=max_tokens, prompt_logprobs=k))
                )
                scored = outs[0].prompt_logprobs
                assert scored is not None and len(scored) == len(ids) and scored[0] is None
                assert [(e.token_id, e.logprob, e.rank) for e in scored[1:]] == [
                    (t, 0.0, 1) for t in ids[1:]
                ]
                assert all(len(e.top) == min(k, 1) for e in scored[1:])
    finally:
        runner.run(engine.stop())
        runner.close()


def test_structured_outputs_hold_through_the_pipeline(engine_loop):
    """The random model writes what its grammar allows, beside unconstrained requests."""
    import json

    from stages.api import StructuredOutput

    engine, loop = engine_loop
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}, "n": {"enum": [1, 22]}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    specs = [
        StructuredOutput("json", json.dumps(schema)),
        StructuredOutput("regex", "[0-9]{4}"),
        StructuredOutput("choice", json.dumps(["yes", "no"])),
    ]

    async def together():
        requests = [
            request(rid=f"s{i}", temperature=1.0, seed=i, max_tokens=60, structured=spec)
            for i, spec in enumerate(specs)
        ]
        requests.append(request(rid="free", temperature=0, max_tokens=8, ignore_eos=True))
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    constrained_json, digits, choice, free = loop.run(together())
    texts = ["".join(o.text for o in outs) for outs in (constrained_json, digits, choice)]
    assert json.loads(texts[0]) in [{"color": c, "n": n} for c in ("red", "blue") for n in (1, 22)]
    assert texts[1].isdigit() and len(texts[1]) == 4
    assert texts[2] in ("yes", "no")
    for outs in (constrained_json, digits, choice):
        assert outs[-1].finish_reason == "stop"  # EOS, once the grammar was complete
    assert free[-1].num_output_tokens == 8
    with pytest.raises(EngineError) as info:
        loop.run(
            collect(engine, request(structured=StructuredOutput("regex", "[", "guided_regex")))
        )
    assert info.value.status == 400 and info.value.param == "guided_regex"


def test_a_repeated_prompt_is_served_from_the_prefix_cache(engine_loop):
    engine, loop = engine_loop
    prompt = "Streaming tokens through shared memory rings between processes. " * 3
    hits_before = engine.stats().get("prefix_cache_hits_total", 0)

    def run():
        outs = loop.run(
            collect(engine, request(prompt, temperature=0, max_tokens=8, ignore_eos=True))
        )
        return [t for o in outs for t in o.token_ids], outs[-1]

    first_ids, first = run()
    again_ids, again = run()
    assert first.metrics.num_cached_prompt_tokens == 0
    cached = again.metrics.num_cached_prompt_tokens
    assert 0 < cached < again.num_prompt_tokens  # whole blocks, and never the last token
    assert again_ids == first_ids  # the cached KV is the KV the prompt would have had
    assert engine.stats()["prefix_cache_hits_total"] - hits_before == cached
    # prompt logprobs need every prompt position computed: no cache for them
    scored = loop.run(
        collect(engine, request(prompt, temperature=0, max_tokens=1, prompt_logprobs=1))
    )
    assert scored[-1].metrics.num_cached_prompt_tokens == 0


def test_bad_words_never_appear_in_the_output(engine_loop):
    from stages.text.prompts import bad_word_ids

    engine, loop = engine_loop

    def greedy(**extra):
        outs = loop.run(
            collect(engine, request(temperature=0, max_tokens=12, ignore_eos=True, **extra))
        )
        return [t for o in outs for t in o.token_ids]

    plain = greedy()
    word = engine.bundle.decode(plain[:2])
    sequences = [list(ids) for ids in bad_word_ids(engine.bundle, [word])]

    def contains(ids, seq):
        return any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))

    assert any(contains(plain, seq) for seq in sequences)  # the word is there without the ban
    banned = greedy(bad_words=(word,))
    assert len(banned) == 12 and not any(contains(banned, seq) for seq in sequences)


def test_shared_prefixes_under_preemption_and_aborts_free_every_block(engine_loop):
    """64 blocks of 16 tokens, 24 requests sharing a 5-block prefix and each wanting 5 more blocks
    of output: preemption, cache hits on shared blocks, and aborts mid-stream, all at once."""
    from stages.api import StructuredOutput

    engine, loop = engine_loop
    prefix = "Shared instructions for every request in this test, kept long on purpose. " * 5
    preemptions_before = engine.stats().get("num_preemptions_total", 0)

    async def run():
        async def one(i: int):
            req = request(
                prefix + f"Request {i}.",
                rid=f"p{i}",
                temperature=0.7,
                seed=i,
                max_tokens=80,
                ignore_eos=True,
                structured=StructuredOutput("regex", "[a-z ]{80}") if i % 4 == 0 else None,
            )
            outs = []
            async for out in engine.generate(req):
                outs.append(out)
                if i % 5 == 0 and len(outs) == 3:
                    break  # leaves mid-stream: an abort
            return outs

        return await asyncio.gather(*(one(i) for i in range(24)))

    results = loop.run(run(), timeout=300)
    finished = [r for i, r in enumerate(results) if i % 5]
    assert all(r[-1].finish_reason == "length" and r[-1].num_output_tokens == 80 for r in finished)
    for i in range(0, 24, 4):  # the constrained ones held to their grammar across preemptions
        if i % 5:
            text = "".join(o.text for o in results[i])
            assert len(text) == 80 and set(text) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert any(r[-1].metrics.num_cached_prompt_tokens > 0 for r in finished)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.stats()["kv_cache_usage_perc"] > 0:
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["num_preemptions_total"] > preemptions_before
    assert stats["kv_cache_usage_perc"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0


def many_choices(count: int) -> StructuredOutput:
    """A choice grammar that takes a while to compile and to build a matcher for (both grow
    faster than the number of choices)."""
    import hashlib
    import json

    choices = [hashlib.blake2b(str(i).encode(), digest_size=6).hexdigest() for i in range(count)]
    return StructuredOutput("choice", json.dumps(choices), "structured_outputs.choice")


def stamped(engine, req, events):
    """Runs the request, appending (request id, output, arrival ns) to events as outputs come."""

    async def run():
        async for out in engine.generate(req):
            events.append((req.request_id, out, now_ns()))

    return run()


def test_a_large_grammar_does_not_hold_up_the_request_sent_after_it(engine_loop):
    """Render compiles it in a worker thread (and execute builds its matcher in one): a plain
    request sent right after it is answered in full before it gets its first token."""
    engine, loop = engine_loop
    big = request(rid="big", temperature=1.0, seed=1, max_tokens=4, structured=many_choices(9000))
    plain = request(rid="plain", temperature=0, max_tokens=4, ignore_eos=True)

    async def race():
        events = []
        first = asyncio.create_task(stamped(engine, big, events))
        await asyncio.sleep(0)  # big is on the requests ring (its send does not wait)
        await asyncio.gather(first, stamped(engine, plain, events))
        return events

    events = loop.run(race())
    order = [(rid, out.finish_reason) for rid, out, _ in events]
    assert order.index(("plain", "length")) < order.index(next(e for e in order if e[0] == "big"))
    assert "".join(out.text for rid, out, _ in events if rid == "big")  # a choice, in the end


def test_streams_go_on_while_a_grammar_matcher_is_built(engine_loop):
    """Execute builds a matcher in a worker thread and schedule plans its request once it is
    ready: between the request's render and its first scheduling, a running stream gets tokens."""
    engine, loop = engine_loop
    stream = request(rid="stream", temperature=0, max_tokens=300, ignore_eos=True)
    big = request(rid="big", temperature=1.0, seed=2, max_tokens=4, structured=many_choices(9000))

    async def together():
        events = []
        running = asyncio.create_task(stamped(engine, stream, events))
        while not events:  # the stream is decoding
            await asyncio.sleep(0.005)
        await stamped(engine, big, events)
        await running
        return events

    events = loop.run(together())
    metrics = next(out.metrics for rid, out, _ in events if rid == "big" and out.finish_reason)
    during = [t for rid, _, t in events if rid == "stream" and metrics.rendered_ns < t]
    during = [t for t in during if t < metrics.scheduled_ns]
    assert len(during) >= 5, (metrics, len(during))


def test_a_long_prompt_does_not_hold_up_the_request_sent_after_it(engine_loop):
    """2 MB of text to tokenize (kept by truncation) renders in a worker thread."""
    engine, loop = engine_loop
    huge = request(
        "The quick brown fox jumps over the lazy dog. " * 45_000,
        rid="huge",
        temperature=0,
        max_tokens=2,
        truncate_prompt_tokens=100,
    )
    plain = request(rid="plain", temperature=0, max_tokens=4, ignore_eos=True)

    async def race():
        events = []
        first = asyncio.create_task(stamped(engine, huge, events))
        await asyncio.sleep(0)
        await asyncio.gather(first, stamped(engine, plain, events))
        return events

    events = loop.run(race())
    order = [(rid, out.finish_reason) for rid, out, _ in events]
    assert order.index(("plain", "length")) < order.index(next(e for e in order if e[0] == "huge"))
    assert events[-1][1].num_prompt_tokens == 100


def test_grammars_and_prompts_over_the_limits_are_400s(engine_loop):
    import json

    engine, loop = engine_loop
    with pytest.raises(EngineError) as info:  # 100,000 choices: 1.3 MB of JSON
        loop.run(collect(engine, request(max_tokens=4, structured=many_choices(100_000))))
    assert info.value.status == 400 and info.value.param == "structured_outputs.choice"
    assert "at most" in info.value.message
    short = StructuredOutput("choice", json.dumps([str(i) for i in range(10_001)]), "guided_choice")
    with pytest.raises(EngineError, match="10001 choices") as info:
        loop.run(collect(engine, request(max_tokens=4, structured=short)))
    assert info.value.param == "guided_choice"
    with pytest.raises(EngineError) as info:  # far more text than 512 tokens can hold
        loop.run(collect(engine, request("x" * 2_000_000, max_tokens=4)))
    assert info.value.code == "context_length_exceeded" and "characters" in info.value.message
    outs = loop.run(collect(engine, request(temperature=0, max_tokens=3, ignore_eos=True)))
    assert outs[-1].num_output_tokens == 3


def test_requests_left_while_their_grammar_compiles_or_builds_free_everything(engine_loop):
    engine, loop = engine_loop

    async def leave(delay_s):
        stream = engine.generate(request(rid=f"gone{delay_s}", structured=many_choices(6000)))
        waiting = asyncio.create_task(anext(stream))
        await asyncio.sleep(delay_s)  # in render, waiting for its matcher, or running
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await waiting
        await stream.aclose()

    async def all_leave():
        await asyncio.gather(*(leave(d) for d in (0.0, 0.02, 0.1, 0.2, 0.4)))

    loop.run(all_leave())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        engine.stats()["num_requests_waiting"] or engine.stats()["kv_cache_usage_perc"]
    ):
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["num_requests_waiting"] == 0 and stats["num_requests_running"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    import json

    spec = many_choices(50)
    outs = loop.run(collect(engine, request(max_tokens=40, structured=spec)))
    assert "".join(o.text for o in outs) in json.loads(spec.value)
    assert outs[-1].finish_reason == "stop"


def test_the_deepest_grammars_within_the_limits_kill_no_stage(engine_loop):
    """Render compiles and execute builds on threads with stacks deep enough for llguidance's
    recursion (a chain of 1,000 $refs overflowed the default stack: a segfault, a restart)."""
    from tests.stages.text.test_structured import deep_specs

    engine, loop = engine_loop
    for spec in deep_specs():
        outs = loop.run(collect(engine, request(temperature=0, max_tokens=6, structured=spec)))
        assert outs[-1].finish_reason in ("length", "stop")
    assert engine.ready


def test_render_gives_exactly_the_prompt_generation_sees(engine_loop):
    engine, loop = engine_loop
    chat = ChatPrompt([{"role": "user", "content": "What is the capital of France? " * 3}])
    whole = engine.tokenize(chat)
    for keep in (None, 5, -1):
        req = request(chat, temperature=0, max_tokens=3, truncate_prompt_tokens=keep)
        rendered = loop.run(engine.render(req))
        # prompt_logprobs=0 makes generation report the prompt ids it ran on
        scored = replace(req, sampling=replace(req.sampling, prompt_logprobs=0))
        outs = loop.run(collect(engine, scored))
        assert rendered.token_ids == list(outs[0].prompt_token_ids)
        assert rendered.token_ids == (whole if keep is None else whole[-5:] if keep == 5 else whole)
        assert rendered.text == engine.detokenize(rendered.token_ids)
        assert rendered.max_tokens == 3
    unbounded = loop.run(engine.render(request(chat)))
    assert unbounded.max_tokens == engine.max_model_len - len(whole)


def test_render_refuses_what_generation_refuses(engine_loop):
    engine, loop = engine_loop
    bad = [
        request(TokensPrompt([5] * 600), max_tokens=4),
        request(structured=StructuredOutput("regex", "[", "guided_regex")),  # compiles in render
        request(TokensPrompt([10_000])),
    ]
    for req in bad:
        with pytest.raises(EngineError) as generated:
            loop.run(collect(engine, req))
        with pytest.raises(EngineError) as rendered:
            loop.run(engine.render(req))
        assert (rendered.value.status, rendered.value.message, rendered.value.param) == (
            generated.value.status,
            generated.value.message,
            generated.value.param,
        )
    assert loop.run(engine.render(request("Hello"))).token_ids == engine.bundle.encode("Hello")


def test_a_prefix_cache_reset_makes_a_repeated_prompt_compute_again(engine_loop):
    engine, loop = engine_loop
    prompt = "The quick brown fox jumps over the lazy dog, again and again. " * 3

    def cached():
        outs = loop.run(collect(engine, request(prompt, temperature=0, max_tokens=2)))
        return outs[-1].metrics.num_cached_prompt_tokens

    cached()
    assert cached() > 0
    loop.run(engine.reset_prefix_cache())
    assert cached() == 0  # the request right after the reset computes its whole prompt
    assert cached() > 0  # and registers it again


def test_reasoning_tokens_are_counted_in_the_detokenize_stage(engine_loop):
    """A grammar makes the random model write think tags; the final output says how many output
    tokens lie inside them (a token counts when any of its characters is reasoning). The prompt
    ends with closed tags (as a template that turns thinking off writes), so the grammar holds
    from the first token instead of after the reasoning (vLLM's rule)."""
    engine, loop = engine_loop
    shape = StructuredOutput("regex", "<think>[a-z ]{8,24}</think>[a-z]{2,6}", "guided_regex")
    bundle = engine.bundle
    closed = list(bundle.encode("Hello world!"))
    closed += bundle.encode("<think>", add_bos=False) + bundle.encode("</think>", add_bos=False)
    req = replace(
        request(TokensPrompt(closed), temperature=0, max_tokens=48, structured=shape),
        reasoning_parser="qwen3",
    )
    outs = loop.run(collect(engine, req))
    final = outs[-1]
    assert all(o.num_reasoning_tokens == 0 for o in outs[:-1])
    ids = [t for o in outs for t in o.token_ids]
    pieces = [engine.bundle.decode(ids[: i + 1]) for i in range(len(ids))]
    text = pieces[-1]
    start, end = text.index("<think>") + len("<think>"), text.index("</think>")
    expected, before = 0, 0
    for piece in pieces:
        expected += before < end and len(piece) > start and len(piece) > before
        before = len(piece)
    assert 0 < final.num_reasoning_tokens == expected < len(ids)
    assert "".join(o.reasoning for o in outs) == text[start:end]
    plain = loop.run(collect(engine, request(temperature=0, max_tokens=4)))
    assert plain[-1].num_reasoning_tokens == 0  # no reasoning parser


def test_thinking_token_budget_forces_the_end_of_thinking(engine_loop):
    """vLLM's thinking_token_budget: after that many tokens inside the reasoning parser's tags,
    the close tag's tokens are forced; the reasoning then ends and the content begins."""
    engine, loop = engine_loop
    end = engine.bundle.encode("</think>", add_bos=False)
    budgeted = replace(
        request(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, thinking_token_budget=4),
        reasoning_parser="deepseek_r1",  # the output begins inside the thinking
    )
    outs = loop.run(collect(engine, budgeted))
    ids = [t for o in outs for t in o.token_ids]
    assert ids[4 : 4 + len(end)] == end and len(ids) == 12
    reasoning = "".join(o.reasoning for o in outs)
    assert reasoning == engine.bundle.decode(ids[:4], skip_special_tokens=True)
    assert "".join(o.text for o in outs) == engine.bundle.decode(
        ids[4 + len(end) :], skip_special_tokens=True
    )
    free = replace(budgeted, sampling=replace(budgeted.sampling, thinking_token_budget=None))
    unbudgeted = [t for o in loop.run(collect(engine, free)) for t in o.token_ids]
    assert unbudgeted[:4] == ids[:4] and unbudgeted[4 : 4 + len(end)] != end  # same seed
    with pytest.raises(EngineError) as info:  # no tags to count the thinking by
        loop.run(collect(engine, request(max_tokens=4, thinking_token_budget=4)))
    assert info.value.status == 400 and info.value.param == "thinking_token_budget"
    # under a grammar (vLLM's default, enable_in_reasoning false): the thinking is free, its
    # end forced, and the grammar holds from there
    with_grammar = replace(
        budgeted,
        sampling=replace(
            budgeted.sampling, structured=StructuredOutput("regex", "[a-z]{3}"), ignore_eos=False
        ),
    )
    outs = loop.run(collect(engine, with_grammar))
    ids = [t for o in outs for t in o.token_ids]
    assert ids[4 : 4 + len(end)] == end
    assert re.fullmatch("[a-z]{3}", "".join(o.text for o in outs))


def test_every_planned_step_lands_in_the_iteration_tokens_histogram(engine_loop):
    """vLLM's iteration_tokens_total: schedule counts each step by its prompt tokens and the
    tokens it made; a prompt's step and each decode step of one request show up as such."""
    engine, loop = engine_loop

    def histogram() -> tuple[dict[str, float], float]:
        stats = engine.stats()
        buckets = {k: v for k, v in stats.items() if k.startswith("iteration_tokens_total{")}
        return buckets, stats["iteration_tokens_total_sum"]

    # the test before may leave a step in flight (async scheduling plans one ahead of a request
    # whose grammar then ends it): it lands, and counts, after its client has the last token
    before, before_sum = histogram()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = histogram()
        if now == (before, before_sum):
            break
        before, before_sum = now
    outs = loop.run(collect(engine, request(temperature=0, max_tokens=6, ignore_eos=True)))
    prompt = outs[-1].num_prompt_tokens
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and histogram()[1] < before_sum + prompt + 6:
        time.sleep(0.05)  # schedule publishes after it has sent the last tokens on
    after, after_sum = histogram()
    steps = after["iteration_tokens_total{le=+Inf}"] - before["iteration_tokens_total{le=+Inf}"]
    one_token = after["iteration_tokens_total{le=1}"] - before["iteration_tokens_total{le=1}"]
    # the prompt's step (one chunk: it fits the step budget), which makes the first token, and
    # 5 decode steps of one token each; each step counts the prompt tokens it computed and the
    # tokens it made, as vLLM counts them
    assert steps == 6 and one_token == 5
    assert after_sum - before_sum == prompt + 6
    assert list(after.values()) == sorted(after.values())  # cumulative counts
