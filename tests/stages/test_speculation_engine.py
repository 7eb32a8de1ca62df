"""Speculative decoding through the four processes on a tiny random model: the same tokens as
without it, with drafts accepted, counted and their KV given back."""

from __future__ import annotations

import asyncio
import time

import pytest
from msgspec.structs import replace

from stages.config import EngineConfig
from stages.engine import Engine
from stages.speculative_config import SpeculativeConfig
from tests.stages.conftest import LoopThread
from tests.stages.test_engine import collect, request

# Prompts whose continuations repeat what came before (a random model loops, too).
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "Paris is the capital of France. Paris is the capital of",
    "Hello world! Hello world! Hello",
]


def _config(model: str, speculative: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(
        model_path=model,
        served_model_name="tiny",
        max_num_seqs=16,
        max_num_batched_tokens=64,
        kv_cache_bytes=64 * 2 * 2 * 16 * 2 * 16 * 4,  # 64 blocks of 16 tokens
        threads=1,
        log_format="json",
        log_level="warning",
        speculative=speculative,
    )


@pytest.fixture(scope="module")
def engines(tiny_chat_model):
    """(plain engine, speculating engine, loop thread) on the same tiny model."""
    runner = LoopThread()
    # Every proposal drafted: on this tiny model a step is so cheap that the adaptive policy
    # rightly drafts little, and these tests are about what drafts do.
    spec = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 3, "adaptive_draft_length": false}'
    )
    plain = Engine(_config(tiny_chat_model, None))
    fast = Engine(_config(tiny_chat_model, spec))
    runner.run(plain.start())
    runner.run(fast.start())
    yield plain, fast, runner
    runner.run(fast.stop())
    runner.run(plain.stop())
    runner.close()


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _wait_idle(engine: Engine) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.stats()["num_requests_running"] > 0:
        time.sleep(0.02)
    return engine.stats()


def test_greedy_tokens_equal_plain_decoding_and_drafts_are_accepted(engines):
    plain, fast, loop = engines
    before = fast.stats()
    for i, prompt in enumerate(PROMPTS):
        kwargs = dict(temperature=0, max_tokens=40, ignore_eos=True)
        want = loop.run(collect(plain, request(prompt, rid=f"p{i}", **kwargs)))
        got = loop.run(collect(fast, request(prompt, rid=f"s{i}", **kwargs)))
        assert _tokens(got) == _tokens(want), prompt
        assert "".join(o.text for o in got) == "".join(o.text for o in want)
        assert got[-1].num_output_tokens == 40 and got[-1].finish_reason == "length"
    after = _wait_idle(fast)
    drafted = (
        after["spec_decode_num_draft_tokens_total"] - before["spec_decode_num_draft_tokens_total"]
    )
    accepted = (
        after["spec_decode_num_accepted_tokens_total"]
        - before["spec_decode_num_accepted_tokens_total"]
    )
    assert drafted > 0 and accepted > 0
    assert after["kv_cache_usage_perc"] == 0


def test_seeded_sampling_is_reproducible_with_speculation(engines):
    _, fast, loop = engines
    kwargs = dict(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    runs = [
        loop.run(collect(fast, request(PROMPTS[0], rid=f"seed{i}", **kwargs))) for i in range(2)
    ]
    assert _tokens(runs[0]) == _tokens(runs[1])


def test_per_request_metrics_sum_to_the_counters(engines):
    _, fast, loop = engines
    before = _wait_idle(fast)
    finals = []
    for i, prompt in enumerate(PROMPTS):
        outs = loop.run(
            collect(
                fast, request(prompt, rid=f"m{i}", temperature=0, max_tokens=24, ignore_eos=True)
            )
        )
        finals.append(outs[-1].metrics)
    after = _wait_idle(fast)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert sum(m.spec_num_steps for m in finals) == delta("spec_decode_num_drafts_total")
    assert sum(m.spec_num_draft_tokens for m in finals) == delta(
        "spec_decode_num_draft_tokens_total"
    )
    accepted = sum(m.spec_num_accepted_tokens for m in finals)
    assert accepted == delta("spec_decode_num_accepted_tokens_total") > 0
    per_pos = [
        delta(f"spec_decode_num_accepted_tokens_per_pos_total{{position={p}}}") for p in range(4)
    ]
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # draft j is accepted only after j - 1
    for m in finals:
        assert len(m.spec_acceptance_histogram) == 5
        assert sum(m.spec_acceptance_histogram) == m.spec_num_steps
        assert sum(i * n for i, n in enumerate(m.spec_acceptance_histogram)) == (
            m.spec_num_accepted_tokens
        )


def test_stops_and_limits_inside_a_draft_end_the_output_there(engines):
    plain, fast, loop = engines
    base = dict(temperature=0, ignore_eos=True)
    want = _tokens(loop.run(collect(plain, request(PROMPTS[0], rid="ref", max_tokens=40, **base))))
    # max_tokens at every length: nothing after the limit is emitted or counted
    for limit in (1, 2, 3, 5, 7, 11):
        outs = loop.run(
            collect(fast, request(PROMPTS[0], rid=f"l{limit}", max_tokens=limit, **base))
        )
        assert _tokens(outs) == want[:limit]
        assert outs[-1].num_output_tokens == limit
    # a stop token id in the middle of the run: it ends the output, nothing after it
    stop_id = want[9]
    first = want.index(stop_id)
    outs = loop.run(
        collect(
            fast, request(PROMPTS[0], rid="stop", max_tokens=40, stop_token_ids=[stop_id], **base)
        )
    )
    assert _tokens(outs) == want[: first + 1]
    assert outs[-1].finish_reason == "stop"
    assert _wait_idle(fast)["kv_cache_usage_perc"] == 0


def test_many_streams_with_aborts_logprobs_and_n_leave_every_block_free(engines):
    plain, fast, loop = engines

    async def mixed():
        async def full(i):
            kwargs = dict(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
            return await collect(fast, request(PROMPTS[i % 4], rid=f"x{i}", **kwargs))

        async def leave(i):
            stream = fast.generate(
                request(PROMPTS[i % 4], rid=f"a{i}", max_tokens=200, ignore_eos=True, temperature=0)
            )
            await anext(stream)
            await anext(stream)
            await stream.aclose()

        async def stopped():  # a stop string, prompt logprobs and a grammar beside them
            from stages.api import StructuredOutput

            outs = await collect(
                fast,
                request(
                    PROMPTS[2],
                    rid="st",
                    temperature=0,
                    max_tokens=40,
                    stop=["the"],
                    prompt_logprobs=1,
                ),
            )
            shaped = await collect(
                fast,
                request(
                    PROMPTS[0],
                    rid="gr",
                    temperature=0,
                    max_tokens=30,
                    structured=StructuredOutput("regex", "(the |quick |fox )+"),
                ),
            )
            return outs, shaped

        tasks = [full(i) for i in range(6)] + [leave(i) for i in range(6)] + [stopped()]
        return await asyncio.gather(*tasks)

    results = loop.run(mixed())
    stop_outs, shaped = results[-1]
    assert "the" not in "".join(o.text for o in stop_outs)
    assert stop_outs[0].prompt_logprobs is not None
    assert shaped[-1].finish_reason in ("stop", "length")
    for i, outs in enumerate(results[:6]):
        ref = loop.run(
            collect(
                plain,
                request(
                    PROMPTS[i % 4], rid=f"rx{i}", temperature=0, max_tokens=30, ignore_eos=True
                ),
            )
        )
        assert _tokens(outs) == _tokens(ref)
        for o in outs:  # every token emitted, accepted draft or not, has its logprobs
            assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
    stats = _wait_idle(fast)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and fast.stats()["kv_cache_usage_perc"] > 0:
        time.sleep(0.05)
    stats = fast.stats()
    assert stats["kv_cache_usage_perc"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_drafts_under_a_grammar_keep_its_output_and_roll_back_what_was_refused(engines):
    from stages.api import StructuredOutput

    plain, fast, loop = engines
    before = _wait_idle(fast)
    # A repeating pattern: prompt lookup drafts it, the grammar allows some drafts and refuses
    # others (a draft it refuses is never emitted, and the matcher is rolled back past it).
    grammar = StructuredOutput("regex", "(ab|cd){4,12}x")
    prompt = "abababcdabab cd ab ab abab"
    kwargs = dict(temperature=0, max_tokens=40, structured=grammar)
    want = loop.run(collect(plain, request(prompt, rid="g0", **kwargs)))
    got = loop.run(collect(fast, request(prompt, rid="g1", **kwargs)))
    assert _tokens(got) == _tokens(want)
    text = "".join(o.text for o in got)
    assert text == "".join(o.text for o in want)
    import re

    assert re.fullmatch("(ab|cd){4,12}x", text), text
    after = _wait_idle(fast)
    assert (
        after["spec_decode_num_draft_tokens_total"] > before["spec_decode_num_draft_tokens_total"]
    )
    assert after["kv_cache_usage_perc"] == 0


@pytest.fixture(scope="module")
def suffix_engine(tiny_chat_model, engines):
    """A speculating engine on suffix decoding, beside the module's others."""
    _, _, loop = engines
    spec = SpeculativeConfig.parse(
        '{"method": "suffix", "num_speculative_tokens": 6, "adaptive_draft_length": false}'
    )
    engine = Engine(_config(tiny_chat_model, spec))
    loop.run(engine.start())
    yield engine
    loop.run(engine.stop())


def test_suffix_decoding_keeps_greedy_tokens_and_drafts_from_earlier_outputs(
    engines, suffix_engine
):
    plain, _, loop = engines
    kwargs = dict(temperature=0, max_tokens=32, ignore_eos=True)
    accepted = []
    for round_ in range(2):  # the second round finds the first's outputs in the cache
        before = _wait_idle(suffix_engine)
        for i, prompt in enumerate(PROMPTS):
            want = loop.run(collect(plain, request(prompt, rid=f"sp{round_}{i}", **kwargs)))
            got = loop.run(collect(suffix_engine, request(prompt, rid=f"ss{round_}{i}", **kwargs)))
            assert _tokens(got) == _tokens(want), prompt
        after = _wait_idle(suffix_engine)
        accepted.append(
            after["spec_decode_num_accepted_tokens_total"]
            - before["spec_decode_num_accepted_tokens_total"]
        )
    assert accepted[0] > 0 and accepted[1] > accepted[0]
    assert _wait_idle(suffix_engine)["kv_cache_usage_perc"] == 0


@pytest.mark.slow
def test_a_stage_killed_mid_speculation_resumes_with_the_tokens_of_a_plain_run(engines):
    import os
    import signal

    plain, fast, loop = engines
    kwargs = dict(temperature=0, max_tokens=60, ignore_eos=True)
    want = _tokens(loop.run(collect(plain, request(PROMPTS[1], rid="kp", **kwargs))))

    async def killed_midway(stage: str):
        stream = fast.generate(request(PROMPTS[1], rid=f"k{stage}", **kwargs))
        outs = [await anext(stream) for _ in range(3)]
        os.kill(fast.supervisor.pids()[stage], signal.SIGKILL)
        outs += [out async for out in stream]
        return outs

    for stage in ("execute", "schedule"):
        outs = loop.run(killed_midway(stage), timeout=180)
        assert _tokens(outs) == want, stage
        assert outs[-1].metrics is not None and outs[-1].metrics.num_recoveries == 1
    assert _wait_idle(fast)["kv_cache_usage_perc"] == 0


def test_a_thinking_budget_forces_its_close_tag_inside_drafts(engines):
    """A request with a thinking_token_budget drafts too: a verified position where the budget,
    spent over the drafts before it, forces the close tag takes the tag, so the request writes
    what plain decoding writes, close tag included, greedy and seeded."""
    plain, fast, loop = engines
    end = fast.bundle.encode("</think>", add_bos=False)
    before = _wait_idle(fast)
    steps = 0
    for budget in (2, 3, 4, 5):  # the tag falls at different places in the draft windows
        for kwargs in (dict(temperature=0), dict(temperature=0.8, seed=11)):
            kwargs |= dict(max_tokens=24, ignore_eos=True, thinking_token_budget=budget)

            def budgeted(engine: Engine, rid: str, kwargs=kwargs) -> list:
                req = replace(
                    request(PROMPTS[0], rid=rid, **kwargs), reasoning_parser="deepseek_r1"
                )
                return loop.run(collect(engine, req))

            rid = f"think{budget}{len(kwargs)}"
            want, got = budgeted(plain, rid + "p"), budgeted(fast, rid + "s")
            assert _tokens(got) == _tokens(want), (budget, kwargs)
            assert _tokens(got)[budget : budget + len(end)] == end
            steps += got[-1].metrics.spec_num_steps
    assert steps > 0
    after = _wait_idle(fast)
    assert (
        after["spec_decode_num_accepted_tokens_total"]
        > before["spec_decode_num_accepted_tokens_total"]
    )
    assert after["kv_cache_usage_perc"] == 0
